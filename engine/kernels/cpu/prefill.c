/* Paged causal attention for prefill chunks on the CPU.
 *
 * torch's SDPA reached ~47 GFLOP/s on a 215-token prompt (bf16, 2 threads) after the
 * torch path had gathered the chunk's K and V blocks into contiguous copies; prefill
 * attention was then a quarter of a prefill step. Here each work item is a block of
 * query rows of one chunk and one KV head: all its query vectors (rows x the heads
 * sharing that KV head) are scored against each group of VL keys read straight from
 * the paged cache, transposed once so keys lie along the vector lanes (no horizontal
 * sums), then softmax in fp32 over each row's own causal length, then P V with a
 * register tile of QT queries x DT vectors of the head dimension. One rounding at the
 * end, as the decode kernel (decode.c).
 *
 * items: int32 [n, 4] = (first batch row, rows, position of the first row, sequence
 * index into block_tables); work item w = item (w / num_kv_heads), KV head (w % num_kv_heads).
 */
#pragma GCC optimize("ira-loop-pressure")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX512F__
#define VL 16
#else
#define VL 8
#endif
#define MAX_QG 64      /* query vectors per item: rows x query heads per KV head */
#define MAX_HEAD_DIM 256
#define QS 8           /* query vectors per score tile: independent FMA chains */
#define QT 4           /* query vectors per P V tile */
#define DT 4           /* vectors of the head dimension per P V tile */

typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf vbcast(float x) { return (vf){0} + x; }

