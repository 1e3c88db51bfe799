/* Multi-LoRA over a step's adapter segments on the CPU: decode rows and prefill chunks
 * alike, one call per layer and projection group.
 *
 * Each work item is a piece of one segment (at most MAX_ROWS rows of one adapter, the
 * launcher splits longer segments). Per module of the group: shrink s = x A^T into fp32
 * (register blocks of RB rows x KB ranks, dot products vectorised along the input), then
 * expand delta = s B^T (blocks of RB rows x CB vectors of output columns) and add it into
 * `out` with one rounding. Rows past the last full block go one at a time (a decode
 * row computes for itself only). Decode pieces are bound by reading the adapter's A and B^T,
 * which each piece streams once; prefill pieces by arithmetic, which the register blocks
 * keep on the FMA units. With AVX512-BF16 the bf16 shrink multiplies pairs of bf16 in
 * one instruction (vdpbf16ps, fp32 accumulation). Batched torch matmuls did the same at
 * half the memory speed on decode, and oneDNN built a new primitive (~1 ms) for every
 * new segment length on prefill.
 *
 * Weights come from lora/stacks.py SlotStacks: A [layers, slots, RA, in] (modules' rows at
 * their offsets), per module B^T [layers, slots, r_alloc, out_m]. Per module, `mods`
 * holds {A row offset, r_alloc, output column, out_m, B^T base address, B^T layer
 * stride}; `ranks` [slots, modules] the rank each slot really has for the layer.
 * Work items are pieces [begin, end), shared out by OpenMP (torch's own runtime).
 *
 * The epilogue of DoRA and lora_bias adapters (lora/epilogue.py), when `epi_flags` is
 * not NULL: for a slot whose flag is set, each module's rows become
 * round((out + delta) * scale + shift) over its columns, scale and shift fp32
 * [slots, group width] at the slot stride `epi_stride`. The expand applies it as it
 * stores a block: a separate (scalar) pass over the rows cost DoRA 2-3x plain LoRA's
 * kernel time.
 */
/* As in gemm.c: keep every block accumulator in a register. */
#pragma GCC optimize("ira-loop-pressure")

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define MAX_RANK 256
#define MAX_ROWS 64
#define RB 4 /* rows per register block */
#ifdef __AVX512F__
#define VL 16 /* fp32 lanes per vector */
#define KB 4  /* ranks per shrink block: RB*KB accumulators + RB+KB loads of 32 registers */
#define CB 4  /* output vectors per expand block */
#define KB1 8 /* for a single row: more independent accumulators, or FMA latency bounds it */
#define CB1 8
#else
#define VL 8
#define KB 2 /* 16 registers on AVX2 */
#define CB 2
#define KB1 4
#define CB1 4
#endif

typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf vload_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf vload_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    return bf16_widen8(p);
#endif
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

static inline int clamp_last(int i, int n) { return i < n ? i : n - 1; }

/* Each block shape is its own function with arrays of exactly its size: GCC keeps an
 * array of vectors in registers only when every element is used (a 4x4 array holding
 * a 4x2 block went to the stack: 2x slower). */

/* s[i0 + i][k] = x[i0 + i] . a[k] for i < RBX, k < r, KBX ranks at a time (the ranks
 * past r in the last block repeat the last one; their results are dropped). */
