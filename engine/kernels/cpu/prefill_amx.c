/* Paged causal attention for bf16 prefill chunks on AMX tiles (Xeons from Sapphire Rapids).
 *
 * The same work items as prefill.c (a block of query rows of one chunk and one KV head,
 * their query vectors i = row * G + head), the same walk of the paged cache, but both
 * products on tiles: on 2 cores of an AMX Xeon prefill.c's FMAs ran ~155 GFLOP/s, a
 * quarter of a 1024-token prefill step's time; this kernel 2.4-2.6x that on four fresh
 * 256-token prompts (SmolLM2's 9 query and 3 KV heads of 64), where the softmax's exp
 * (its own polynomial: libm's vector expf cost 40% of the kernel) and the packing of K
 * and V now take about as long as the tiles.
 *
 * Scores S = Q K^T: A tiles are the item's query vectors packed once (bf16, unscaled: the
 * scale goes on the fp32 scores), B tiles are 16 keys' K rows transposed as 32-bit pairs
 * of dims (AMX's [k/2][n][2] operand), read straight from each key's block. Softmax per
 * query vector over its own causal length in fp32; the weights are rounded to bf16 for
 * P V (as a bf16 matmul rounds them) and their sum taken over the rounded weights. P V:
 * A tiles are rows of P, B tiles pairs of V rows interleaved, 16 dims at a time, packed
 * once per item. Keys past the context are zero rows in both packs, never the cache's
 * other contents (0 x NaN would be NaN). One rounding of each output at the end.
 *
 * items: int32 [n, 4] = (first batch row, rows, position of the first row, sequence
 * index into block_tables); work item w = item (w / num_kv_heads), KV head (w % num_kv_heads).
 * Returns 1 where this CPU or build has no AMX (the caller keeps prefill.c).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "exp512.h"

#define MAX_QG 64 /* query vectors per item: four A tiles */
#define MAX_D 256

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

/* r[i] lane j -> r[j] lane i, for 32-bit lanes. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + e], 128-bit lane q: element 4q + e of rows i..i+3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {  /* then a 4x4 transpose of 128-bit lanes */
        const __m512i x0 = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i x1 = _mm512_shuffle_i32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i y0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i y1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
        r[e] = _mm512_shuffle_i32x4(x0, y0, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + e] = _mm512_shuffle_i32x4(x0, y0, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + e] = _mm512_shuffle_i32x4(x1, y1, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + e] = _mm512_shuffle_i32x4(x1, y1, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* p[t] = bf16(e^((s[t] - max) * scale)) for t < n; returns the sum of the rounded p. */
static inline float softmax_row(const float *s, int n, float scale, uint16_t *p) {
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, s + t));
    }
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm)), sc = _mm512_set1_ps(scale);
    __m512 z = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 m = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = exp_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx), sc));
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);  /* to nearest even, as bf16_store */
        _mm256_mask_storeu_epi16(p + t, m, h);
        z = _mm512_add_ps(z, _mm512_maskz_mov_ps(m, bf16_widen16(h)));
    }
    return _mm512_reduce_add_ps(z);
}

typedef struct {  /* one thread's buffers, sized for the call's longest context */
    uint16_t *qa;  /* [MAX_QG][D] query vectors */
    uint16_t *kb;  /* [D / 32][16][16][2] one key tile's B tiles */
    float *sc;     /* [MAX_QG][ld] scores */
    uint16_t *pb;  /* [MAX_QG][ldp] softmax weights */
    uint16_t *vb;  /* [ldp / 32][D / 16][16][16][2] V's B tiles */
    float *ob;     /* [16][64] a P V block */
} buffers;

#define ROW(cache, table, t, bs, D) ((cache) + ((int64_t)(table)[(t) / (bs)] * (bs) + (t) % (bs)) * (D))

/* Keys [t0, t0 + 16) as B tiles of S = Q K^T, one per 32 dims; keys from ctx on are zero. */
static void pack_keys(const uint16_t *kh, const int32_t *table, int bs, int D, int t0, int ctx, uint16_t *kb) {
    for (int c = 0; c < D; c += 32) {
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = t0 + j < ctx ? _mm512_loadu_si512(ROW(kh, table, t0 + j, bs, D) + c) : _mm512_setzero_si512();
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512(kb + (c / 32) * 512 + j * 32, r[j]);
    }
}

