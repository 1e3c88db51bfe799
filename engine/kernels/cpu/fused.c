/* Fused elementwise steps of a Llama layer on the CPU, in place where the model allows.
 *
 * In torch each of these is a chain of 3-7 ops, each allocating and re-reading an
 * activation tensor; for a 1024-token prefill step on SmolLM2 those chains cost about
 * as much as attention. Every result is rounded exactly where the bf16 torch ops
 * (and transformers, the oracle) round it, so the numbers stay the reference's.
 * Work items are rows [begin, end), shared out by OpenMP (torch's own runtime).
 *
 * With AVX-512 the bf16 versions are written 16 lanes at a time (vcvtneps2bf16 where the
 * CPU has it): the compiler's loops over the scalar source spent most of their time on
 * bf16 rounding spelled out per lane, libm's vector expf and a division. On 2 cores of an
 * AMX Xeon, 1024 rows of SmolLM2: residual add + RMSNorm 190 -> 87 us, RoPE 190 -> 88 us,
 * SiLU-mul 600 -> 370 us (64 rows: 16 -> 9.5, 20 -> 14, 40 -> 26 us).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "exp512.h"

#ifdef __AVX512F__
/* Sixteen fp32 to bf16: vcvtneps2bf16 where the CPU has it (to nearest even as
 * bf16_store, but denormals flushed to zero), else bf16_narrow16. */
static inline __m256i narrow16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return bf16_narrow16(v);
#endif
}

/* a / b for b in [1, 2]: rcp14 and a Newton step, ~1 ulp where a division costs 16 cycles */
static inline __m512 recip_mul(__m512 a, __m512 b) {
    const __m512 r = _mm512_rcp14_ps(b);
    const __m512 r1 = _mm512_mul_ps(r, _mm512_fnmadd_ps(b, r, _mm512_set1_ps(2.f)));
    return _mm512_mul_ps(a, r1);
}

#endif

/* x[r] += delta[r] (when delta is given: the residual add), then
 * out[r] = weight * round(x[r] / rms(x[r])), as transformers' LlamaRMSNorm. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                           \
int NAME(T *x, const T *delta, const T *weight, T *out, int hidden, float eps, int begin, int end) { \
    _Pragma("omp parallel for schedule(static) if (end - begin >= 32)")                             \
    for (int r = begin; r < end; r++) {                                                             \
        T *xr = x + (int64_t)r * hidden;                                                            \
        T *orow = out + (int64_t)r * hidden;                                                        \
        float ss = 0.f;                                                                             \
        if (delta) {                                                                                \
            const T *dr = delta + (int64_t)r * hidden;                                              \
            for (int i = 0; i < hidden; i++) {                                                      \
                const float v = ROUND(LOAD(xr[i]) + LOAD(dr[i]));                                   \
                xr[i] = STORE(v);                                                                   \
                ss += v * v;                                                                        \
            }                                                                                       \
        } else {                                                                                    \
            for (int i = 0; i < hidden; i++) { const float v = LOAD(xr[i]); ss += v * v; }          \
        }                                                                                           \
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);                                    \
        for (int i = 0; i < hidden; i++)                                                            \
            orow[i] = STORE(LOAD(weight[i]) * ROUND(LOAD(xr[i]) * inv));                            \
    }                                                                                               \
    return 0;                                                                                       \
}

/* Rotary embedding in place on the first `heads` heads of each row of the fused q/k/v
 * output (q heads then k heads), halves layout: x*cos + rotate_half(x)*sin. */