#define SHRINK_BLOCK(NAME, T, LOAD, VLOAD, RBX, KBX)                                               \
static __attribute__((noinline)) void NAME(const T *x, int64_t xs, int i0, const T *a, int r, int K, \
                                           float s[][MAX_RANK]) {                                   \
    for (int k0 = 0; k0 < r; k0 += KBX) {                                                           \
        const T *xp[RBX], *ap[KBX];                                                                 \
        for (int i = 0; i < RBX; i++) xp[i] = x + (int64_t)(i0 + i) * xs;                           \
        for (int q = 0; q < KBX; q++) ap[q] = a + (int64_t)clamp_last(k0 + q, r) * K;               \
        vf acc[RBX][KBX];                                                                           \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < KBX; q++) acc[i][q] = (vf){0};                                      \
        int j = 0;                                                                                  \
        for (; j + VL <= K; j += VL) {                                                              \
            vf xv[RBX], av[KBX];                                                                    \
            for (int i = 0; i < RBX; i++) xv[i] = VLOAD(xp[i] + j);                                 \
            for (int q = 0; q < KBX; q++) av[q] = VLOAD(ap[q] + j);                                 \
            for (int i = 0; i < RBX; i++)                                                           \
                for (int q = 0; q < KBX; q++) acc[i][q] += xv[i] * av[q];                           \
        }                                                                                           \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < KBX && k0 + q < r; q++) {                                           \
                float d = hsum(acc[i][q]);                                                          \
                for (int jj = j; jj < K; jj++) d += LOAD(xp[i][jj]) * LOAD(ap[q][jj]);              \
                s[i0 + i][k0 + q] = d;                                                              \
            }                                                                                       \
    }                                                                                               \
}

#ifdef __AVX512BF16__
/* The same with 32 bf16 products per instruction (vdpbf16ps), summed in pairs into fp32. */
#define SHRINK_BLOCK_DP(NAME, RBX, KBX)                                                            \
static __attribute__((noinline)) void NAME(const uint16_t *x, int64_t xs, int i0, const uint16_t *a, int r, \
                                           int K, float s[][MAX_RANK]) {                            \
    for (int k0 = 0; k0 < r; k0 += KBX) {                                                           \
        const uint16_t *xp[RBX], *ap[KBX];                                                          \
        for (int i = 0; i < RBX; i++) xp[i] = x + (int64_t)(i0 + i) * xs;                           \
        for (int q = 0; q < KBX; q++) ap[q] = a + (int64_t)clamp_last(k0 + q, r) * K;               \
        __m512 acc[RBX][KBX];                                                                       \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < KBX; q++) acc[i][q] = _mm512_setzero_ps();                          \
        int j = 0;                                                                                  \
        for (; j + 32 <= K; j += 32) {                                                              \
            __m512bh xv[RBX], av[KBX];                                                              \
            for (int i = 0; i < RBX; i++) xv[i] = (__m512bh)_mm512_loadu_si512(xp[i] + j);          \
            for (int q = 0; q < KBX; q++) av[q] = (__m512bh)_mm512_loadu_si512(ap[q] + j);          \
            for (int i = 0; i < RBX; i++)                                                           \
                for (int q = 0; q < KBX; q++) acc[i][q] = _mm512_dpbf16_ps(acc[i][q], xv[i], av[q]); \
        }                                                                                           \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < KBX && k0 + q < r; q++) {                                           \
                float d = _mm512_reduce_add_ps(acc[i][q]);                                          \
                for (int jj = j; jj < K; jj++) d += bf16_load(xp[i][jj]) * bf16_load(ap[q][jj]);    \
                s[i0 + i][k0 + q] = d;                                                              \
            }                                                                                       \
    }                                                                                               \
}
SHRINK_BLOCK_DP(shrink_bf16_rb, RB, KB)
SHRINK_BLOCK_DP(shrink_bf16_r1, 1, KB1)
#else
SHRINK_BLOCK(shrink_bf16_rb, uint16_t, bf16_load, vload_bf16, RB, KB)
SHRINK_BLOCK(shrink_bf16_r1, uint16_t, bf16_load, vload_bf16, 1, KB1)
#endif
SHRINK_BLOCK(shrink_f32_rb, float, f32_load, vload_f32, RB, KB)
SHRINK_BLOCK(shrink_f32_r1, float, f32_load, vload_f32, 1, KB1)

/* out[i0 + i][c + j] = round(out + sum_k s[i0 + i][k] bt[k][c + j]) for i < RBX, j < CBX vectors;
 * with EPI (sc, sh: the module's columns of its epilogue's scale and shift),
 * round((out + delta) * sc + sh): one pass and one rounding, as the Triton expand does.
 * EPI is a constant: plain LoRA's code has no test for it. */
