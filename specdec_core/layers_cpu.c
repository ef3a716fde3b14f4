/* The small per-layer operations of a decoder on the CPU, one call each (layers_cpu.py).
 *
 * Every output row depends only on its own input row, computed in a fixed order, so these
 * keep a token's numbers independent of how many tokens share a forward. Compiled with
 * -ffp-contract=off (native.py): a multiply and an add stay two roundings, as in torch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* y = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of dim values (Llama's RMSNorm). */
void rms_norm(const float *x, const float *weight, float *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        __m512 squares = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
        }
        float total = _mm512_reduce_add_ps(squares);
        for (; i < dim; i++) total += xr[i] * xr[i];
        float inverse = 1.0f / sqrtf(total / (float)dim + eps);
        for (i = 0; i < dim; i++) yr[i] = weight[i] * (xr[i] * inverse);
    }
}

/* Rotary embedding as transformers computes it, x * cos + rotate_half(x) * sin, from rows of
 * `heads` heads (row r's head h at x[r * row_stride + h * dim]) into out [heads, rows, dim],
 * the layout attention and the cache take. cos and sin are [rows, dim]. */
void rotary(const float *x, int64_t row_stride, const float *cos, const float *sin, float *out,
            int64_t rows, int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t r = 0; r < rows; r++) {
            const float *xs = x + r * row_stride + h * dim, *c = cos + r * dim, *s = sin + r * dim;
            float *o = out + (h * rows + r) * dim;
            for (int64_t i = 0; i < half; i++) o[i] = xs[i] * c[i] + (-xs[i + half]) * s[i];
            for (int64_t i = half; i < dim; i++) o[i] = xs[i] * c[i] + xs[i - half] * s[i];
        }
    }
}