#define DEFINE_ROPE(NAME, T, LOAD, STORE, ROUND)                                                   \
int NAME(T *qkv, int64_t row_stride, const T *cos, const T *sin, int heads, int head_dim,          \
         int begin, int end) {                                                                      \
    const int half = head_dim / 2;                                                                  \
    _Pragma("omp parallel for schedule(static) if (end - begin >= 32)")                             \
    for (int t = begin; t < end; t++) {                                                             \
        const T *c = cos + (int64_t)t * head_dim, *s = sin + (int64_t)t * head_dim;                 \
        for (int h = 0; h < heads; h++) {                                                           \
            T *x = qkv + (int64_t)t * row_stride + (int64_t)h * head_dim;                           \
            for (int i = 0; i < half; i++) {                                                        \
                const float a = LOAD(x[i]), b = LOAD(x[i + half]);                                  \
                const float lo = ROUND(a * LOAD(c[i])) + ROUND(-b * LOAD(s[i]));                    \
                const float hi = ROUND(b * LOAD(c[i + half])) + ROUND(a * LOAD(s[i + half]));       \
                x[i] = STORE(lo);                                                                   \
                x[i + half] = STORE(hi);                                                            \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    return 0;                                                                                       \
}

/* out[r] = silu(gate[r]) * up[r], gate and up the two halves of the fused gate/up row. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                               \
int NAME(const T *gate_up, T *out, int inter, int begin, int end) {                                \
    _Pragma("omp parallel for schedule(static) if (end - begin >= 32)")                             \
    for (int r = begin; r < end; r++) {                                                             \
        const T *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;                              \
        T *o = out + (int64_t)r * inter;                                                            \
        for (int i = 0; i < inter; i++) {                                                           \
            /* exp of -|x| only: never overflows, whatever the magnitude of x */                   \
            const float x = LOAD(g[i]), e = expf(-fabsf(x)), sig = (x >= 0.f ? 1.f : e) / (1.f + e); \
            o[i] = STORE(ROUND(x * sig) * LOAD(u[i]));                                              \
        }                                                                                           \
    }                                                                                               \
    return 0;                                                                                       \
}

DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_load, f32_store, f32_round)
DEFINE_ROPE(rope_bf16_any, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_ROPE(rope_f32, float, f32_load, f32_store, f32_round)
#ifdef __AVX512F__
/* add_rms_norm in bf16, 16 lanes at a time (the macro's loops, vectorised by the compiler,
 * spent most of their time spelling out bf16 rounding); the same roundings. */
int add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out, int hidden,
                      float eps, int begin, int end) {
    _Pragma("omp parallel for schedule(static) if (end - begin >= 32)")
    for (int r = begin; r < end; r++) {
        uint16_t *xr = x + (int64_t)r * hidden, *orow = out + (int64_t)r * hidden;
        const uint16_t *dr = delta ? delta + (int64_t)r * hidden : NULL;
        __m512 acc = _mm512_setzero_ps();
        float ss = 0.f;
        int i = 0;
        for (; i + 16 <= hidden; i += 16) {
            __m512 v = bf16_widen16(_mm256_loadu_si256((const __m256i *)(xr + i)));
            if (dr) {
                const __m256i h = narrow16(_mm512_add_ps(v, bf16_widen16(_mm256_loadu_si256((const __m256i *)(dr + i)))));
                _mm256_storeu_si256((__m256i *)(xr + i), h);
                v = bf16_widen16(h);
            }
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        for (; i < hidden; i++) {
            const float v = dr ? bf16_round(bf16_load(xr[i]) + bf16_load(dr[i])) : bf16_load(xr[i]);
            if (dr) xr[i] = bf16_store(v);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf((ss + _mm512_reduce_add_ps(acc)) / (float)hidden + eps);
        const __m512 inv_v = _mm512_set1_ps(inv);
        for (i = 0; i + 16 <= hidden; i += 16) {
            const __m512 n = bf16_widen16(narrow16(_mm512_mul_ps(bf16_widen16(_mm256_loadu_si256((const __m256i *)(xr + i))), inv_v)));
            const __m512 w = bf16_widen16(_mm256_loadu_si256((const __m256i *)(weight + i)));
            _mm256_storeu_si256((__m256i *)(orow + i), narrow16(_mm512_mul_ps(w, n)));
        }
        for (; i < hidden; i++) orow[i] = bf16_store(bf16_load(weight[i]) * bf16_round(bf16_load(xr[i]) * inv));
    }
    return 0;
}

static inline __m512 round16(__m512 v) { return bf16_widen16(narrow16(v)); }

/* rope in bf16 for head sizes of whole vectors per half, 16 lanes at a time (the same
 * roundings: after each product and after the sum, as torch); others take the macro's. */
int rope_bf16(uint16_t *qkv, int64_t row_stride, const uint16_t *cos, const uint16_t *sin, int heads, int head_dim,
              int begin, int end) {
    const int half = head_dim / 2;
    if (half % 16) return rope_bf16_any(qkv, row_stride, cos, sin, heads, head_dim, begin, end);
    _Pragma("omp parallel for schedule(static) if (end - begin >= 32)")
    for (int t = begin; t < end; t++) {
        const uint16_t *c = cos + (int64_t)t * head_dim, *s = sin + (int64_t)t * head_dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *x = qkv + (int64_t)t * row_stride + (int64_t)h * head_dim;
            for (int i = 0; i < half; i += 16) {
                const __m512 a = bf16_widen16(_mm256_loadu_si256((const __m256i *)(x + i)));
                const __m512 b = bf16_widen16(_mm256_loadu_si256((const __m256i *)(x + half + i)));
                const __m512 c_lo = bf16_widen16(_mm256_loadu_si256((const __m256i *)(c + i)));
                const __m512 c_hi = bf16_widen16(_mm256_loadu_si256((const __m256i *)(c + half + i)));
                const __m512 s_lo = bf16_widen16(_mm256_loadu_si256((const __m256i *)(s + i)));
                const __m512 s_hi = bf16_widen16(_mm256_loadu_si256((const __m256i *)(s + half + i)));
                const __m512 lo = _mm512_sub_ps(round16(_mm512_mul_ps(a, c_lo)), round16(_mm512_mul_ps(b, s_lo)));
                const __m512 hi = _mm512_add_ps(round16(_mm512_mul_ps(b, c_hi)), round16(_mm512_mul_ps(a, s_hi)));
                _mm256_storeu_si256((__m256i *)(x + i), narrow16(lo));
                _mm256_storeu_si256((__m256i *)(x + half + i), narrow16(hi));
            }
        }
    }
    return 0;
}

/* silu_mul in bf16, 16 lanes at a time: exp512.h's exp and a reciprocal by rcp14 and a
 * Newton step (the macro's loop, vectorised by the compiler with libm's vector expf and a
 * division, took 1.6x as long on 1024 rows of SmolLM2's MLP); the same roundings. */
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int inter, int begin, int end) {
    _Pragma("omp parallel for schedule(static) if (end - begin >= 32)")
    for (int r = begin; r < end; r++) {
        const uint16_t *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        uint16_t *o = out + (int64_t)r * inter;
        int i = 0;
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = bf16_widen16(_mm256_loadu_si256((const __m256i *)(g + i)));
            const __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
            const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e,
                                                    _mm512_set1_ps(1.f));
            const __m512 silu = bf16_widen16(narrow16(_mm512_mul_ps(x, recip_mul(num, _mm512_add_ps(e, _mm512_set1_ps(1.f))))));
            const __m512 up = bf16_widen16(_mm256_loadu_si256((const __m256i *)(u + i)));
            _mm256_storeu_si256((__m256i *)(o + i), narrow16(_mm512_mul_ps(silu, up)));
        }
        for (; i < inter; i++) {
            const float x = bf16_load(g[i]), e = expf(-fabsf(x)), sig = (x >= 0.f ? 1.f : e) / (1.f + e);
            o[i] = bf16_store(bf16_round(x * sig) * bf16_load(u[i]));
        }
    }
    return 0;
}
#else
int rope_bf16(uint16_t *qkv, int64_t row_stride, const uint16_t *cos, const uint16_t *sin, int heads, int head_dim,
              int begin, int end) {
    return rope_bf16_any(qkv, row_stride, cos, sin, heads, head_dim, begin, end);
}
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
#endif
DEFINE_SILU_MUL(silu_mul_f32, float, f32_load, f32_store, f32_round)