/* V rows [0, n) as B tiles of P V: per 32 keys and 16 dims, row kk holds the pairs
 * (V[2kk][d], V[2kk + 1][d]); rows from ctx on are zero. */
static void pack_values(const uint16_t *vh, const int32_t *table, int bs, int D, int ctx, int n, uint16_t *vb) {
    const __m256i zero = _mm256_setzero_si256();
    for (int t = 0; t < n; t += 2)
        for (int c = 0; c < D; c += 16) {
            const __m256i a = t < ctx ? _mm256_loadu_si256((const __m256i *)(ROW(vh, table, t, bs, D) + c)) : zero;
            const __m256i b = t + 1 < ctx ? _mm256_loadu_si256((const __m256i *)(ROW(vh, table, t + 1, bs, D) + c)) : zero;
            const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
            uint16_t *tile = vb + ((int64_t)(t / 32) * (D / 16) + c / 16) * 512;
            _mm512_storeu_si512(tile + (t % 32 / 2) * 32, pair);
        }
}

/* Scores of query tile T (A, tile 5) against the key tile in kb (B, tile 4), into C tile T. */
#define SCORE_TILE(T)                                                                                \
    if ((T) < tiles && t0 < limit[T]) {                                                              \
        _tile_loadd(5, b->qa + (int64_t)(T) * 16 * D + c, D * 2);                                    \
        _tile_dpbf16ps(T, 5, 4);                                                                     \
    }
#define STORE_SCORES(T) \
    if ((T) < tiles && t0 < limit[T]) _tile_stored(T, b->sc + (int64_t)(T) * 16 * ld + t0, ld * 4);
/* P V of query tile qt over the 32 keys at t0 (A, tile 4), dims dc0 + 16 T on (B, tile 5), into C tile T. */
#define PV_TILE(T)                                                                                   \
    if (dc0 + (T) * 16 < D) {                                                                        \
        _tile_loadd(5, b->vb + ((int64_t)(t0 / 32) * (D / 16) + dc0 / 16 + (T)) * 512, 64);           \
        _tile_dpbf16ps(T, 4, 5);                                                                     \
    }
#define STORE_PV(T) if (dc0 + (T) * 16 < D) _tile_stored(T, b->ob + (T) * 16, 64 * 4);

static void item_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                     uint16_t *out, const int32_t *item, const int32_t *block_tables, int max_blocks, int H, int KVH,
                     int D, int bs, int64_t num_slots, float scale, int h, const buffers *b, int ld, int ldp) {
    const int G = H / KVH, r0 = item[0], nr = item[1], p0 = item[2], nq = nr * G;
    const int ctx = p0 + nr, tiles = (nq + 15) / 16;
    const int32_t *table = block_tables + (int64_t)item[3] * max_blocks;
    const uint16_t *kh = k_cache + (int64_t)h * num_slots * D, *vh = v_cache + (int64_t)h * num_slots * D;
    int limit[4];  /* keys the last query vector of each tile sees */
    for (int t = 0; t < 4; t++) limit[t] = t < tiles ? p0 + ((t * 16 + 15 < nq ? t * 16 + 15 : nq - 1) / G) + 1 : 0;
    memset(b->qa, 0, sizeof(uint16_t) * (size_t)tiles * 16 * D);
    for (int i = 0; i < nq; i++)
        memcpy(b->qa + (int64_t)i * D, q + (int64_t)(r0 + i / G) * q_stride + (int64_t)(h * G + i % G) * D, D * 2);
    for (int t0 = 0; t0 < ctx; t0 += 16) {  /* S = Q K^T, 16 keys at a time */
        pack_keys(kh, table, bs, D, t0, ctx, b->kb);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < D; c += 32) {
            _tile_loadd(4, b->kb + (c / 32) * 512, 64);
            SCORE_TILE(0) SCORE_TILE(1) SCORE_TILE(2) SCORE_TILE(3)
        }
        STORE_SCORES(0) STORE_SCORES(1) STORE_SCORES(2) STORE_SCORES(3)
    }
    float inv[MAX_QG];
    const int ctx32 = (ctx + 31) / 32 * 32;  /* keys P V reads: the context in steps of 32 */
    for (int i = 0; i < tiles * 16; i++) {  /* softmax over the row's own keys, rounded for P V */
        uint16_t *p = b->pb + (int64_t)i * ldp;
        if (i >= nq) { memset(p, 0, sizeof(uint16_t) * (size_t)ctx32); continue; }
        const int n = p0 + i / G + 1;
        inv[i] = 1.f / softmax_row(b->sc + (int64_t)i * ld, n, scale, p);
        memset(p + n, 0, sizeof(uint16_t) * (size_t)(ctx32 - n));
    }
    pack_values(vh, table, bs, D, ctx, ctx32, b->vb);
    for (int qt = 0; qt < tiles; qt++) {  /* out = P V, 16 query vectors by 64 dims at a time */
        for (int dc0 = 0; dc0 < D; dc0 += 64) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int t0 = 0; t0 < limit[qt]; t0 += 32) {
                _tile_loadd(4, b->pb + (int64_t)qt * 16 * ldp + t0, ldp * 2);
                PV_TILE(0) PV_TILE(1) PV_TILE(2) PV_TILE(3)
            }
            STORE_PV(0) STORE_PV(1) STORE_PV(2) STORE_PV(3)
            const int w = D - dc0 < 64 ? D - dc0 : 64;
            for (int r = 0; r < 16 && qt * 16 + r < nq; r++) {
                const int i = qt * 16 + r;
                uint16_t *o = out + ((int64_t)(r0 + i / G) * H + h * G + i % G) * D + dc0;
                const __m512 scale_i = _mm512_set1_ps(inv[i]);
                for (int d = 0; d < w; d += 16)  /* to nearest even, as bf16_store */
                    _mm256_storeu_si256((__m256i *)(o + d),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(b->ob + r * 64 + d), scale_i)));
            }
        }
    }
}
#endif

