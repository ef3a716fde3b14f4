/* 16-float vectors for the C kernels, on AVX-512, on AVX2 or one lane at a time, with the
 * same numbers on all three.
 *
 * attention_cpu.c and layers_cpu.c are written against 512-bit vectors of 16 floats. With
 * AVX-512 (VNNI) each v16_* name below is the AVX-512 intrinsic of the same suffix, so that
 * build is the intrinsics themselves. Without it (AVX2 with FMA and F16C: most desktop CPUs
 * of the last ten years) a vector is a pair of 256-bit halves and each operation is done on
 * both. Anywhere else (a CPU without AVX2, ARM, or native.py's scalar build, which defines
 * SPECDEC_SCALAR) a vector is 16 floats done one lane at a time in plain C, with fmaf where
 * the others fuse. Every lane gets the same IEEE operations in the same order each way, and
 * the reductions add in the order GCC's AVX-512 ones do, so a kernel's results are bitwise
 * the same on all builds (tests/test_native.py runs each build this CPU can run).
 *
 * Masks stay 16-bit integers (bit i: lane i), as AVX-512 keeps them; AVX2 turns them into
 * lane masks where an operation needs one. One of V16_AVX512, V16_AVX2, V16_SCALAR is
 * defined, for the kernels' own per-build code.
 */
#ifndef SPECDEC_SIMD16_H
#define SPECDEC_SIMD16_H

#include <stdint.h>

#if defined(__AVX512F__) && !defined(SPECDEC_SCALAR)
#define V16_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SPECDEC_SCALAR)
#define V16_AVX2 1
#else
#define V16_SCALAR 1
#endif

#ifndef V16_SCALAR
#include <immintrin.h>
/* Round to the nearest integer, ties to even; a < b (ordered, quiet) as a mask. */
#define v16_round_ps(a) v16_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v16_cmplt_ps_mask(a, b) v16_cmp_ps_mask(a, b, _CMP_LT_OQ)
#endif

#ifdef V16_AVX512

typedef __m512 v16f;
typedef __mmask16 v16mask;
#define v16_setzero_ps _mm512_setzero_ps
#define v16_set1_ps _mm512_set1_ps
#define v16_loadu_ps _mm512_loadu_ps
#define v16_storeu_ps _mm512_storeu_ps
#define v16_maskz_loadu_ps _mm512_maskz_loadu_ps
#define v16_mask_storeu_ps _mm512_mask_storeu_ps
#define v16_add_ps _mm512_add_ps
#define v16_sub_ps _mm512_sub_ps
#define v16_mul_ps _mm512_mul_ps
#define v16_div_ps _mm512_div_ps
#define v16_max_ps _mm512_max_ps
#define v16_abs_ps _mm512_abs_ps
#define v16_fmadd_ps _mm512_fmadd_ps
#define v16_fnmadd_ps _mm512_fnmadd_ps
#define v16_mask_add_ps _mm512_mask_add_ps
#define v16_mask_mul_ps _mm512_mask_mul_ps
#define v16_cmp_ps_mask _mm512_cmp_ps_mask
#define v16_roundscale_ps _mm512_roundscale_ps
#define v16_scalef_ps _mm512_scalef_ps
#define v16_unpacklo_ps _mm512_unpacklo_ps
#define v16_unpackhi_ps _mm512_unpackhi_ps
#define v16_shuffle_ps _mm512_shuffle_ps
#define v16_shuffle_f32x4 _mm512_shuffle_f32x4
#define v16_reduce_add_ps _mm512_reduce_add_ps
#define v16_mask_reduce_max_ps _mm512_mask_reduce_max_ps

#elif defined(V16_AVX2) /* AVX2 + FMA + F16C */

typedef struct {
    __m256 lo, hi;
} v16f;
typedef uint16_t v16mask;

#define V16_INLINE static inline __attribute__((always_inline))
#define V16F_EACH(op, a, b) ((v16f){op((a).lo, (b).lo), op((a).hi, (b).hi)})