#define EXPAND_BLOCK(NAME, T, LOAD, STORE, VLOAD, RBX, CBX, EPI)                                   \
static inline void NAME(float s[][MAX_RANK], int i0, int c, int r, const T *bt, int W, T *out, int64_t os, \
                        const float *sc, const float *sh) {                                         \
    vf acc[RBX][CBX];                                                                               \
    for (int i = 0; i < RBX; i++)                                                                   \
        for (int q = 0; q < CBX; q++) acc[i][q] = (vf){0};                                          \
    for (int k = 0; k < r; k++) {                                                                   \
        vf bv[CBX];                                                                                 \
        for (int q = 0; q < CBX; q++) bv[q] = VLOAD(bt + (int64_t)k * W + c + q * VL);              \
        for (int i = 0; i < RBX; i++) {                                                             \
            const vf sb = (vf){0} + s[i0 + i][k];                                                   \
            for (int q = 0; q < CBX; q++) acc[i][q] += sb * bv[q];                                  \
        }                                                                                           \
    }                                                                                               \
    for (int i = 0; i < RBX; i++) {                                                                 \
        T *o = out + (int64_t)(i0 + i) * os + c;                                                    \
        float d[CBX * VL];                                                                          \
        memcpy(d, acc[i], sizeof d);                                                                \
        if (EPI) {                                                                                  \
            for (int l = 0; l < CBX * VL; l++) o[l] = STORE((LOAD(o[l]) + d[l]) * sc[c + l] + sh[c + l]); \
        } else {                                                                                    \
            for (int l = 0; l < CBX * VL; l++) o[l] = STORE(LOAD(o[l]) + d[l]);                     \
        }                                                                                           \
    }                                                                                               \
}

/* Rows i0 .. i0 + RBX - 1 of the expand over all W columns: blocks of CBX vectors, then
 * one vector, then one column at a time. */
#define EXPAND_ROWS(NAME, T, LOAD, STORE, RBX, CBX, EPI)                                           \
static __attribute__((noinline)) void NAME(float s[][MAX_RANK], int i0, int r, const T *bt, int W, T *out, \
                                           int64_t os, const float *sc, const float *sh) {         \
    int c = 0;                                                                                      \
    for (; c + CBX * VL <= W; c += CBX * VL) NAME##_wide(s, i0, c, r, bt, W, out, os, sc, sh);      \
    for (; c + VL <= W; c += VL) NAME##_one(s, i0, c, r, bt, W, out, os, sc, sh);                   \
    for (; c < W; c++)                                                                              \
        for (int i = 0; i < RBX; i++) {                                                             \
            float d = 0.f;                                                                          \
            for (int k = 0; k < r; k++) d += s[i0 + i][k] * LOAD(bt[(int64_t)k * W + c]);          \
            T *o = out + (int64_t)(i0 + i) * os + c;                                                \
            *o = EPI ? STORE((LOAD(*o) + d) * sc[c] + sh[c]) : STORE(LOAD(*o) + d);                 \
        }                                                                                           \
}