/* The step's new keys and values into their cache slots: cache [kv_heads, slots, head_dim],
 * k/v rows [T, row_stride] (views into the fused qkv output). Whole head rows are copied,
 * so one version per element size serves every dtype of that size. */
#define DEFINE_WRITE_KV(NAME, T)                                                                   \
int NAME(T *k_cache, T *v_cache, const T *k, const T *v, int64_t row_stride, const int64_t *slots, \
         int kv_heads, int head_dim, int64_t num_slots, int begin, int end) {                       \
    for (int t = begin; t < end; t++)  /* checked first: nothing is written for a bad batch */     \
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;                                       \
    _Pragma("omp parallel for schedule(static) if (end - begin >= 64)")                             \
    for (int t = begin; t < end; t++) {                                                             \
        for (int h = 0; h < kv_heads; h++) {                                                        \
            const int64_t dst = ((int64_t)h * num_slots + slots[t]) * head_dim;                     \
            const int64_t src = (int64_t)t * row_stride + (int64_t)h * head_dim;                    \
            for (int i = 0; i < head_dim; i++) { k_cache[dst + i] = k[src + i]; v_cache[dst + i] = v[src + i]; } \
        }                                                                                           \
    }                                                                                               \
    return 0;                                                                                       \
}

DEFINE_WRITE_KV(write_kv_u16, uint16_t)
DEFINE_WRITE_KV(write_kv_u32, uint32_t)
