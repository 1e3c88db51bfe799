/* bf16 linear layers on CPUs with AVX-512: y = x W^T (+ bias), by vdpbf16ps where the
 * CPU has AVX512-BF16, by its spelling in AVX-512F FMAs where not (below).
 *
 * oneDNN's packed bf16 matmul streams a decode step's weights at 17-21 GB/s on 2 cores
 * of such a CPU (30 GB/s is what the memory gives) and reaches ~400 GFLOP/s from a few
 * hundred rows. Here W is packed once at load into panels of 16 output columns with
 * pairs of k interleaved, [panel][K/2][16][2], the operand layout of vdpbf16ps: one
 * 64-byte load is one k pair of 16 columns. The micro-kernel keeps MR rows x NR panels
 * of fp32 accumulators in registers; per k pair it loads NR panel vectors, broadcasts
 * each row's (x[k], x[k+1]) pair and issues MR*NR dot-product instructions (32 bf16
 * products each, summed in fp32). A micro-kernel per row count (1..MR), so a decode of
 * 3 rows does 3 rows of work. One rounding to bf16 at the end, after the bias, as a
 * bf16 torch matmul does. Work items: (group of NR panels, chunk of M_CHUNK rows).
 *
 * A decode step's 64 rows are 8 row blocks over each panel group: the first block pulls
 * the group from memory, the others find it in L2. While a group's blocks compute, they
 * ask for the next group's panels (the next in memory) into L2, a share per block, so
 * the next group's first block does not wait on memory (64-row projections on 2 cores
 * of an AVX512-BF16 EPYC: ~390-400 GFLOP/s with it, ~375 without, ~430 at 1024 rows). The
 * schedule is static so that the next group is, but at a thread's last item, the same
 * core's: its L2 is the one that gains.
 *
 * A CPU with AVX-512 but not AVX512-BF16 (Ice Lake Xeons) runs the same layout with the
 * dot product spelled out: a 32-bit lane holds (w[k], w[k+1]) as two bf16, so a shift
 * left by 16 is w[k] in fp32 and a mask of the high half is w[k+1]; two FMAs against
 * x[k] and x[k+1], widened to fp32 once per call, take the place of one vdpbf16ps. Both
 * products are exact in fp32, as vdpbf16ps's are; the sums round in another order. On 2
 * cores of an Ice Lake Xeon it ran SmolLM2's 64-row projections at 1.3-1.9x oneDNN's
 * fp32 matmul on weights widened at load (the fastest other kernel there; it streams
 * twice the bytes) and level with it from 256 rows (0.96-1.09x), at ~170-245 GFLOP/s.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MR 8       /* rows per micro-kernel: MR*NR accumulators + NR loads + 1 broadcast of 32 registers */
#define NR 3       /* panels of 16 columns per micro-kernel */
#define M_CHUNK 256

#if defined(__AVX512BF16__)
#define PATH 1 /* vdpbf16ps */
#elif defined(__AVX512F__)
#define PATH 2 /* two FMAs per k pair on the widened halves */
#else
#define PATH 0
#endif

#if PATH == 2
/* Weighing register pressure per loop keeps all but one of dots()'s 24 accumulators
 * and its 6 weight halves in registers (without it GCC 12 spilled several). With it,
 * one pass over both halves of a k pair ran 1.08-1.18x two passes (the even k, then
 * the odd) on an Ice Lake Xeon's 2 cores. */
#pragma GCC optimize("ira-loop-pressure")
#endif

/* 1: vdpbf16ps; 2: its AVX-512F spelling; 0: neither (gemm_dpbf16 refuses). */
int dpbf16_available(void) { return PATH; }

#if PATH
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The dot products of `rows` rows by `np` panels over all K, into acc. */
#if PATH == 1
typedef uint16_t xtype; /* x as given: (x[k], x[k+1]) is one 32-bit broadcast */