#define DEFINE_EXPAND(NAME, T, LOAD, STORE, VLOAD, EPI)                                            \
EXPAND_BLOCK(NAME##_rb_wide, T, LOAD, STORE, VLOAD, RB, CB, EPI)                                   \
EXPAND_BLOCK(NAME##_rb_one, T, LOAD, STORE, VLOAD, RB, 1, EPI)                                     \
EXPAND_BLOCK(NAME##_r1_wide, T, LOAD, STORE, VLOAD, 1, CB1, EPI)                                   \
EXPAND_BLOCK(NAME##_r1_one, T, LOAD, STORE, VLOAD, 1, 1, EPI)                                      \
EXPAND_ROWS(NAME##_rb, T, LOAD, STORE, RB, CB, EPI)                                                \
EXPAND_ROWS(NAME##_r1, T, LOAD, STORE, 1, CB1, EPI)

DEFINE_EXPAND(expand_f32, float, f32_load, f32_store, vload_f32, 0)
DEFINE_EXPAND(expand_bf16, uint16_t, bf16_load, bf16_store, vload_bf16, 0)
DEFINE_EXPAND(expand_epi_f32, float, f32_load, f32_store, vload_f32, 1)
DEFINE_EXPAND(expand_epi_bf16, uint16_t, bf16_load, bf16_store, vload_bf16, 1)

/* One piece of n rows: full blocks of RB rows, then single rows (a decode row computes
 * for itself only). */
#define DEFINE_LORA(NAME, T, SHRINK, EXPAND, EPI_EXPAND)                                         \
int NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, const int32_t *segs,            \
         const T *a_base, int64_t a_layer_stride, int64_t a_slot_stride, int in_dim, int n_mod,     \
         const int64_t *mods, const int32_t *ranks, int layer, const int32_t *epi_flags,            \
         const float *epi_scale, const float *epi_shift, int64_t epi_stride, int begin, int end) {  \
    int rc = 0;                                                                                     \
    _Pragma("omp parallel for schedule(dynamic) if (end - begin >= 2) reduction(|: rc)")              \
    for (int i = begin; i < end; i++) {                                                             \
        float s[MAX_ROWS][MAX_RANK];                                                                \
        const int r0 = segs[3 * i], r1 = segs[3 * i + 1], slot = segs[3 * i + 2], n = r1 - r0;      \
        if (n > MAX_ROWS || n < 1) { rc |= 1; continue; }                                           \
        const T *a_slot = a_base + layer * a_layer_stride + slot * a_slot_stride;                   \
        const T *xs = x + (int64_t)r0 * x_stride;                                                   \
        for (int m = 0; m < n_mod; m++) {                                                           \
            const int64_t *md = mods + 6 * m;                                                       \
            const int r = ranks[slot * n_mod + m], r_alloc = (int)md[1], width = (int)md[3];        \
            if (r == 0) continue;                                                                   \
            if (r > MAX_RANK) { rc |= 2; continue; }                                                \
            const T *a = a_slot + md[0] * in_dim;                                                   \
            const T *bt = (const T *)(intptr_t)md[4] + layer * md[5] + (int64_t)slot * r_alloc * width; \
            T *o = out + (int64_t)r0 * out_stride + md[2];                                          \
            int i0 = 0;                                                                             \
            for (; i0 + RB <= n; i0 += RB) SHRINK##_rb(xs, x_stride, i0, a, r, in_dim, s);          \
            for (; i0 < n; i0++) SHRINK##_r1(xs, x_stride, i0, a, r, in_dim, s);                    \
            const int epi = epi_flags && epi_flags[slot];                                           \
            const float *sc = epi ? epi_scale + slot * epi_stride + md[2] : NULL;                   \
            const float *sh = epi ? epi_shift + slot * epi_stride + md[2] : NULL;                   \
            if (epi) {                                                                              \
                for (i0 = 0; i0 + RB <= n; i0 += RB) EPI_EXPAND##_rb(s, i0, r, bt, width, o, out_stride, sc, sh); \
                for (; i0 < n; i0++) EPI_EXPAND##_r1(s, i0, r, bt, width, o, out_stride, sc, sh);   \
            } else {                                                                                \
                for (i0 = 0; i0 + RB <= n; i0 += RB) EXPAND##_rb(s, i0, r, bt, width, o, out_stride, sc, sh); \
                for (; i0 < n; i0++) EXPAND##_r1(s, i0, r, bt, width, o, out_stride, sc, sh);       \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    return rc;                                                                                      \
}

DEFINE_LORA(lora_segments_bf16, uint16_t, shrink_bf16, expand_bf16, expand_epi_bf16)
DEFINE_LORA(lora_segments_f32, float, shrink_f32, expand_f32, expand_epi_f32)
