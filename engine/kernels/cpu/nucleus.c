/* Min-p, top-k and top-p (nucleus) thresholds without a sort: for each row of
 * non-negative weights w (exp of the scaled logits, shifted so the largest is 1), the
 * min-p floor, the k-th largest weight, then the largest value tau such that the
 * weights >= tau hold at least top_p of what those kept. The nucleus is then
 * {w >= tau}: the sort-based rule's top k, then smallest prefix reaching top_p, each
 * plus any token tied with its last one (whose place among equals a sort decides
 * arbitrarily).
 *
 * A sort of a 49,152-token row took ~1.5 ms (torch, 2 threads, 64 rows: ~100 ms). Here
 * a radix select over the weights' bits (non-negative floats order as their integer
 * bits): one pass sums each row's mass (top-p) or count (top-k) into 2048 buckets of
 * the top 11 bits (two interleaved histograms, so runs of tokens in one bucket do not
 * wait on each other's adds), the bucket where the running sum from the top crosses the
 * target is refined by a pass over its members with the next 10 bits, then the last
 * 10: three passes, the last two touching only one bucket's members. Sums in double.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define B1 11 /* bits per level: 11 + 10 + 10 = the 31 bits of a non-negative float */
#define B2 10
#define B3 10

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* The highest bucket b of hist[0, n) with above + sum(hist[b..n)) >= target, and the
 * mass of the buckets above it added to *above. */
static int crossing(const double *hist, int n, double target, double *above) {
    for (int b = n - 1; b > 0; b--) {
        if (*above + hist[b] >= target) return b;
        *above += hist[b];
    }
    return 0;
}

/* The largest value v of w such that the tokens with w >= v hold at least `amount` of
 * the row's mass (by_count = 0, amount = top_p) or number at least `amount` (by_count =
 * 1, amount = k). */
static float select_threshold(const float *w, int vocab, int by_count, double amount, double *hist,
                              float *members) {
    double *odd = hist + (1 << B1), total = 0.0, above = 0.0;
    memset(hist, 0, sizeof(double) << (B1 + 1));
    int i = 0;
    for (; i + 1 < vocab; i += 2) {
        hist[bits_of(w[i]) >> (B2 + B3)] += by_count ? 1.0 : w[i];
        odd[bits_of(w[i + 1]) >> (B2 + B3)] += by_count ? 1.0 : w[i + 1];
    }
    if (i < vocab) hist[bits_of(w[i]) >> (B2 + B3)] += by_count ? 1.0 : w[i];
    for (int b = 0; b < 1 << B1; b++) {
        hist[b] += odd[b];
        total += hist[b];
    }
    if (!by_count && total <= 0.0) return 0.f;  /* nothing left to choose among: keep the zeros */
    const double target = by_count ? amount : amount * total;
    const uint32_t b1 = (uint32_t)crossing(hist, 1 << B1, target, &above);
    /* The crossing bucket's members, gathered without a branch: they are a random
     * tenth or so of a flat row, a branch on each would mispredict at that rate. */
    int n = 0;
    for (i = 0; i < vocab; i++) {
        members[n] = w[i];
        n += bits_of(w[i]) >> (B2 + B3) == b1;
    }
    memset(hist, 0, sizeof(double) << B2);
    for (i = 0; i < n; i++) hist[(bits_of(members[i]) >> B3) & ((1u << B2) - 1)] += by_count ? 1.0 : members[i];
    const uint32_t b2 = (uint32_t)crossing(hist, 1 << B2, target, &above);
    const uint32_t prefix = (b1 << B2) | b2;
    int m = 0;
    for (i = 0; i < n; i++) {
        members[m] = members[i];
        m += bits_of(members[i]) >> B3 == prefix;
    }
    memset(hist, 0, sizeof(double) << B3);
    for (i = 0; i < m; i++) hist[bits_of(members[i]) & ((1u << B3) - 1)] += by_count ? 1.0 : members[i];
    const uint32_t b3 = (uint32_t)crossing(hist, 1 << B3, target, &above);
    const uint32_t tau = (prefix << B3) | b3;
    float f;
    memcpy(&f, &tau, 4);
    return f;
}

static void zero_below(float *row, int vocab, float t) {
    for (int i = 0; i < vocab; i++) row[i] = row[i] >= t ? row[i] : 0.f;
}

/* w [rows, vocab] (row stride `stride`, every weight >= 0 and finite, each row's largest
 * 1), min_p [rows] (0: none), top_k [rows] (0: none) and top_p [rows] in (0, 1] (1:
 * none); tau [rows] out: min-p's floor (min_p itself, the largest weight being 1), then
 * top-k's threshold (its k-th largest weight), then top-p's over what those kept (the
 * mass it renormalizes by); 0 where none applies. Each row's weights below its tau are
 * set to 0 in place (a masked_fill by torch on a [64, 49152] batch took ~5 ms, longer
 * than finding the thresholds). Rows [begin, end). */
int nucleus_threshold_f32(float *w, int64_t stride, int vocab, const float *min_p, const int32_t *top_k,
                          const float *top_p, float *tau, int begin, int end) {
    int rc = 0;
    #pragma omp parallel if (end - begin >= 2) reduction(|: rc)
    {
        double *hist = malloc(sizeof(double) << (B1 + 1));
        float *members = malloc(sizeof(float) * (size_t)vocab);
        if (!hist || !members) rc |= 2;
        #pragma omp for schedule(dynamic, 1)
        for (int r = begin; r < end; r++) {
            if (!hist || !members) continue;
            float *row = w + (int64_t)r * stride;
            tau[r] = 0.f;
            if (min_p[r] > 0.f) {
                tau[r] = min_p[r];
                zero_below(row, vocab, tau[r]);
            }
            if (top_k[r] > 0 && top_k[r] < vocab) {  /* below the floor if fewer than k are left */
                tau[r] = fmaxf(tau[r], select_threshold(row, vocab, 1, top_k[r], hist, members));
                zero_below(row, vocab, tau[r]);
            }
            if (top_p[r] < 1.f) {
                tau[r] = select_threshold(row, vocab, 0, top_p[r], hist, members);
                zero_below(row, vocab, tau[r]);
            }
        }
        free(hist);
        free(members);
    }
    return rc;
}
