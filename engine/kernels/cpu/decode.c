/* Paged attention for decodes (one query token per sequence) on the CPU.
 *
 * The torch path gathers every decode's K and V blocks into contiguous copies, then
 * runs two batched matmuls and a softmax: K and V cross memory three times, with
 * half a dozen intermediate tensors. Here each (sequence, KV head) pair walks its
 * own block table once: a K row is loaded once for all the query heads that share
 * it (GQA), scores and softmax stay in fp32, and V is accumulated in fp32.
 *
 * Built at run time by build.py with the machine's compiler
 * (-O3 -march=native -fopenmp), called through ctypes. OpenMP here is torch's own
 * runtime (the same libgomp.so.1 is already loaded), so the kernels share torch's
 * thread pool and thread count instead of competing with its spinning workers.
 * Work item w = sequence (w / num_kv_heads), KV head (w % num_kv_heads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256

/* Blocks sit wherever the pool put them, so the hardware prefetcher stalls at every jump
 * of the block table. Each row of the current block asks for the same row of the next
 * block (NEXT_BLOCK: NULL after the last), which is in cache when the walk gets there. */
#define NEXT_BLOCK(head, table, t0, ctx, bs, D) \
    ((t0) + (bs) < (ctx) ? (head) + (int64_t)(table)[(t0) / (bs) + 1] * (bs) * (D) : NULL)

static inline void prefetch_row(const void *block, int j, int row_bytes) {
    if (block == NULL) return;
    const char *p = (const char *)block + (int64_t)j * row_bytes;
    for (int off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* One (sequence, KV head) item; always inlined so a constant head_dim unrolls the loops. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                        \
static inline __attribute__((always_inline)) void NAME##_item(                                     \
        const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,       \
        const int32_t *seq_lens, int max_blocks, int num_heads, int num_kv_heads, const int D,      \
        int block_size, int64_t num_slots, float scale, int w, float *scores) {                     \
    const int G = num_heads / num_kv_heads;                                                         \
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];             \
    float sum[MAX_GROUP];                                                                           \
    {                                                                                               \
        const int s = w / num_kv_heads, h = w % num_kv_heads, ctx = seq_lens[s];                    \
        const int32_t *table = block_tables + (int64_t)s * max_blocks;                              \
        const T *kh = k_cache + (int64_t)h * num_slots * D, *vh = v_cache + (int64_t)h * num_slots * D; \
        for (int g = 0; g < G; g++) {                                                               \
            const T *qrow = q + (int64_t)s * q_stride + (int64_t)(h * G + g) * D;                           \
            for (int i = 0; i < D; i++) qf[g][i] = LOAD(qrow[i]) * scale;                           \
        }                                                                                           \
        for (int t0 = 0; t0 < ctx; t0 += block_size) {  /* scores: K read once per block */         \
            const int n = ctx - t0 < block_size ? ctx - t0 : block_size;                            \
            const T *kb = kh + (int64_t)table[t0 / block_size] * block_size * D;                    \
            const T *kn = NEXT_BLOCK(kh, table, t0, ctx, block_size, D);                            \
            for (int j = 0; j < n; j++) {                                                           \
                prefetch_row(kn, j, D * (int)sizeof(T));                                            \
                for (int i = 0; i < D; i++) row[i] = LOAD(kb[(int64_t)j * D + i]);                  \
                for (int g = 0; g < G; g++) {                                                       \
                    float d = 0.f;                                                                  \
                    for (int i = 0; i < D; i++) d += qf[g][i] * row[i];                             \
                    scores[(int64_t)g * ctx + t0 + j] = d;                                          \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int g = 0; g < G; g++) {  /* softmax in fp32 */                                        \
            float *sg = scores + (int64_t)g * ctx, m = sg[0], z = 0.f;                              \
            for (int t = 1; t < ctx; t++) m = sg[t] > m ? sg[t] : m;                                \
            for (int t = 0; t < ctx; t++) { sg[t] = expf(sg[t] - m); z += sg[t]; }                  \
            sum[g] = z;                                                                             \
            for (int i = 0; i < D; i++) acc[g][i] = 0.f;                                            \
        }                                                                                           \
        for (int t0 = 0; t0 < ctx; t0 += block_size) {  /* V read once per block */                 \
            const int n = ctx - t0 < block_size ? ctx - t0 : block_size;                            \
            const T *vb = vh + (int64_t)table[t0 / block_size] * block_size * D;                    \
            const T *vn = NEXT_BLOCK(vh, table, t0, ctx, block_size, D);                            \
            for (int j = 0; j < n; j++) {                                                           \
                prefetch_row(vn, j, D * (int)sizeof(T));                                            \
                for (int i = 0; i < D; i++) row[i] = LOAD(vb[(int64_t)j * D + i]);                  \
                for (int g = 0; g < G; g++) {                                                       \
                    const float p = scores[(int64_t)g * ctx + t0 + j];                              \
                    for (int i = 0; i < D; i++) acc[g][i] += p * row[i];                            \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int g = 0; g < G; g++) {                                                               \
            T *orow = out + ((int64_t)s * num_heads + h * G + g) * D;                               \
            const float inv = 1.f / sum[g];                                                         \
            for (int i = 0; i < D; i++) orow[i] = STORE(acc[g][i] * inv);                           \
        }                                                                                           \
    }                                                                                               \
}                                                                                                   \
                                                                                                    \
int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, T *out, const int32_t *block_tables,      \
         const int32_t *seq_lens, int max_blocks, int num_heads, int num_kv_heads, int head_dim,    \
         int block_size, int64_t num_slots, float scale, int w_begin, int w_end) {                  \
    if (num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;                 \
    int max_ctx = 1;                                                                                \
    for (int w = w_begin; w < w_end; w++)                                                           \
        if (seq_lens[w / num_kv_heads] > max_ctx) max_ctx = seq_lens[w / num_kv_heads];             \
    int rc = 0;                                                                                     \
    _Pragma("omp parallel if (w_end - w_begin >= 8) reduction(|: rc)")                                   \
    {                                                                                               \
        float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads / num_kv_heads) * (size_t)max_ctx); \
        if (!scores) rc |= 2;                                                                       \
        _Pragma("omp for schedule(dynamic, 2)")                                                    \
        for (int w = w_begin; w < w_end; w++) {                                                     \
            if (!scores) continue;                                                                  \
            if (head_dim == 64)                                                                     \
                NAME##_item(q, q_stride, k_cache, v_cache, out, block_tables, seq_lens, max_blocks, num_heads,\
                            num_kv_heads, 64, block_size, num_slots, scale, w, scores);             \
            else if (head_dim == 128)                                                               \
                NAME##_item(q, q_stride, k_cache, v_cache, out, block_tables, seq_lens, max_blocks, num_heads,\
                            num_kv_heads, 128, block_size, num_slots, scale, w, scores);            \
            else                                                                                    \
                NAME##_item(q, q_stride, k_cache, v_cache, out, block_tables, seq_lens, max_blocks, num_heads,\
                            num_kv_heads, head_dim, block_size, num_slots, scale, w, scores);       \
        }                                                                                           \
        free(scores);                                                                               \
    }                                                                                               \
    return rc;                                                                                      \
}

DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_DECODE(paged_decode_f32, float, f32_load, f32_store)
