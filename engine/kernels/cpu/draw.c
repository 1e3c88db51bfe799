/* The plain draw: one token per row of raw logits for rows that ask for nothing but a
 * temperature (no processor, filter or logprobs), read where the LM head wrote them.
 *
 * Greedy rows (temperature 0 from the launcher) take the first of their largest logits.
 * The others draw as engine/sampler.py `draw` does on exp((logit - max) / T): the row's
 * weights summed in blocks of 256 tokens, u times the total picks a block by the blocks'
 * cumulative sums (in double), and within it an exponential race on noise keyed by
 * (key, token id) picks the token. The same arithmetic, so a seeded row draws the
 * same token either way (but where rounding moves it: exp and the order of the sums
 * differ here in the last bits, which moves a draw only when u lies that close to a
 * block boundary or two tokens tie in the race to that precision).
 *
 * Two passes over a row in its own dtype (the max, then exp and the block sums) and the
 * chosen block again. The torch path widens a bf16 batch to fp32 and makes ~10 passes
 * over it (max, shift, divide, exp, block sums, gathers): on [64, 49152] bf16 logits, 2
 * threads, 2.6 ms at temperature 1 and 2.1 ms greedy against 0.7 and 0.23 ms here
 * (bench_sampling.py), 4-6% of a decode step at batch 64.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp512.h"

#define BLOCK 256 /* engine/sampler.py _BLOCK */

static inline uint64_t mix32(uint64_t x) {  /* engine/sampler.py _mix32 */
    x = ((x >> 16) ^ x) * 0x45D9F3Bu & 0xffffffffu;
    x = ((x >> 16) ^ x) * 0x45D9F3Bu & 0xffffffffu;
    return (x >> 16) ^ x;
}

/* By the bits: the build's -ffast-math lets the compiler assume isnan() false. */
static inline int not_finite(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7f800000u) == 0x7f800000u;
}

static inline int is_nan(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) > 0x7f800000u;
}

/* The race inside the block starting at `lo` (weights w[0, hi - lo)): the first token
 * with the largest weight / -log((h + 0.5) 2^-32), h = mix32(key ^ mix32(token)). */
static int64_t race(const float *w, int lo, int hi, uint64_t key) {
    double best = -1.0;
    int64_t pick = lo;
    for (int c = lo; c < hi; c++) {
        const double noise = -log(((double)mix32(key ^ mix32((uint64_t)c)) + 0.5) * 0x1p-32);
        const double r = (double)w[c - lo] / noise;
        if (r > best) {
            best = r;
            pick = c;
        }
    }
    return pick;
}

/* The block whose cumulative sum (in double) first exceeds u times the total, u
 * strictly below the total so that some block does (sampler.py's searchsorted). */
static int pick_block(const float *sums, int nb, double u) {
    double total = 0.0;
    for (int b = 0; b < nb; b++) total += sums[b];
    double x = u * total;
    const double below = nextafter(total, 0.0);
    if (x > below) x = below;
    double cum = 0.0;
    for (int b = 0; b < nb; b++) {
        cum += sums[b];
        if (cum > x) return b;
    }
    return nb - 1;
}

#ifdef __AVX512F__
static inline __m512 load16_bf16(const uint16_t *p) { return bf16_widen16(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
#endif

/* Per dtype: the row's largest logit and its first index, the block sums of its
 * weights, the weights of one block. Scalar tails (and the whole row without AVX-512)
 * with libm's expf. */
#define DEFINE_DRAW(NAME, T, LOAD, LOAD16)                                                          \
static float NAME##_max(const T *row, int vocab, int *arg) {                                        \
    int c = 0, a = 0, nan = 0;                                                                      \
    float m = LOAD(row[0]);                                                                         \
    VECTOR_MAX(row, vocab, c, m, a, nan, LOAD16)                                                         \
    for (; c < vocab; c++) {                                                                        \
        const float v = LOAD(row[c]);                                                               \
        if (v > m) {                                                                                \
            m = v;                                                                                  \
            a = c;                                                                                  \
        }                                                                                           \
        nan |= is_nan(v);                                                                           \
    }                                                                                               \
    if (nan || is_nan(m))  /* torch's max propagates a NaN: the first one's index then */         \
        for (c = 0; c < vocab; c++)                                                                 \
            if (is_nan(LOAD(row[c]))) {                                                             \
                a = c;                                                                              \
                m = LOAD(row[c]);                                                                   \
                break;                                                                              \
            }                                                                                       \
    *arg = a;                                                                                       \
    return m;                                                                                       \
}                                                                                                   \
                                                                                                    \
static inline float NAME##_weight(const T *row, int c, float m, float t) {                          \
    return expf(t == 1.f ? LOAD(row[c]) - m : (LOAD(row[c]) - m) / t);                              \
}                                                                                                   \
                                                                                                    \