static inline uint32_t pair_at(const uint16_t *xr, int kk, int K) {
    uint32_t pair = xr[2 * kk];
    if (2 * kk + 1 < K) pair |= (uint32_t)xr[2 * kk + 1] << 16;  /* odd K: the last pair is (x, 0) */
    return pair;
}

static inline __attribute__((always_inline)) void dots(__m512 acc[MR][NR], const uint16_t *x, int64_t xs,
        const uint16_t *wp, int64_t pstride, const int rows, const int np, int K, const char *ahead,
        int ahead_lines, int ahead_step) {
    const int K2 = (K + 1) / 2, full = K / 2;
    for (int kk = 0; kk < K2; kk++) {
        for (int l = kk * ahead_step; l < (kk + 1) * ahead_step && l < ahead_lines; l++)
            _mm_prefetch(ahead + (int64_t)l * 64, _MM_HINT_T1);
        __m512bh b[NR];
        for (int j = 0; j < np; j++) b[j] = (__m512bh)_mm512_loadu_si512(wp + j * pstride + (int64_t)kk * 32);
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            if (kk < full) memcpy(&pair, x + (int64_t)i * xs + 2 * kk, 4);
            else pair = (int32_t)pair_at(x + (int64_t)i * xs, kk, K);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < np; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
    }
}
#else
typedef float xtype; /* x widened to fp32, rows of 2 * ceil(K / 2) (an odd K's last pair is (x, 0)) */

static inline __attribute__((always_inline)) void dots(__m512 acc[MR][NR], const float *x, int64_t xs,
        const uint16_t *wp, int64_t pstride, const int rows, const int np, int K, const char *ahead,
        int ahead_lines, int ahead_step) {
    const int K2 = (K + 1) / 2;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int kk = 0; kk < K2; kk++) {
        for (int l = kk * ahead_step; l < (kk + 1) * ahead_step && l < ahead_lines; l++)
            _mm_prefetch(ahead + (int64_t)l * 64, _MM_HINT_T1);
        const uint16_t *wk = wp + (int64_t)kk * 32;
        __m512 ev[NR], od[NR];
        for (int j = 0; j < np; j++) {
            const __m512i w = _mm512_loadu_si512(wk + j * pstride);
            ev[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            od[j] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
        }
        for (int i = 0; i < rows; i++) {
            const __m512 a0 = _mm512_set1_ps(x[(int64_t)i * xs + 2 * kk]);
            const __m512 a1 = _mm512_set1_ps(x[(int64_t)i * xs + 2 * kk + 1]);
            for (int j = 0; j < np; j++) acc[i][j] = _mm512_fmadd_ps(a1, od[j], _mm512_fmadd_ps(a0, ev[j], acc[i][j]));
        }
    }
}
#endif

static inline __attribute__((always_inline)) void micro(const xtype *x, int64_t xs, const uint16_t *wp,
        int64_t pstride, const uint16_t *bias, uint16_t *y, int64_t ys, const int rows, const int np, int cols_last,
        int K, const char *ahead, int ahead_lines, int ahead_step) {
    __m512 acc[MR][NR];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < np; j++) acc[i][j] = _mm512_setzero_ps();
    dots(acc, x, xs, wp, pstride, rows, np, K, ahead, ahead_lines, ahead_step);
    for (int j = 0; j < np; j++) {
        const int cols = j == np - 1 ? cols_last : 16;
        float bf[16] = {0};
        if (bias)
            for (int l = 0; l < cols; l++) bf[l] = bf16_load(bias[j * 16 + l]);
        for (int i = 0; i < rows; i++) {
            float f[16];
            _mm512_storeu_ps(f, acc[i][j]);
            uint16_t *o = y + (int64_t)i * ys + j * 16;
            for (int l = 0; l < cols; l++) o[l] = bf16_store(f[l] + bf[l]);
        }
    }
}

