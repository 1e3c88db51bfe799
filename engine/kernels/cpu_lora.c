/* Multi-LoRA for short adapter segments (decode rows, short prefill chunks) on the CPU.
 *
 * A decode step over many adapters is bound by reading the adapters' weights: each
 * segment has a few rows, so every A and B element is used a few times. Batched torch
 * matmuls over padded slots read them at about half the memory speed a plain loop does.
 * Here each segment streams its adapter's A rows once (shrink, fp32 dot products
 * against the segment's rows) and its B^T rows once (expand, fp32 axpy into a row
 * accumulator), adding the delta into `out` with one rounding.
 *
 * Weights come from lora_batch.SlotStacks: A [layers, slots, RA, in] (modules' rows at
 * their offsets), per module B^T [layers, slots, r_alloc, out_m]. Per module, `mods`
 * holds {A row offset, r_alloc, output column, out_m, B^T base address, B^T layer
 * stride}; `ranks` [slots, modules] the rank each slot really has for the layer.
 * Work items are segments [begin, end), shared out by OpenMP (torch's own runtime).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#define MAX_RANK 256
#define MAX_ROWS 64
#define MAX_OUT (1 << 20)  /* rows x output width of one module */

#define DEFINE_LORA(NAME, T, LOAD, STORE)                                                          \
int NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, const int32_t *segs,            \
         const T *a_base, int64_t a_layer_stride, int64_t a_slot_stride, int in_dim, int n_mod,     \
         const int64_t *mods, const int32_t *ranks, int layer, int begin, int end) {                \
    static __thread float acc[MAX_OUT];                                                             \
    int rc = 0;                                                                                     \
    _Pragma("omp parallel for schedule(dynamic) if (end - begin >= 4) reduction(|: rc)")              \
    for (int i = begin; i < end; i++) {                                                             \
        float s[MAX_ROWS][MAX_RANK];                                                                \
        const int r0 = segs[3 * i], r1 = segs[3 * i + 1], slot = segs[3 * i + 2], n = r1 - r0;      \
        if (n > MAX_ROWS) { rc |= 1; continue; }                                                    \
        const T *a_slot = a_base + layer * a_layer_stride + slot * a_slot_stride;                   \
        for (int m = 0; m < n_mod; m++) {                                                           \
            const int64_t *md = mods + 6 * m;                                                       \
            const int r = ranks[slot * n_mod + m], r_alloc = (int)md[1], width = (int)md[3];        \
            if (r == 0) continue;                                                                   \
            if (r > MAX_RANK) { rc |= 2; continue; }                                         \
            const T *a = a_slot + md[0] * in_dim;                                                   \
            for (int k = 0; k < r; k++) {  /* shrink: s = x A^T, A row k read once */               \
                const T *ak = a + (int64_t)k * in_dim;                                              \
                for (int row = 0; row < n; row++) {                                                 \
                    const T *xr = x + (int64_t)(r0 + row) * x_stride;                               \
                    float d = 0.f;                                                                  \
                    for (int j = 0; j < in_dim; j++) d += LOAD(xr[j]) * LOAD(ak[j]);                \
                    s[row][k] = d;                                                                  \
                }                                                                                   \
            }                                                                                       \
            const T *bt = (const T *)(intptr_t)md[4] + layer * md[5] + (int64_t)slot * r_alloc * width; \
            if ((int64_t)n * width > MAX_OUT) { rc |= 4; continue; }                                            \
            memset(acc, 0, sizeof(float) * (size_t)n * (size_t)width);                              \
            for (int k = 0; k < r; k++) {  /* expand: acc += s B^T, B^T row k read once */          \
                const T *bk = bt + (int64_t)k * width;                                              \
                for (int row = 0; row < n; row++) {                                                 \
                    float *ar = acc + (int64_t)row * width;                                         \
                    const float sk = s[row][k];                                                     \
                    for (int j = 0; j < width; j++) ar[j] += sk * LOAD(bk[j]);                      \
                }                                                                                   \
            }                                                                                       \
            for (int row = 0; row < n; row++) {                                                     \
                T *o = out + (int64_t)(r0 + row) * out_stride + md[2];                              \
                const float *ar = acc + (int64_t)row * width;                                       \
                for (int j = 0; j < width; j++) o[j] = STORE(LOAD(o[j]) + ar[j]);                   \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    return rc;                                                                                      \
}

DEFINE_LORA(lora_short_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_LORA(lora_short_f32, float, f32_load, f32_store)
