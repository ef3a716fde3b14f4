/* 4-bit weights x 8-bit activations on AVX-512 VNNI, the same numbers for any row count.
 *
 * Weights: asymmetric, one fp16 scale and one fp16 minimum per 32 inputs of each output
 * channel (w = scale * q + min, q in 0..15). Activations: symmetric int8, one scale per
 * 32 inputs of each row (a = max |x| / 127). A group's dot product is
 *
 *     a * (scale * sum(q * xq) + min * sum(xq))
 *
 * with the integer sum exact (vpdpbusd), so every (row, channel) result depends only on
 * that row and that channel: not on how many rows are multiplied together, nor on which
 * thread computes it. That is what keeps speculative decoding exact (int4_cpu.py).
 *
 * Layout, per block of 16 output channels and group of 32 inputs (BLOCK_BYTES bytes):
 * four 64-byte vectors of nibbles, byte 4c + i of vector t holding, for channel c, input
 * 8t + i in its low nibble and input 8t + 4 + i in its high nibble; then the 16
 * channels' fp16 scales and their 16 fp16 minimums.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define LANES 16
#define TILE 8 /* rows multiplied per pass over a block's weights */
/* Groups ahead to prefetch: measured on the 1.5B's layers, 1 row, 2 threads: none 51 ms,
 * 4 ahead 46, 8 ahead 40, 16 ahead 39 (24 and 32 no better). */
#define PREFETCH 16
#define BLOCK_BYTES (4 * 64 + 2 * LANES * 2)

/* One row's groups: int8 values, scale a, and a * sum(values). */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *scale, float *scaled_sum) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *xs = x + g * GROUP;
        float amax = 0.0f;
        for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(xs[i]));
        float a = amax / 127.0f;
        int sum = 0;
        for (int i = 0; i < GROUP; i++) {
            int v = a > 0.0f ? (int)nearbyintf(xs[i] / a) : 0;
            q[g * GROUP + i] = (int8_t)v;
            sum += v;
        }
        scale[g] = a;
        scaled_sum[g] = a * (float)sum;
    }
}

/* rows (at most TILE) x one block of 16 channels; always inlined with a constant `rows`. */
static inline __attribute__((always_inline)) void block_tile(
    const uint8_t *w, int64_t groups, const int8_t *q, const float *scale, const float *scaled_sum,
    int64_t k, int rows, const float *bias, float *y, int64_t n_out, int64_t col) {
    __m512 acc[TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = w + g * BLOCK_BYTES;
        for (int line = 0; line < BLOCK_BYTES; line += 64)  /* never faults, even past the end */
            _mm_prefetch((const char *)(blk + PREFETCH * BLOCK_BYTES + line), _MM_HINT_T0);
        __m512i wv[8];
        for (int t = 0; t < 4; t++) {
            __m512i packed = _mm512_loadu_si512((const void *)(blk + 64 * t));
            wv[2 * t] = _mm512_and_si512(packed, nibble);
            wv[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
        __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256 + 32)));
        __m512i dot[TILE];
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        /* Rows innermost: independent chains for the out-of-order core. */
        for (int c = 0; c < 8; c++) {
            for (int r = 0; r < rows; r++) {
                const int32_t *xq = (const int32_t *)(q + r * k + g * GROUP);
                dot[r] = _mm512_dpbusd_epi32(dot[r], wv[c], _mm512_set1_epi32(xq[c]));
            }
        }
        for (int r = 0; r < rows; r++) {
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), s);
            acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(scale[r * groups + g]), acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(scaled_sum[r * groups + g]), acc[r]);
        }
    }
    int64_t valid = n_out - col < LANES ? n_out - col : LANES;
    __mmask16 mask = (__mmask16)((1u << valid) - 1u);
    if (bias) {
        __m512 b = _mm512_maskz_loadu_ps(mask, bias + col);
        for (int r = 0; r < rows; r++) acc[r] = _mm512_add_ps(acc[r], b);
    }
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * n_out + col, mask, acc[r]);
}

static void block_rows(const uint8_t *w, int64_t groups, const int8_t *q, const float *scale,
                       const float *scaled_sum, int64_t k, int rows, const float *bias, float *y,
                       int64_t n_out, int64_t col) {
    switch (rows) {
#define CASE(n) \
    case n: block_tile(w, groups, q, scale, scaled_sum, k, n, bias, y, n_out, col); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
        default: block_tile(w, groups, q, scale, scaled_sum, k, TILE, bias, y, n_out, col); break;
#undef CASE
    }
}

/* y [rows, n_out] = x [rows, k] times the packed weights, plus bias [n_out] unless it is NULL
 * (one float add, as `y += bias` would); 0, or -1 when out of memory. */
int int4_linear(const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t rows,
                const float *bias, float *y, int threads) {
    int64_t groups = k / GROUP, blocks = (n_out + LANES - 1) / LANES;
    int8_t *q = malloc((size_t)(rows * k));
    float *scale = malloc(sizeof(float) * (size_t)(rows * groups));
    float *scaled_sum = malloc(sizeof(float) * (size_t)(rows * groups));
    if (!q || !scale || !scaled_sum) {
        free(q), free(scale), free(scaled_sum);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * k, k, q + r * k, scale + r * groups, scaled_sum + r * groups);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
                int tile_rows = rows - r0 < TILE ? (int)(rows - r0) : TILE;
                block_rows(w + b * groups * BLOCK_BYTES, groups, q + r0 * k, scale + r0 * groups,
                           scaled_sum + r0 * groups, k, tile_rows, bias, y + r0 * n_out, n_out, b * LANES);
            }
        }
    }
    free(q), free(scale), free(scaled_sum);
    return 0;
}