#define CASE(R, P) case R: micro(xm, xs, wp, pstride, bp, ym, ys, R, P, cols_last, K, ahead, ahead_lines, ahead_step); break;
#define ROWS(P) switch (rows) { CASE(1, P) CASE(2, P) CASE(3, P) CASE(4, P) CASE(5, P) CASE(6, P) CASE(7, P) CASE(8, P) }

/* Work items [begin, end) over (panel group, row chunk), M_CHUNK rows each. */
static void run_items(const xtype *x, int64_t xs, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t ys,
                      int M, int N, int K, int begin, int end) {
    const int NP = (N + 15) / 16, groups = (NP + NR - 1) / NR;
    const int64_t pstride = (int64_t)((K + 1) / 2) * 32;
    #pragma omp parallel for schedule(static) if (end - begin >= 2)
    for (int item = begin; item < end; item++) {
        const int g = item % groups, c0 = item / groups * M_CHUNK;
        const int c1 = c0 + M_CHUNK < M ? c0 + M_CHUNK : M;
        const int p0 = g * NR, np = NP - p0 < NR ? NP - p0 : NR;
        const int cols_last = N - (p0 + np - 1) * 16 < 16 ? N - (p0 + np - 1) * 16 : 16;
        const uint16_t *wp = w + (int64_t)p0 * pstride, *bp = bias ? bias + p0 * 16 : NULL;
        /* The next group's cache lines (none after the last group), shared out over this
         * item's row blocks: block b asks for lines [b * share, (b + 1) * share). */
        const int next_np = NP - p0 - np < NR ? NP - p0 - np : NR;
        const int64_t next_lines = (int64_t)next_np * pstride * 2 / 64;
        const int blocks = (c1 - c0 + MR - 1) / MR;
        const int64_t share = (next_lines + blocks - 1) / blocks;
        const char *next = (const char *)(wp + (int64_t)np * pstride);
        for (int m0 = c0; m0 < c1; m0 += MR) {
            const int rows = c1 - m0 < MR ? c1 - m0 : MR;
            const int64_t first = min64((int64_t)((m0 - c0) / MR) * share, next_lines);
            const int ahead_lines = (int)min64(share, next_lines - first);
            const int ahead_step = (ahead_lines + (K + 1) / 2 - 1) / ((K + 1) / 2);  /* lines per k pair */
            const char *ahead = next + first * 64;
            const xtype *xm = x + (int64_t)m0 * xs;
            uint16_t *ym = y + (int64_t)m0 * ys + p0 * 16;
            if (np == 3) { ROWS(3) } else if (np == 2) { ROWS(2) } else { ROWS(1) }
        }
    }
}
#endif

/* x [M, K] (row stride xs), packed W [ceil(N/16)][ceil(K/2)][16][2], y [M, N] (row stride
 * ys); work items [begin, end) over (panel group, row chunk), M_CHUNK rows each. */
int gemm_dpbf16(const uint16_t *x, int64_t xs, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t ys,
                int M, int N, int K, int begin, int end) {
#if PATH == 1
    run_items(x, xs, w, bias, y, ys, M, N, K, begin, end);
    return 0;
#elif PATH == 2
    const int64_t K2x2 = 2 * (int64_t)((K + 1) / 2);
    float *xf = malloc(sizeof(float) * (size_t)M * (size_t)K2x2);
    if (xf == NULL) return 2;
    #pragma omp parallel for schedule(static) if (M * (int64_t)K >= 65536)
    for (int m = 0; m < M; m++) {
        for (int k = 0; k < K; k++) xf[m * K2x2 + k] = bf16_load(x[m * xs + k]);
        if (K2x2 > K) xf[m * K2x2 + K] = 0.f;
    }
    run_items(xf, K2x2, w, bias, y, ys, M, N, K, begin, end);
    free(xf);
    return 0;
#else
    (void)x; (void)xs; (void)w; (void)bias; (void)y; (void)ys; (void)M; (void)N; (void)K; (void)begin; (void)end;
    return 1;  /* no AVX-512 on this CPU: dpbf16_available() says so */
#endif
}
