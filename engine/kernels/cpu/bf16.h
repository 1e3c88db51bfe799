/* bf16 <-> fp32 as torch does them: widen by shifting, narrow rounding to nearest even. */
#ifndef LORAPLEX_CPU_BF16_H
#define LORAPLEX_CPU_BF16_H
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float bf16_load(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)v << 16;
    return x.f;
}

static inline uint16_t bf16_store(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    const uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16;
    /* A select, not a branch, so loops over it vectorise; NaN stays NaN. */
    return (uint16_t)((x.u & 0x7fffffffu) > 0x7f800000u ? (x.u >> 16) | 0x40u : rounded);
}

/* Rounding a value to bf16 and back: what a bf16 tensor op does to each result. */
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

/* Eight bf16 widened to an fp32 vector (the C GEMM's and the LoRA kernel's loads). */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f bf16_widen8(const uint16_t *p) {
#ifdef __AVX2__
    /* One vpmovzxwd from memory and a shift; the generic form below compiles to five ops. */
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    v8h h;
    memcpy(&h, p, sizeof h);
    const v8u u = __builtin_convertvector(h, v8u) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

#ifdef __AVX512F__
/* Sixteen bf16 widened to fp32. */
static inline __m512 bf16_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Sixteen fp32 narrowed to bf16 exactly as bf16_store (to nearest even, NaN kept,
 * denormals kept, which vcvtneps2bf16 flushes to zero). */
static inline __m256i bf16_narrow16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif

static inline float f32_load(float v) { return v; }
static inline float f32_store(float f) { return f; }
static inline float f32_round(float f) { return f; }
#endif
