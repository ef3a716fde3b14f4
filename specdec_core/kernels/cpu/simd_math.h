/* Vector math shared by the C kernels (attention_cpu.c, layers_cpu.c). */
#ifndef SPECDEC_SIMD_MATH_H
#define SPECDEC_SIMD_MATH_H

#include "simd16.h"

/* e^x in each lane, x <= 0 (Cephes' expf polynomial, ~2 ulp); below -87 it is ~0. */
static inline v16f exp16(v16f x) {
    x = v16_max_ps(x, v16_set1_ps(-87.0f));
    v16f n = v16_round_ps(v16_mul_ps(x, v16_set1_ps(1.44269504088896341f)));
    v16f r = v16_fnmadd_ps(n, v16_set1_ps(0.693359375f), x);
    r = v16_fnmadd_ps(n, v16_set1_ps(-2.12194440e-4f), r);
    v16f p = v16_set1_ps(1.9875691500e-4f);
    p = v16_fmadd_ps(p, r, v16_set1_ps(1.3981999507e-3f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(8.3334519073e-3f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(4.1665795894e-2f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(1.6666665459e-1f));
    p = v16_fmadd_ps(p, r, v16_set1_ps(5.0000001201e-1f));
    p = v16_fmadd_ps(p, v16_mul_ps(r, r), v16_add_ps(r, v16_set1_ps(1.0f)));
    return v16_scalef_ps(p, n);
}

#endif
