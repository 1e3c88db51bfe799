/* Fused elementwise steps of a Llama layer on the CPU, in place where the model allows.
 *
 * In torch each of these is a chain of 3-7 ops, each allocating and re-reading an
 * activation tensor; for a 1024-token prefill step on SmolLM2 those chains cost about
 * as much as attention. Every result is rounded exactly where the bf16 torch ops
 * (and transformers, the oracle) round it, so the numbers stay the reference's.
 * Work items are rows [begin, end), shared out by OpenMP (torch's own runtime).
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

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

DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_load, f32_store, f32_round)
DEFINE_ROPE(rope_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
DEFINE_ROPE(rope_f32, float, f32_load, f32_store, f32_round)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_load, bf16_store, bf16_round)
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
