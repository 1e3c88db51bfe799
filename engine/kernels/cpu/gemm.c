/* bf16 linear layers for CPUs whose oneDNN has no bf16 path (AVX2-only x86, e.g. EPYC).
 *
 * There torch's bf16 matmul falls back to a reference loop: 15 GFLOP/s on 2 cores
 * against 117 for fp32, so a decode step of SmolLM2 took ~230 ms. Here weights stay
 * bf16 in memory (half the bytes a decode step must stream), pre-packed at load time
 * into panels of NR*LANES output columns, [panel][K][NR*LANES], so that one k step
 * reads one contiguous run of the panel. The micro-kernel keeps an MR x NR block of
 * fp32 vector accumulators in registers: per k it widens NR weight vectors, broadcasts
 * MR input values and does MR*NR FMAs. One rounding to bf16 at the end, as a bf16
 * torch matmul does. GCC vector extensions keep it portable; -march=native picks the
 * instructions (AVX2: 8 lanes, FMA).
 *
 * y[M, N] = x[M, K] W[N, K]^T (+ bias[N]). Work items are panels, shared out by OpenMP
 * (torch's own runtime).
 */
/* GCC kept three of the micro-kernel's twelve accumulators on the stack (as an array or
 * as named variables alike), each k step waiting on a store and reload (36 against 66
 * GFLOP/s per core); weighing register pressure per loop keeps them all in registers. */
#pragma GCC optimize("ira-loop-pressure")

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 8
#define NR 2               /* vectors of output columns per panel (micro() is written for 2) */
#define PANEL (NR * LANES) /* 16 output columns */
#define MR 6               /* input rows per micro-kernel call (micro() is written for 6) */
#define M_CHUNK 252        /* input rows per pass of the panels: a multiple of MR */

static inline void store8(float *p, v8f v) {
    for (int i = 0; i < LANES; i++) p[i] = v[i];
}

/* rows x PANEL block of y from `rows` (<= MR) fp32 input rows of length K and one panel.
 * -ffast-math contracts each `+= x * w` into one FMA. */
#define FMA_ROW(i)                                                                       \
    if (rows > i) {                                                                      \
        const float xv = xf[(int64_t)i * K + k];                                                 \
        const v8f xb = {xv, xv, xv, xv, xv, xv, xv, xv};                                 \
        a##i##0 += xb * w0;                                                              \
        a##i##1 += xb * w1;                                                              \
    }
#define STORE_ROW(i)                                                                     \
    if (rows > i) {                                                                      \
        store8(&out[i][0], a##i##0);                                                     \
        store8(&out[i][LANES], a##i##1);                                                 \
    }

static inline __attribute__((always_inline)) void micro(const float *xf, const uint16_t *panel, int K,
                                                        int rows, float out[MR][PANEL]) {
    v8f a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
    v8f a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
    for (int k = 0; k < K; k++) {
        const uint16_t *p = panel + (int64_t)k * PANEL;
        const v8f w0 = bf16_widen8(p), w1 = bf16_widen8(p + LANES);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}

/* One specialised copy per row count, so the accumulators stay in registers. */
static void micro_rows(const float *xf, const uint16_t *panel, int K, int rows, float out[MR][PANEL]) {
    switch (rows) {
    case 6: micro(xf, panel, K, 6, out); break;
    case 5: micro(xf, panel, K, 5, out); break;
    case 4: micro(xf, panel, K, 4, out); break;
    case 3: micro(xf, panel, K, 3, out); break;
    case 2: micro(xf, panel, K, 2, out); break;
    default: micro(xf, panel, K, 1, out); break;
    }
}

int gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias,
              uint16_t *y, int64_t ldy, int M, int N, int K, int begin, int end) {
    if (M <= 0 || N <= 0 || K <= 0 || begin < 0 || end > (N + PANEL - 1) / PANEL) return 1;
    float *xf = malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (xf == NULL) return 2;
    #pragma omp parallel for schedule(static) if (M * (int64_t)K >= 65536)
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) xf[(int64_t)m * K + k] = bf16_load(x[m * ldx + k]);
    /* Rows in chunks whose fp32 copy stays in L2 while every panel passes over it
     * (at 1024 rows unchunked: 96 against 153 GFLOP/s at 256). */
    for (int c0 = 0; c0 < M; c0 += M_CHUNK) {
        const int c1 = c0 + M_CHUNK < M ? c0 + M_CHUNK : M;
        #pragma omp parallel for schedule(static)
        for (int b = begin; b < end; b++) {
            const uint16_t *panel = packed + (int64_t)b * K * PANEL;
            const int n0 = b * PANEL, cols = N - n0 < PANEL ? N - n0 : PANEL;
            float out[MR][PANEL];
            for (int m0 = c0; m0 < c1; m0 += MR) {
                const int rows = c1 - m0 < MR ? c1 - m0 : MR;
                micro_rows(xf + (int64_t)m0 * K, panel, K, rows, out);
                for (int i = 0; i < rows; i++) {
                    uint16_t *yr = y + (int64_t)(m0 + i) * ldy + n0;
                    for (int j = 0; j < cols; j++)
                        yr[j] = bf16_store(out[i][j] + (bias ? bf16_load(bias[n0 + j]) : 0.f));
                }
            }
        }
    }
    free(xf);
    return 0;
}
