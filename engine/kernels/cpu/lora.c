/* Multi-LoRA over a step's adapter segments on the CPU: decode rows and prefill chunks
 * alike, one call per layer and projection group.
 *
 * Each work item is a piece of one segment (at most MAX_ROWS rows of one adapter, the
 * launcher splits longer segments). Per module of the group: shrink s = x A^T into fp32
 * (register blocks of RB rows x KB ranks, dot products vectorised along the input), then
 * expand delta = s B^T (blocks of RB rows x CB vectors of output columns) and add it into
 * `out` with one rounding. Rows past the last full block go one at a time (a decode
 * row computes for itself only). Prefill pieces are bound by arithmetic, which the
 * register blocks keep on the FMA units. Decode pieces are bound by reading the
 * adapter's A and B^T, which each piece streams once: the reads of the next module run
 * under this one's arithmetic (software prefetch spread over the inner loops, see pf_t),
 * where a module's reads and its arithmetic otherwise took turns, and the arithmetic is
 * kept short: with AVX512-BF16 the bf16 shrink multiplies pairs of bf16 in one
 * instruction (vdpbf16ps, fp32 accumulation), and bf16 B^T is stored in rank pairs so
 * the expand widens two ranks with two ops (see there). Batched torch matmuls ran
 * decode at half the memory speed, and oneDNN built a new primitive (~1 ms) for every
 * new segment length on prefill.
 *
 * Weights come from lora/stacks.py SlotStacks: A [layers, slots, RA, in] (modules' rows at
 * their offsets), per module B^T [layers, slots, r_alloc, out_m], bf16 in rank pairs
 * (SlotStacks(pairs=True): r_alloc even, each slot's block [r_alloc/2][out_m][2]), fp32
 * rank-major. Per module, `mods` holds {A row offset, r_alloc, output column, out_m, B^T
 * base address, B^T layer stride}; `ranks` [slots, modules] the rank each slot really has
 * for the layer. Work items are pieces [begin, end), shared out dynamically on OpenMP
 * threads (torch's own runtime), each thread knowing its next piece so it can prefetch it.
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
    return (vf)bf16_widen16(_mm256_loadu_si256((const __m256i *)p));
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

#ifndef PF_LOCALITY
#define PF_LOCALITY 2 /* prefetcht1: into L2 */
#endif
#ifndef PF_SPREAD
#define PF_SPREAD 1 /* the next module's lines prefetched over 1/PF_SPREAD of this one's steps */
#endif
#define PF_MAX_LINES 16

/* Weights to prefetch, two ranges (the next module's A and B^T), `lines` lines per step
 * of the inner loops: a burst of all of them took every fill buffer, and the loads of the
 * module being computed waited behind it. */
typedef struct {
    const char *p[2], *end[2];
    int lines;
} pf_t;

/* (A range's last step may run a few lines past its end: a prefetch never faults.) */
static inline void pf_step(pf_t *pf) {
    const int w = pf->p[0] >= pf->end[0];
    if (pf->p[w] >= pf->end[w]) return;
    for (int l = 0; l < pf->lines; l++) __builtin_prefetch(pf->p[w] + 64 * l, 0, PF_LOCALITY);
    pf->p[w] += 64 * pf->lines;
}

/* Each block shape is its own function with arrays of exactly its size: GCC keeps an
 * array of vectors in registers only when every element is used (a 4x4 array holding
 * a 4x2 block went to the stack: 2x slower). */

/* s[i0 + i][k] = x[i0 + i] . a[k] for i < RBX, k < r, KBX ranks at a time (the ranks
 * past r in the last block repeat the last one; their results are dropped). */