/* Lanes 0..7 of a 16-bit mask as an AVX2 lane mask (all ones where the bit is set). */
V16_INLINE __m256i v8_lanes(unsigned bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
V16_INLINE v16f v16_setzero_ps(void) { return (v16f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
V16_INLINE v16f v16_set1_ps(float x) { return (v16f){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
V16_INLINE v16f v16_loadu_ps(const float *p) { return (v16f){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
V16_INLINE void v16_storeu_ps(float *p, v16f v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
/* Lanes outside the mask are neither read nor written (and never fault). */
V16_INLINE v16f v16_maskz_loadu_ps(v16mask m, const float *p) {
    return (v16f){_mm256_maskload_ps(p, v8_lanes(m)), _mm256_maskload_ps(p + 8, v8_lanes(m >> 8))};
}
V16_INLINE void v16_mask_storeu_ps(float *p, v16mask m, v16f v) {
    _mm256_maskstore_ps(p, v8_lanes(m), v.lo);
    _mm256_maskstore_ps(p + 8, v8_lanes(m >> 8), v.hi);
}
V16_INLINE v16f v16_add_ps(v16f a, v16f b) { return V16F_EACH(_mm256_add_ps, a, b); }
V16_INLINE v16f v16_sub_ps(v16f a, v16f b) { return V16F_EACH(_mm256_sub_ps, a, b); }
V16_INLINE v16f v16_mul_ps(v16f a, v16f b) { return V16F_EACH(_mm256_mul_ps, a, b); }
V16_INLINE v16f v16_div_ps(v16f a, v16f b) { return V16F_EACH(_mm256_div_ps, a, b); }
V16_INLINE v16f v16_max_ps(v16f a, v16f b) { return V16F_EACH(_mm256_max_ps, a, b); }
V16_INLINE v16f v16_abs_ps(v16f a) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return (v16f){_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
V16_INLINE v16f v16_fmadd_ps(v16f a, v16f b, v16f c) {
    return (v16f){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
V16_INLINE v16f v16_fnmadd_ps(v16f a, v16f b, v16f c) {
    return (v16f){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
/* src where the mask is clear, v where it is set. */
V16_INLINE v16f v16_blend(v16f src, v16mask m, v16f v) {
    return (v16f){_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(v8_lanes(m))),
                  _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(v8_lanes(m >> 8)))};
}
V16_INLINE v16f v16_mask_add_ps(v16f src, v16mask m, v16f a, v16f b) { return v16_blend(src, m, v16_add_ps(a, b)); }
V16_INLINE v16f v16_mask_mul_ps(v16f src, v16mask m, v16f a, v16f b) { return v16_blend(src, m, v16_mul_ps(a, b)); }
#define v16_cmp_ps_mask(a, b, predicate)                                       \
    ((v16mask)(_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, predicate)) | \
               (_mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, predicate)) << 8)))
/* The scale field of the immediate (bits 7..4) is 0 wherever the kernels round. */
#define v16_roundscale_ps(a, imm) ((v16f){_mm256_round_ps((a).lo, imm), _mm256_round_ps((a).hi, imm)})
/* a * 2^n for integral n in -126..127 (exp16's range): one exact scaling and one rounding,
 * as vscalefps does. */
V16_INLINE __m256 v8_scalef(__m256 a, __m256 n) {
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(exponent));
}
V16_INLINE v16f v16_scalef_ps(v16f a, v16f n) { return V16F_EACH(v8_scalef, a, n); }
V16_INLINE v16f v16_unpacklo_ps(v16f a, v16f b) { return V16F_EACH(_mm256_unpacklo_ps, a, b); }
V16_INLINE v16f v16_unpackhi_ps(v16f a, v16f b) { return V16F_EACH(_mm256_unpackhi_ps, a, b); }
#define v16_shuffle_ps(a, b, imm) \
    ((v16f){_mm256_shuffle_ps((a).lo, (b).lo, imm), _mm256_shuffle_ps((a).hi, (b).hi, imm)})
/* 128-bit lanes: lanes 0, 1 of the result from a's lanes imm[1:0], imm[3:2], lanes 2, 3 from
 * b's lanes imm[5:4], imm[7:6]; lane j of a pair (lo, hi) is operand j of vperm2f128. */
#define v16_shuffle_f32x4(a, b, imm)                                                       \
    ((v16f){_mm256_permute2f128_ps((a).lo, (a).hi, ((imm) & 3) | ((((imm) >> 2) & 3) << 4)), \
            _mm256_permute2f128_ps((b).lo, (b).hi, (((imm) >> 4) & 3) | ((((imm) >> 6) & 3) << 4))})
/* In GCC's order for _mm512_reduce_add_ps: halves, then 128-bit halves, then pairs. */
V16_INLINE float v16_reduce_add_ps(v16f v) {
    __m256 t3 = _mm256_add_ps(v.hi, v.lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}
V16_INLINE float v16_mask_reduce_max_ps(v16mask m, v16f v) {
    v = v16_blend(v16_set1_ps(-__builtin_inff()), m, v);
    __m256 t3 = _mm256_max_ps(v.hi, v.lo);
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}
#else /* V16_SCALAR: one lane at a time */

#include <math.h>
#include <string.h>

typedef struct {
    float f[16];
} v16f;
typedef uint16_t v16mask;

#define V16_INLINE static inline __attribute__((always_inline))
#define V16_EACH(expression)                          \
    do {                                              \
        for (int i = 0; i < 16; i++) r.f[i] = (expression); \
    } while (0)

/* maxps's rule, which the reductions and the clamps keep: the second operand where either is
 * NaN or both are zero. */
V16_INLINE float v1_max(float a, float b) { return a > b ? a : b; }
V16_INLINE v16f v16_setzero_ps(void) { return (v16f){{0}}; }
V16_INLINE v16f v16_set1_ps(float x) { v16f r; V16_EACH(x); return r; }
V16_INLINE v16f v16_loadu_ps(const float *p) { v16f r; memcpy(r.f, p, sizeof r.f); return r; }
V16_INLINE void v16_storeu_ps(float *p, v16f v) { memcpy(p, v.f, sizeof v.f); }
/* Lanes outside the mask are neither read nor written. */
V16_INLINE v16f v16_maskz_loadu_ps(v16mask m, const float *p) { v16f r; V16_EACH(m >> i & 1 ? p[i] : 0.0f); return r; }
V16_INLINE void v16_mask_storeu_ps(float *p, v16mask m, v16f v) {
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) p[i] = v.f[i];
}
V16_INLINE v16f v16_add_ps(v16f a, v16f b) { v16f r; V16_EACH(a.f[i] + b.f[i]); return r; }
V16_INLINE v16f v16_sub_ps(v16f a, v16f b) { v16f r; V16_EACH(a.f[i] - b.f[i]); return r; }
V16_INLINE v16f v16_mul_ps(v16f a, v16f b) { v16f r; V16_EACH(a.f[i] * b.f[i]); return r; }
V16_INLINE v16f v16_div_ps(v16f a, v16f b) { v16f r; V16_EACH(a.f[i] / b.f[i]); return r; }
V16_INLINE v16f v16_max_ps(v16f a, v16f b) { v16f r; V16_EACH(v1_max(a.f[i], b.f[i])); return r; }
V16_INLINE v16f v16_abs_ps(v16f a) { v16f r; V16_EACH(fabsf(a.f[i])); return r; }
/* One rounding each, as the FMA instructions: -(a * b) + c is fmaf(-a, b, c). */
V16_INLINE v16f v16_fmadd_ps(v16f a, v16f b, v16f c) { v16f r; V16_EACH(fmaf(a.f[i], b.f[i], c.f[i])); return r; }
V16_INLINE v16f v16_fnmadd_ps(v16f a, v16f b, v16f c) { v16f r; V16_EACH(fmaf(-a.f[i], b.f[i], c.f[i])); return r; }
V16_INLINE v16f v16_mask_add_ps(v16f src, v16mask m, v16f a, v16f b) {
    v16f r;
    V16_EACH(m >> i & 1 ? a.f[i] + b.f[i] : src.f[i]);
    return r;
}
V16_INLINE v16f v16_mask_mul_ps(v16f src, v16mask m, v16f a, v16f b) {
    v16f r;
    V16_EACH(m >> i & 1 ? a.f[i] * b.f[i] : src.f[i]);
    return r;
}
V16_INLINE v16mask v16_cmplt_ps_mask(v16f a, v16f b) {
    v16mask m = 0;
    for (int i = 0; i < 16; i++) m |= (v16mask)((a.f[i] < b.f[i]) << i);
    return m;
}
/* nearbyintf rounds in the current mode: to nearest, ties to even, unless a caller changed it. */
V16_INLINE v16f v16_round_ps(v16f a) { v16f r; V16_EACH(nearbyintf(a.f[i])); return r; }
/* a * 2^n for integral n in -126..127 (exp16's range): as the AVX2 build, a multiply by the
 * exact power of two. */
V16_INLINE float v1_scalef(float a, float n) {
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return a * power;
}
V16_INLINE v16f v16_scalef_ps(v16f a, v16f n) { v16f r; V16_EACH(v1_scalef(a.f[i], n.f[i])); return r; }
/* Within each 128-bit lane (4 floats), as the AVX-512 instructions do. */
V16_INLINE v16f v16_unpacklo_ps(v16f a, v16f b) {
    v16f r;
    V16_EACH((i & 1 ? b : a).f[(i & ~3) + (i & 3) / 2]);
    return r;
}
V16_INLINE v16f v16_unpackhi_ps(v16f a, v16f b) {
    v16f r;
    V16_EACH((i & 1 ? b : a).f[(i & ~3) + 2 + (i & 3) / 2]);
    return r;
}
V16_INLINE v16f v16_shuffle_ps(v16f a, v16f b, int imm) {
    v16f r;
    V16_EACH(((i & 3) < 2 ? a : b).f[(i & ~3) + (imm >> 2 * (i & 3) & 3)]);
    return r;
}
/* 128-bit lanes: lanes 0, 1 of the result from a's lanes imm[1:0], imm[3:2], lanes 2, 3 from
 * b's lanes imm[5:4], imm[7:6]. */
V16_INLINE v16f v16_shuffle_f32x4(v16f a, v16f b, int imm) {
    v16f r;
    V16_EACH((i < 8 ? a : b).f[4 * (imm >> 2 * (i / 4) & 3) + (i & 3)]);
    return r;
}
/* In GCC's order for _mm512_reduce_add_ps, as the AVX2 build: halves, then 128-bit halves,
 * then pairs. */
V16_INLINE float v16_reduce_add_ps(v16f v) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = v.f[8 + i] + v.f[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}
V16_INLINE float v16_mask_reduce_max_ps(v16mask m, v16f v) {
    float t3[8], t6[4];
    for (int i = 0; i < 16; i++)
        if (!(m >> i & 1)) v.f[i] = -INFINITY;
    for (int i = 0; i < 8; i++) t3[i] = v1_max(v.f[8 + i], v.f[i]);
    for (int i = 0; i < 4; i++) t6[i] = v1_max(t3[4 + i], t3[i]);
    return v1_max(v1_max(t6[0], t6[2]), v1_max(t6[1], t6[3]));
}
#undef V16_EACH
#endif
#endif