/* The sum of the weights of tokens [lo, hi), or with w, the weights themselves. */                \
static float NAME##_block(const T *row, int lo, int hi, float m, float t, float *w) {               \
    int c = lo;                                                                                     \
    float s = 0.f;                                                                                  \
    VECTOR_WEIGHTS(row, lo, hi, c, m, t, w, s, LOAD16)                                              \
    for (; c < hi; c++) {                                                                           \
        const float x = NAME##_weight(row, c, m, t);                                                \
        if (w) w[c - lo] = x;                                                                       \
        s += x;                                                                                     \
    }                                                                                               \
    return s;                                                                                       \
}                                                                                                   \
                                                                                                    \
/* logits [rows, vocab] (row stride `stride`); temperature [rows]: 0 for a greedy row,      \
 * else the row's (finite, at least sampler.py's _MIN_TEMPERATURE); u [rows] in [0, 1) and  \
 * keys [rows] (32-bit) as sampler.py's `draw` takes them; tokens [rows] out. Rows         \
 * [begin, end). */                                                                                 \
int NAME(const T *logits, int64_t stride, int vocab, const float *temperature, const double *u,     \
         const int64_t *keys, int64_t *tokens, int begin, int end) {                                \
    if (vocab < 1) return 1;                                                                        \
    const int nb = (vocab + BLOCK - 1) / BLOCK;                                                     \
    int rc = 0;                                                                                     \
    _Pragma("omp parallel if (end - begin >= 2) reduction(|: rc)")                                  \
    {                                                                                               \
        float *sums = malloc(sizeof(float) * (size_t)nb), w[BLOCK];                                 \
        if (!sums) rc |= 2;                                                                         \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int r = begin; r < end; r++) {                                                         \
            if (!sums) continue;                                                                    \
            const T *row = logits + (int64_t)r * stride;                                            \
            int arg;                                                                                \
            const float m = NAME##_max(row, vocab, &arg), t = temperature[r];                       \
            /* Greedy, or no finite largest logit to weigh the others against. */                  \
            if (t == 0.f || not_finite(m)) {                                                        \
                tokens[r] = arg;                                                                    \
                continue;                                                                           \
            }                                                                                       \
            for (int b = 0; b < nb; b++)                                                            \
                sums[b] = NAME##_block(row, b * BLOCK, b + 1 < nb ? (b + 1) * BLOCK : vocab, m, t, NULL); \
            const int b = pick_block(sums, nb, u[r]), lo = b * BLOCK, hi = b + 1 < nb ? lo + BLOCK : vocab; \
            NAME##_block(row, lo, hi, m, t, w);                                                     \
            tokens[r] = race(w, lo, hi, (uint64_t)keys[r]);                                         \
        }                                                                                           \
        free(sums);                                                                                 \
    }                                                                                               \
    return rc;                                                                                      \
}

#ifdef __AVX512F__
/* Sixteen lanes: each keeps its largest value and where it first saw it; then the
 * largest over the lanes, at the smallest index among the lanes that hold it. */
#define VECTOR_MAX(row, vocab, c, m, a, nan, LOAD16)                                                \
    if ((vocab) >= 16) {                                                                            \
        __m512 best = LOAD16(row);                                                                  \
        __mmask16 unordered = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);                         \
        __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);       \
        __m512i idx = at;                                                                           \
        const __m512i step = _mm512_set1_epi32(16);                                                 \
        for (c = 16; c + 16 <= (vocab); c += 16) {                                                  \
            idx = _mm512_add_epi32(idx, step);                                                      \
            const __m512 v = LOAD16((row) + c);                                                     \
            const __mmask16 up = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);                           \
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                    \
            best = _mm512_mask_mov_ps(best, up, v);                                                 \
            at = _mm512_mask_mov_epi32(at, up, idx);                                                \
        }                                                                                           \
        (m) = _mm512_reduce_max_ps(best);                                                           \
        const __mmask16 tops = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);             \
        (a) = _mm512_mask_reduce_min_epi32(tops, at);                                               \
        (nan) = unordered != 0;                                                                     \
    }
#define VECTOR_WEIGHTS(row, lo, hi, c, m, t, w, s, LOAD16)                                          \
    {                                                                                               \
        __m512 acc = _mm512_setzero_ps();                                                           \
        const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(t);                                \
        for (; c + 16 <= (hi); c += 16) {                                                           \
            __m512 d = _mm512_sub_ps(LOAD16((row) + c), vm);                                        \
            if ((t) != 1.f) d = _mm512_div_ps(d, vt);                                               \
            /* expf is 0 below -103.98 (a -inf logit's weight): exp_neg stops at 2^-144 */        \
            const __mmask16 live = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_GE_OQ);         \
            const __m512 x = _mm512_maskz_mov_ps(live, exp_neg(d));                                 \
            if (w) _mm512_storeu_ps((w) + c - (lo), x);                                             \
            acc = _mm512_add_ps(acc, x);                                                            \
        }                                                                                           \
        (s) = _mm512_reduce_add_ps(acc);                                                            \
    }
#else
#define VECTOR_MAX(row, vocab, c, m, a, nan, LOAD16)
#define VECTOR_WEIGHTS(row, lo, hi, c, m, t, w, s, LOAD16)
#endif

DEFINE_DRAW(plain_draw_bf16, uint16_t, bf16_load, load16_bf16)
DEFINE_DRAW(plain_draw_f32, float, f32_load, load16_f32)