int paged_prefill_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                      uint16_t *out, const int32_t *items, const int32_t *block_tables, int max_blocks, int num_heads,
                      int num_kv_heads, int head_dim, int block_size, int64_t num_slots, float scale, int w_begin,
                      int w_end) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    const int G = num_heads / num_kv_heads, D = head_dim;
    if (D % 32 || D > MAX_D || num_heads % num_kv_heads) return 1;
    int max_ctx = 1;
    for (int w = w_begin; w < w_end; w++) {
        const int32_t *it = items + 4 * (w / num_kv_heads);
        if (it[1] < 1 || it[1] * G > MAX_QG) return 2;
        if (it[2] + it[1] > max_ctx) max_ctx = it[2] + it[1];
    }
    const int ld = (max_ctx + 15) / 16 * 16, ldp = (max_ctx + 31) / 32 * 32;
    int rc = 0;
    _Pragma("omp parallel if (w_end - w_begin >= 2) reduction(|: rc)")
    {
        buffers b = {malloc(sizeof(uint16_t) * MAX_QG * D), malloc(sizeof(uint16_t) * 16 * D),
                     malloc(sizeof(float) * MAX_QG * (size_t)ld), malloc(sizeof(uint16_t) * MAX_QG * (size_t)ldp),
                     malloc(sizeof(uint16_t) * (size_t)ldp * D), malloc(sizeof(float) * 16 * 64)};
        const int ok = b.qa && b.kb && b.sc && b.pb && b.vb && b.ob;
        if (!ok) rc |= 4;
        load_tile_config();
        _Pragma("omp for schedule(dynamic)")
        for (int w = w_begin; w < w_end; w++) {
            if (!ok) continue;
            item_amx(q, q_stride, k_cache, v_cache, out, items + 4 * (w / num_kv_heads), block_tables, max_blocks,
                     num_heads, num_kv_heads, D, block_size, num_slots, scale, w % num_kv_heads, &b, ld, ldp);
        }
        _tile_release();
        free(b.qa), free(b.kb), free(b.sc), free(b.pb), free(b.vb), free(b.ob);
    }
    return rc;
#else
    (void)q; (void)q_stride; (void)k_cache; (void)v_cache; (void)out; (void)items; (void)block_tables;
    (void)max_blocks; (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)num_slots;
    (void)scale; (void)w_begin; (void)w_end;
    return 1;
#endif
}