#define DEFINE_PREFILL(NAME, T, LOAD, STORE)                                                       \
static void NAME##_item(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, T *out,  \
        const int32_t *item, const int32_t *block_tables, int max_blocks, int H, int KVH, int D,    \
        int bs, int64_t num_slots, float scale, int h, float *sc, int ld) {                         \
    const int G = H / KVH, r0 = item[0], nr = item[1], p0 = item[2], nq = nr * G;                   \
    const int ctx = p0 + nr;  /* keys the last row sees */                                          \
    const int32_t *table = block_tables + (int64_t)item[3] * max_blocks;                            \
    const T *kh = k_cache + (int64_t)h * num_slots * D, *vh = v_cache + (int64_t)h * num_slots * D; \
    float qf[MAX_QG][MAX_HEAD_DIM];                                                                 \
    _Alignas(64) float kt[MAX_HEAD_DIM][VL];                                                        \
    for (int r = 0; r < nr; r++)  /* query vector r * G + g: row r, head h * G + g */               \
        for (int g = 0; g < G; g++) {                                                               \
            const T *src = q + (int64_t)(r0 + r) * q_stride + (int64_t)(h * G + g) * D;             \
            for (int d = 0; d < D; d++) qf[r * G + g][d] = LOAD(src[d]) * scale;                    \
        }                                                                                           \
    for (int i = nq; i < (nq + QS - 1) / QS * QS; i++) memset(qf[i], 0, sizeof(float) * D);         \
    for (int t0 = 0; t0 < ctx; t0 += VL) {  /* scores, VL keys at a time */                        \
        for (int j = 0; j < VL; j++) {                                                              \
            const int t = t0 + j;                                                                   \
            if (t < ctx) {                                                                          \
                const T *kr = kh + ((int64_t)table[t / bs] * bs + t % bs) * D;                      \
                for (int d = 0; d < D; d++) kt[d][j] = LOAD(kr[d]);                                 \
            } else {                                                                                \
                for (int d = 0; d < D; d++) kt[d][j] = 0.f;                                         \
            }                                                                                       \
        }                                                                                           \
        for (int i0 = 0; i0 < nq; i0 += QS) {                                                       \
            vf acc[QS];                                                                             \
            for (int i = 0; i < QS; i++) acc[i] = (vf){0};                                          \
            for (int d = 0; d < D; d++) {                                                           \
                vf kv;                                                                              \
                memcpy(&kv, kt[d], sizeof kv);                                                      \
                for (int i = 0; i < QS; i++) acc[i] += vbcast(qf[i0 + i][d]) * kv;                  \
            }                                                                                       \
            for (int i = 0; i < QS && i0 + i < nq; i++) memcpy(sc + (int64_t)(i0 + i) * ld + t0, &acc[i], sizeof(vf)); \
        }                                                                                           \
    }                                                                                               \
    float inv[MAX_QG];                                                                              \
    for (int i = 0; i < nq; i++) {  /* softmax over the row's own keys; later keys weigh 0 */       \
        float *s = sc + (int64_t)i * ld, m = s[0], z = 0.f;                                         \
        const int n = p0 + i / G + 1;                                                               \
        for (int t = 1; t < n; t++) m = s[t] > m ? s[t] : m;                                        \
        for (int t = 0; t < n; t++) { s[t] = expf(s[t] - m); z += s[t]; }                           \
        for (int t = n; t < ctx; t++) s[t] = 0.f;                                                   \
        inv[i] = 1.f / z;                                                                           \
    }                                                                                               \
    for (int i0 = 0; i0 < nq; i0 += QT) {  /* out = P V */                                          \
        int rows[QT];                                                                               \
        for (int i = 0; i < QT; i++) rows[i] = i0 + i < nq ? i0 + i : nq - 1;                       \
        const int n = p0 + rows[QT - 1] / G + 1;  /* keys the tile's last query sees */             \
        for (int c = 0; c < D; c += DT * VL) {                                                      \
            const int w = D - c < DT * VL ? D - c : DT * VL;                                        \
            if (w == DT * VL) {                                                                     \
                vf acc[QT][DT];                                                                     \
                for (int i = 0; i < QT; i++)                                                        \
                    for (int u = 0; u < DT; u++) acc[i][u] = (vf){0};                               \
                for (int t = 0; t < n; t++) {                                                       \
                    const T *vr = vh + ((int64_t)table[t / bs] * bs + t % bs) * D + c;              \
                    vf vv[DT];                                                                      \
                    for (int u = 0; u < DT; u++)                                                    \
                        for (int l = 0; l < VL; l++) vv[u][l] = LOAD(vr[u * VL + l]);               \
                    for (int i = 0; i < QT; i++) {                                                  \
                        const vf p = vbcast(sc[(int64_t)rows[i] * ld + t]);                         \
                        for (int u = 0; u < DT; u++) acc[i][u] += p * vv[u];                        \
                    }                                                                               \
                }                                                                                   \
                for (int i = 0; i < QT && i0 + i < nq; i++) {                                       \
                    const int r = (i0 + i) / G, g = (i0 + i) % G;                                   \
                    T *o = out + ((int64_t)(r0 + r) * H + h * G + g) * D + c;                       \
                    for (int u = 0; u < DT; u++)                                                    \
                        for (int l = 0; l < VL; l++) o[u * VL + l] = STORE(acc[i][u][l] * inv[i0 + i]); \
                }                                                                                   \
            } else {  /* head dims that are not a multiple of DT * VL: the rest, plainly */         \
                for (int i = i0; i < i0 + QT && i < nq; i++) {                                      \
                    float acc[DT * VL] = {0};                                                       \
                    const int ni = p0 + i / G + 1;                                                  \
                    for (int t = 0; t < ni; t++) {                                                  \
                        const T *vr = vh + ((int64_t)table[t / bs] * bs + t % bs) * D + c;          \
                        const float p = sc[(int64_t)i * ld + t];                                    \
                        for (int l = 0; l < w; l++) acc[l] += p * LOAD(vr[l]);                      \
                    }                                                                               \
                    T *o = out + ((int64_t)(r0 + i / G) * H + h * G + i % G) * D + c;               \
                    for (int l = 0; l < w; l++) o[l] = STORE(acc[l] * inv[i]);                      \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}                                                                                                   \
                                                                                                    \
int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, T *out, const int32_t *items, \
         const int32_t *block_tables, int max_blocks, int num_heads, int num_kv_heads, int head_dim, \
         int block_size, int64_t num_slots, float scale, int w_begin, int w_end) {                  \
    const int G = num_heads / num_kv_heads;                                                         \
    if (head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads) return 1;                              \
    int max_ctx = 1;                                                                                \
    for (int w = w_begin; w < w_end; w++) {                                                         \
        const int32_t *it = items + 4 * (w / num_kv_heads);                                         \
        if (it[1] < 1 || it[1] * G > MAX_QG) return 2;                                              \
        if (it[2] + it[1] > max_ctx) max_ctx = it[2] + it[1];                                       \
    }                                                                                               \
    const int ld = (max_ctx + VL - 1) / VL * VL;                                                    \
    int rc = 0;                                                                                     \
    _Pragma("omp parallel if (w_end - w_begin >= 2) reduction(|: rc)")                               \
    {                                                                                               \
        float *sc = (float *)malloc(sizeof(float) * (size_t)MAX_QG * (size_t)ld);                   \
        if (!sc) rc |= 4;                                                                           \
        _Pragma("omp for schedule(dynamic)")                                                         \
        for (int w = w_begin; w < w_end; w++) {                                                     \
            if (!sc) continue;                                                                      \
            NAME##_item(q, q_stride, k_cache, v_cache, out, items + 4 * (w / num_kv_heads), block_tables, \
                        max_blocks, num_heads, num_kv_heads, head_dim, block_size, num_slots, scale, \
                        w % num_kv_heads, sc, ld);                                                  \
        }                                                                                           \
        free(sc);                                                                                   \
    }                                                                                               \
    return rc;                                                                                      \
}

DEFINE_PREFILL(paged_prefill_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_PREFILL(paged_prefill_f32, float, f32_load, f32_store)
