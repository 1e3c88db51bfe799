/* e^x on 16 fp32 lanes for x <= 0 with AVX-512 (prefill_amx.c's softmax, fused.c's SiLU):
 * libm's vector expf cost those loops 2-3x this. */
#ifndef LORAPLEX_CPU_EXP512_H
#define LORAPLEX_CPU_EXP512_H
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x for x <= 0 (to fp32 accuracy, far below bf16's rounding of it): 2^(x log2 e) as
 * 2^round times a degree-6 polynomial of the fraction in [-1/2, 1/2]. */
static inline __m512 exp_neg(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.44269504f));
    const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, k);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}
#endif
#endif