#define SHRINK_BLOCK(NAME, T, LOAD, VLOAD, RBX, KBX)                                                \
static __attribute__((noinline)) void NAME(const T *x, int64_t xs, int i0, const T *a, int r, int K, \
                                           float s[][MAX_RANK], pf_t *pf) {                         \
    for (int k0 = 0; k0 < r; k0 += KBX) {                                                           \
        const T *xp[RBX], *ap[KBX];                                                                 \
        for (int i = 0; i < RBX; i++) xp[i] = x + (int64_t)(i0 + i) * xs;                           \
        for (int q = 0; q < KBX; q++) ap[q] = a + (int64_t)clamp_last(k0 + q, r) * K;               \
        vf acc[RBX][KBX];                                                                           \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < KBX; q++) acc[i][q] = (vf){0};                                      \
        int j = 0;                                                                                  \
        for (; j + VL <= K; j += VL) {                                                              \
            pf_step(pf);                                                                            \
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
#define SHRINK_BLOCK_DP(NAME, RBX, KBX)                                                             \
static __attribute__((noinline)) void NAME(const uint16_t *x, int64_t xs, int i0, const uint16_t *a, int r, \
                                           int K, float s[][MAX_RANK], pf_t *pf) {                  \
    for (int k0 = 0; k0 < r; k0 += KBX) {                                                           \
        const uint16_t *xp[RBX], *ap[KBX];                                                          \
        for (int i = 0; i < RBX; i++) xp[i] = x + (int64_t)(i0 + i) * xs;                           \
        for (int q = 0; q < KBX; q++) ap[q] = a + (int64_t)clamp_last(k0 + q, r) * K;               \
        __m512 acc[RBX][KBX];                                                                       \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < KBX; q++) acc[i][q] = _mm512_setzero_ps();                          \
        int j = 0;                                                                                  \
        for (; j + 32 <= K; j += 32) {                                                              \
            pf_step(pf);                                                                            \
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

/* fp32: out[i0 + i][c + j] = out + sum_k s[i0 + i][k] bt[k][c + j] for i < RBX, j < CBX
 * vectors, B^T rank-major [r][W]; with EPI (sc, sh: the module's columns of its
 * epilogue's scale and shift), (out + delta) * sc + sh in one pass, as the Triton expand
 * does. EPI is a constant: plain LoRA's code has no test for it. */
#define EXPAND_BLOCK(NAME, RBX, CBX, EPI)                                                           \
static inline void NAME(float s[][MAX_RANK], int i0, int c, int r, const float *bt, int W, float *out, \
                        int64_t os, const float *sc, const float *sh, pf_t *pf) {                   \
    vf acc[RBX][CBX];                                                                               \
    for (int i = 0; i < RBX; i++)                                                                   \
        for (int q = 0; q < CBX; q++) acc[i][q] = (vf){0};                                          \
    for (int k = 0; k < r; k++) {                                                                   \
        pf_step(pf);                                                                                \
        vf bv[CBX];                                                                                 \
        for (int q = 0; q < CBX; q++) bv[q] = vload_f32(bt + (int64_t)k * W + c + q * VL);          \
        for (int i = 0; i < RBX; i++) {                                                             \
            const vf sb = (vf){0} + s[i0 + i][k];                                                   \
            for (int q = 0; q < CBX; q++) acc[i][q] += sb * bv[q];                                  \
        }                                                                                           \
    }                                                                                               \
    for (int i = 0; i < RBX; i++) {                                                                 \
        float *o = out + (int64_t)(i0 + i) * os + c;                                                \
        float d[CBX * VL];                                                                          \
        memcpy(d, acc[i], sizeof d);                                                                \
        if (EPI) {                                                                                  \
            for (int l = 0; l < CBX * VL; l++) o[l] = (o[l] + d[l]) * sc[c + l] + sh[c + l];        \
        } else {                                                                                    \
            for (int l = 0; l < CBX * VL; l++) o[l] += d[l];                                        \
        }                                                                                           \
    }                                                                                               \
}

/* Rows i0 .. i0 + RBX - 1 of the expand over all W columns: blocks of CBX vectors, then
 * one vector, then one column at a time. */
#define EXPAND_ROWS(NAME, RBX, CBX, EPI)                                                            \
static __attribute__((noinline)) void NAME(float s[][MAX_RANK], int i0, int r, const float *bt, int W, \
                                           float *out, int64_t os, const float *sc, const float *sh, \
                                           pf_t *pf) {                                              \
    int c = 0;                                                                                      \
    for (; c + CBX * VL <= W; c += CBX * VL) NAME##_wide(s, i0, c, r, bt, W, out, os, sc, sh, pf);  \
    for (; c + VL <= W; c += VL) NAME##_one(s, i0, c, r, bt, W, out, os, sc, sh, pf);               \
    for (; c < W; c++)                                                                              \
        for (int i = 0; i < RBX; i++) {                                                             \
            float d = 0.f;                                                                          \
            for (int k = 0; k < r; k++) d += s[i0 + i][k] * bt[(int64_t)k * W + c];                 \
            float *o = out + (int64_t)(i0 + i) * os + c;                                            \
            *o = EPI ? (*o + d) * sc[c] + sh[c] : *o + d;                                           \
        }                                                                                           \
}

#define DEFINE_EXPAND(NAME, EPI)                                                                    \
EXPAND_BLOCK(NAME##_rb_wide, RB, CB, EPI)                                                           \
EXPAND_BLOCK(NAME##_rb_one, RB, 1, EPI)                                                             \
EXPAND_BLOCK(NAME##_r1_wide, 1, CB1, EPI)                                                           \
EXPAND_BLOCK(NAME##_r1_one, 1, 1, EPI)                                                              \
EXPAND_ROWS(NAME##_rb, RB, CB, EPI)                                                                 \
EXPAND_ROWS(NAME##_r1, 1, CB1, EPI)

DEFINE_EXPAND(expand_f32, 0)
DEFINE_EXPAND(expand_epi_f32, 1)

/* bf16: B^T in rank pairs, [ceil(r/2)][W] uint32 whose low half is rank 2p's value of the
 * column and high half rank 2p+1's (zero past r), so one vector load is a pair of ranks of
 * VL columns, widened by a shift and a mask: two ops per two ranks, where rank-major rows
 * took a zero-extend and a shift per rank. s stays fp32. (vdpbf16ps on the pairs, s
 * rounded to bf16 with its remainder as a second pair to stay as exact, measured no
 * faster on decode rows, whose reads bound them, and slower on cached weights.) */
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

static inline vu vload_u32(const uint32_t *p) {
    vu v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store_bf16(uint16_t *o, const float *d, int n, const float *sc,
                                                             const float *sh, int epi) {
    if (epi) {
        for (int l = 0; l < n; l++) o[l] = bf16_store((bf16_load(o[l]) + d[l]) * sc[l] + sh[l]);
    } else {
        for (int l = 0; l < n; l++) o[l] = bf16_store(bf16_load(o[l]) + d[l]);
    }
}

/* out[i0 + i][c + j] = round(out + delta) (EPI: round((out + delta) * sc + sh), one
 * rounding) for i < RBX, j < CBX vectors; sp: the RBX rows' s, ranks 2p and 2p+1 in
 * sp[i][p][0] and [1]. */
#define EXPAND_PAIRS_BLOCK(NAME, RBX, CBX, EPI)                                                     \
static inline void NAME(const float sp[][MAX_RANK / 2][2], int i0, int c, int np, const uint32_t *bt, int W, \
                        uint16_t *out, int64_t os, const float *sc, const float *sh, pf_t *pf) {    \
    vf acc[RBX][CBX];                                                                               \
    for (int i = 0; i < RBX; i++)                                                                   \
        for (int q = 0; q < CBX; q++) acc[i][q] = (vf){0};                                          \
    for (int p = 0; p < np; p++) {                                                                  \
        pf_step(pf);                                                                                \
        vu bv[CBX];                                                                                 \
        for (int q = 0; q < CBX; q++) bv[q] = vload_u32(bt + (int64_t)p * W + c + q * VL);          \
        vf lo[CBX], hi[CBX];                                                                        \
        for (int q = 0; q < CBX; q++) {                                                             \
            lo[q] = (vf)(bv[q] << 16);                                                              \
            hi[q] = (vf)(bv[q] & 0xffff0000u);                                                      \
        }                                                                                           \
        for (int i = 0; i < RBX; i++)                                                               \
            for (int q = 0; q < CBX; q++) acc[i][q] += sp[i][p][0] * lo[q] + sp[i][p][1] * hi[q];   \
    }                                                                                               \
    for (int i = 0; i < RBX; i++) {                                                                 \
        float d[CBX * VL];                                                                          \
        memcpy(d, acc[i], sizeof d);                                                                \
        store_bf16(out + (int64_t)(i0 + i) * os + c, d, CBX * VL, EPI ? sc + c : NULL, EPI ? sh + c : NULL, EPI); \
    }                                                                                               \
}

/* Rows i0 .. i0 + RBX - 1: their s in pairs (zero past an odd r: s[r] is not written),
 * then blocks of CBX vectors, one vector, and one column at a time. */
#define EXPAND_PAIRS_ROWS(NAME, RBX, CBX, EPI)                                                      \
static __attribute__((noinline)) void NAME(float s[][MAX_RANK], int i0, int r, const uint16_t *bt16, int W, \
                                           uint16_t *out, int64_t os, const float *sc, const float *sh, \
                                           pf_t *pf) {                                              \
    const uint32_t *bt = (const uint32_t *)bt16;                                                    \
    const int np = (r + 1) / 2;                                                                     \
    float sp[RBX][MAX_RANK / 2][2];                                                                 \
    for (int i = 0; i < RBX; i++)                                                                   \
        for (int p = 0; p < np; p++) {                                                              \
            sp[i][p][0] = s[i0 + i][2 * p];                                                         \
            sp[i][p][1] = 2 * p + 1 < r ? s[i0 + i][2 * p + 1] : 0.f;                               \
        }                                                                                           \
    int c = 0;                                                                                      \
    for (; c + CBX * VL <= W; c += CBX * VL) NAME##_wide(sp, i0, c, np, bt, W, out, os, sc, sh, pf); \
    for (; c + VL <= W; c += VL) NAME##_one(sp, i0, c, np, bt, W, out, os, sc, sh, pf);             \
    for (; c < W; c++)                                                                              \
        for (int i = 0; i < RBX; i++) {                                                             \
            float d = 0.f;                                                                          \
            for (int p = 0; p < np; p++) {                                                          \
                const uint32_t b = bt[(int64_t)p * W + c];                                          \
                d += sp[i][p][0] * bf16_load((uint16_t)b) + sp[i][p][1] * bf16_load((uint16_t)(b >> 16)); \
            }                                                                                       \
            store_bf16(out + (int64_t)(i0 + i) * os + c, &d, 1, EPI ? sc + c : NULL, EPI ? sh + c : NULL, EPI); \
        }                                                                                           \
}

#define DEFINE_EXPAND_PAIRS(NAME, EPI)                                                              \
EXPAND_PAIRS_BLOCK(NAME##_rb_wide, RB, CB, EPI)                                                     \
EXPAND_PAIRS_BLOCK(NAME##_rb_one, RB, 1, EPI)                                                       \
EXPAND_PAIRS_BLOCK(NAME##_r1_wide, 1, CB1, EPI)                                                     \
EXPAND_PAIRS_BLOCK(NAME##_r1_one, 1, 1, EPI)                                                        \
EXPAND_PAIRS_ROWS(NAME##_rb, RB, CB, EPI)                                                           \
EXPAND_PAIRS_ROWS(NAME##_r1, 1, CB1, EPI)

DEFINE_EXPAND_PAIRS(expand_bf16, 0)
DEFINE_EXPAND_PAIRS(expand_epi_bf16, 1)

/* What every piece of one call shares. */
typedef struct {
    const char *x, *a_base;
    char *out;
    int64_t x_stride, out_stride, a_layer_stride, a_slot_stride, epi_stride;
    int in_dim, n_mod, layer, pairs;
    const int64_t *mods;
    const int32_t *ranks;
    const int32_t *segs, *epi_flags;
    const float *epi_scale, *epi_shift;
} call_t;

/* Module m of `slot`: its A rows and B^T for the layer, and its rank (0: none). */
static inline int module_weights(const call_t *k, int esize, int slot, int m, const char **a, const char **bt,
                                 int64_t *a_bytes, int64_t *bt_bytes) {
    const int64_t *md = k->mods + 6 * m;
    const int r = k->ranks[slot * k->n_mod + m], r_alloc = (int)md[1], width = (int)md[3];
    const int r_read = k->pairs ? (r + 1) & ~1 : r;
    *a = k->a_base + esize * (k->layer * k->a_layer_stride + slot * k->a_slot_stride + md[0] * k->in_dim);
    *bt = (const char *)(intptr_t)md[4] + esize * (k->layer * md[5] + (int64_t)slot * r_alloc * width);
    *a_bytes = (int64_t)esize * r * k->in_dim;
    *bt_bytes = (int64_t)esize * r_read * width;
    return r;
}

static inline int cdiv(int a, int b) { return (a + b - 1) / b; }

/* Inner-loop steps of n rows of a module (rank r, K inputs, W outputs): shrink and expand
 * blocks of RB rows, then single rows. */
static inline int module_steps(int n, int r, int K, int W, int k_step, int pairs) {
    const int rr = pairs ? cdiv(r, 2) : r;
    return n / RB * (cdiv(r, KB) * (K / k_step) + cdiv(W, CB * VL) * rr) +
           n % RB * (cdiv(r, KB1) * (K / k_step) + cdiv(W, CB1 * VL) * rr);
}

/* The prefetch of module m's weights of `slot` (or, past the last module, the first of
 * `next_slot`; none: an empty one), spread over `steps`. */
static inline pf_t prefetch_module(const call_t *k, int esize, int slot, int m, int next_slot, int steps) {
    pf_t pf = {{NULL, NULL}, {NULL, NULL}, 0};
    if (m == k->n_mod) {
        if (next_slot < 0 || next_slot == slot) return pf; /* the next piece reads these weights again */
        slot = next_slot, m = 0;
    }
    const char *a, *bt;
    int64_t a_bytes, bt_bytes;
    if (module_weights(k, esize, slot, m, &a, &bt, &a_bytes, &bt_bytes) <= 0) return pf;
    const int64_t lines = (a_bytes + bt_bytes) / 64 * PF_SPREAD / (steps > 0 ? steps : 1) + 1;
    return (pf_t){{a, bt}, {a + a_bytes, bt + bt_bytes}, lines < PF_MAX_LINES ? (int)lines : PF_MAX_LINES};
}

/* Piece i (n rows of one slot) over every module of the group: full blocks of RB rows,
 * then single rows (a decode row computes for itself only). The next module's weights
 * (the next piece's first, after the last) are prefetched as this one computes. */
#define DEFINE_PIECE(NAME, T, SHRINK, EXPAND, EPI_EXPAND, K_STEP)                                   \
static int NAME(const call_t *k, int i, int next_slot) {                                            \
    float s[MAX_ROWS][MAX_RANK];                                                                    \
    const int r0 = k->segs[3 * i], r1 = k->segs[3 * i + 1], slot = k->segs[3 * i + 2], n = r1 - r0; \
    if (n > MAX_ROWS || n < 1) return 1;                                                            \
    const T *xs = (const T *)k->x + (int64_t)r0 * k->x_stride;                                      \
    const int epi = k->epi_flags && k->epi_flags[slot];                                             \
    int rc = 0;                                                                                     \
    for (int m = 0; m < k->n_mod; m++) {                                                            \
        const int64_t *md = k->mods + 6 * m;                                                        \
        const char *ac, *btc;                                                                       \
        int64_t a_bytes, bt_bytes;                                                                  \
        const int r = module_weights(k, sizeof(T), slot, m, &ac, &btc, &a_bytes, &bt_bytes);        \
        const int width = (int)md[3];                                                               \
        if (r == 0) continue;                                                                       \
        if (r > MAX_RANK || (k->pairs && (md[1] & 1))) { rc |= 2; continue; }                       \
        const int steps = module_steps(n, r, k->in_dim, width, K_STEP, k->pairs);                   \
        pf_t pf = prefetch_module(k, sizeof(T), slot, m + 1, next_slot, steps);                     \
        const T *a = (const T *)ac, *bt = (const T *)btc;                                           \
        T *o = (T *)k->out + (int64_t)r0 * k->out_stride + md[2];                                   \
        int i0 = 0;                                                                                 \
        for (; i0 + RB <= n; i0 += RB) SHRINK##_rb(xs, k->x_stride, i0, a, r, k->in_dim, s, &pf);   \
        for (; i0 < n; i0++) SHRINK##_r1(xs, k->x_stride, i0, a, r, k->in_dim, s, &pf);             \
        const float *sc = epi ? k->epi_scale + slot * k->epi_stride + md[2] : NULL;                 \
        const float *sh = epi ? k->epi_shift + slot * k->epi_stride + md[2] : NULL;                 \
        const int64_t os = k->out_stride;                                                           \
        if (epi) {                                                                                  \
            for (i0 = 0; i0 + RB <= n; i0 += RB) EPI_EXPAND##_rb(s, i0, r, bt, width, o, os, sc, sh, &pf); \
            for (; i0 < n; i0++) EPI_EXPAND##_r1(s, i0, r, bt, width, o, os, sc, sh, &pf);          \
        } else {                                                                                    \
            for (i0 = 0; i0 + RB <= n; i0 += RB) EXPAND##_rb(s, i0, r, bt, width, o, os, sc, sh, &pf); \
            for (; i0 < n; i0++) EXPAND##_r1(s, i0, r, bt, width, o, os, sc, sh, &pf);              \
        }                                                                                           \
    }                                                                                               \
    return rc;                                                                                      \
}

#ifdef __AVX512BF16__
#define BF16_K_STEP 32
#else
#define BF16_K_STEP VL
#endif
DEFINE_PIECE(piece_bf16, uint16_t, shrink_bf16, expand_bf16, expand_epi_bf16, BF16_K_STEP)
DEFINE_PIECE(piece_f32, float, shrink_f32, expand_f32, expand_epi_f32, VL)

/* Pieces [begin, end) shared out dynamically, each thread taking its next piece before it
 * computes the current one, so that piece's weights can be prefetched (OpenMP's dynamic
 * schedule hands the next piece out only when it is asked for). */
#define DEFINE_LORA(NAME, T, PIECE, PAIRS)                                                          \
int NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, const int32_t *segs,             \
         const T *a_base, int64_t a_layer_stride, int64_t a_slot_stride, int in_dim, int n_mod,     \
         const int64_t *mods, const int32_t *ranks, int layer, const int32_t *epi_flags,            \
         const float *epi_scale, const float *epi_shift, int64_t epi_stride, int begin, int end) {  \
    const call_t k = {(const char *)x, (const char *)a_base, (char *)out, x_stride, out_stride,     \
                      a_layer_stride, a_slot_stride, epi_stride, in_dim, n_mod, layer, PAIRS, mods, \
                      ranks, segs, epi_flags, epi_scale, epi_shift};                                \
    int rc = 0, next = begin;                                                                       \
    _Pragma("omp parallel if (end - begin >= 2) reduction(|: rc)")                                  \
    {                                                                                               \
        int i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);                                     \
        while (i < end) {                                                                           \
            const int j = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);                           \
            rc |= PIECE(&k, i, j < end ? segs[3 * j + 2] : -1);                                     \
            i = j;                                                                                  \
        }                                                                                           \
    }                                                                                               \
    return rc;                                                                                      \
}

DEFINE_LORA(lora_segments_bf16, uint16_t, piece_bf16, 1)
DEFINE_LORA(lora_segments_f32, float, piece_f32, 0)
