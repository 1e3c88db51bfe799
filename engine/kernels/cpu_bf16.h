/* bf16 <-> fp32 as torch does them: widen by shifting, narrow rounding to nearest even. */
#ifndef LORAPLEX_CPU_BF16_H
#define LORAPLEX_CPU_BF16_H
#include <stdint.h>

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

static inline float f32_load(float v) { return v; }
static inline float f32_store(float f) { return f; }
static inline float f32_round(float f) { return f; }
#endif
