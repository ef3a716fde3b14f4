/* The small per-layer operations of a decoder on the CPU, one call each (layers_cpu.py).
 *
 * Every output row depends only on its own input row, computed in a fixed order, so these
 * keep a token's numbers independent of how many tokens share a forward. Compiled with
 * -ffp-contract=off (native.py): a multiply and an add stay two roundings, as in torch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

/* The other kernels of this library (int4_cpu.c, attention_cpu.c). */
int int4_linear(const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t rows,
                const float *bias, float *y, int threads, int bits);
int causal_attention(const float *query, const float *key, const float *value, float *out,
                     int64_t rows, int64_t keys, int64_t kv_stride, int64_t heads, int64_t kv_heads,
                     int64_t dim, float scale, int64_t window, int threads);

/* y = weight * (x * (1 / sqrt(mean(x^2) + eps))) per row of dim values (Llama's RMSNorm). */
void rms_norm(const float *x, const float *weight, float *y, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        v16f squares = v16_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= dim; i += 16) {
            v16f v = v16_loadu_ps(xr + i);
            squares = v16_add_ps(squares, v16_mul_ps(v, v));
        }
        float total = v16_reduce_add_ps(squares);
        for (; i < dim; i++) total += xr[i] * xr[i];
        float inverse = 1.0f / sqrtf(total / (float)dim + eps);
        for (i = 0; i < dim; i++) yr[i] = weight[i] * (xr[i] * inverse);
    }
}

/* Rotary embedding as transformers computes it, x * cos + rotate_half(x) * sin, from rows of
 * `heads` heads (row r's head h at x[r * row_stride + h * dim]) into out: row r of head h at
 * out[h * head_stride + r * dim] ([heads, rows, dim] when head_stride is rows * dim; a cache
 * buffer's stride writes the keys straight into it). cos and sin are [rows, dim]. */
void rotary(const float *x, int64_t row_stride, const float *cos, const float *sin, float *out,
            int64_t head_stride, int64_t rows, int64_t heads, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t r = 0; r < rows; r++) {
            const float *xs = x + r * row_stride + h * dim, *c = cos + r * dim, *s = sin + r * dim;
            float *o = out + h * head_stride + r * dim;
            for (int64_t i = 0; i < half; i++) o[i] = xs[i] * c[i] + (-xs[i + half]) * s[i];
            for (int64_t i = half; i < dim; i++) o[i] = xs[i] * c[i] + xs[i - half] * s[i];
        }
    }
}

/* out [rows, n] = silu(gate) * up from gate_up [rows, 2n] (gate first), silu(g) = g / (1 + e^-g)
 * with our own e^x (simd_math.h), so every path of a layer computes the same numbers. e^x
 * is only taken of -|g|: g * e^g / (1 + e^g) for negative g, the same value without overflow. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t n, int threads) {
    const v16f one = v16_set1_ps(1.0f), zero = v16_setzero_ps();
    /* A prompt's rows split between the threads (each row's numbers are its own); a step's
     * few rows cost less than waking them. */
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n, *up = gate + n;
        for (int64_t i = 0; i < n; i += 16) {
            v16mask mask = n - i >= 16 ? (v16mask)0xFFFF : (v16mask)((1u << (n - i)) - 1u);
            v16f g = v16_maskz_loadu_ps(mask, gate + i);
            v16f e = exp16(v16_sub_ps(zero, v16_abs_ps(g)));
            v16mask negative = v16_cmplt_ps_mask(g, zero);
            v16f numerator = v16_mask_mul_ps(g, negative, g, e);
            v16f silu = v16_div_ps(numerator, v16_add_ps(one, e));
            v16_mask_storeu_ps(out + r * n + i, mask, v16_mul_ps(silu, v16_maskz_loadu_ps(mask, up + i)));
        }
    }
}

/* One of a layer's 4-bit (or 6-bit) linears, as int4_linear takes it. */
typedef struct {
    const uint8_t *packed;
    const float *bias; /* NULL: none */
    int64_t n_out, k;
    int64_t bits;
} linear_weights;

/* A decoder layer of the Llama shape whose linears are all 4/6-bit (layers_cpu.py). */
typedef struct {
    linear_weights qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float input_eps, post_eps, scaling, unused;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, window;
} layer_weights;

static int linear(const linear_weights *w, const float *x, int64_t rows, float *y, int threads) {
    return int4_linear(w->packed, w->n_out, w->k, x, rows, w->bias, y, threads, (int)w->bits);
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* The whole layer in one call, the arithmetic of FastLayer's forward step for step: x [rows,
 * hidden] (updated in place) are the tokens at positions past .. past + rows - 1. Their keys
 * and values are written into the cache buffers [kv_heads, capacity, head_dim] at those
 * positions, and attention reads positions 0 .. past + rows - 1 from them. 0, or -1 when out
 * of memory or the shapes do not fit. */
int decoder_layer(const layer_weights *w, float *x, int64_t rows, const float *cos, const float *sin,
                  float *key_cache, float *value_cache, int64_t capacity, int64_t past, int threads) {
    int64_t hidden = w->hidden, dim = w->head_dim, q_width = w->heads * dim, kv_width = w->kv_heads * dim;
    if (past + rows > capacity || w->qkv.n_out != q_width + 2 * kv_width) return -1;
    int64_t widest = w->gate_up.n_out > w->qkv.n_out ? w->gate_up.n_out : w->qkv.n_out;
    float *scratch = malloc(sizeof(float) * (size_t)(rows * (2 * hidden + widest + 2 * q_width + w->intermediate)));
    if (!scratch) return -1;
    float *normed = scratch, *projected = normed + rows * hidden, *wide = projected + rows * hidden;
    float *query = wide + rows * widest, *attended = query + rows * q_width, *act = attended + rows * q_width;
    int status = 0;
    rms_norm(x, w->input_norm, normed, rows, hidden, w->input_eps);
    status |= linear(&w->qkv, normed, rows, wide, threads);
    rotary(wide, w->qkv.n_out, cos, sin, query, rows * dim, rows, w->heads, dim);
    rotary(wide + q_width, w->qkv.n_out, cos, sin, key_cache + past * dim, capacity * dim, rows, w->kv_heads, dim);
    for (int64_t h = 0; h < w->kv_heads; h++)
        for (int64_t r = 0; r < rows; r++)
            memcpy(value_cache + (h * capacity + past + r) * dim, wide + r * w->qkv.n_out + q_width + kv_width + h * dim,
                   sizeof(float) * (size_t)dim);
    status |= causal_attention(query, key_cache, value_cache, attended, rows, past + rows, capacity * dim, w->heads,
                               w->kv_heads, dim, w->scaling, w->window, threads);
    status |= linear(&w->o, attended, rows, projected, threads);
    add_into(x, projected, rows * hidden);
    rms_norm(x, w->post_norm, normed, rows, hidden, w->post_eps);
    status |= linear(&w->gate_up, normed, rows, wide, threads);
    silu_mul(wide, act, rows, w->intermediate, threads);
    status |= linear(&w->down, act, rows, projected, threads);
    add_into(x, projected, rows * hidden);
    free(scratch);
    return status ? -1 : 0;
}

/* Every layer of a model in one call, in order, each with its own cache buffers (keys[i],
 * values[i] of capacity[i] positions, all holding `past`): exactly decoder_layer, layer
 * after layer, without a return to the caller in between. 0, or -1 as decoder_layer. */
int decoder_stack(const layer_weights *const *layers, int64_t n_layers, float *x, int64_t rows, const float *cos,
                  const float *sin, float *const *keys, float *const *values, const int64_t *capacity, int64_t past,
                  int threads) {
    for (int64_t i = 0; i < n_layers; i++)
        if (decoder_layer(layers[i], x, rows, cos, sin, keys[i], values[i], capacity[i], past, threads)) return -1;
    return 0;
}

/* Rows of x [rows, k] as oneDNN's int8 matmul takes them (draft_bulk.py): each row's scale
 * max |x| / 127 (never below 1e-12 / 127), and q = round(x / scale) + 128 as uint8, the
 * kernel's zero point. One pass instead of torch's six. */
void int8_quantize_rows(const float *x, int64_t rows, int64_t k, uint8_t *q, float *scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * k;
        v16f top = v16_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= k; i += 16) top = v16_max_ps(top, v16_abs_ps(v16_loadu_ps(xr + i)));
        float largest = v16_mask_reduce_max_ps((v16mask)0xFFFF, top);
        for (; i < k; i++) largest = fmaxf(largest, fabsf(xr[i]));
        float s = fmaxf(largest, 1e-12f) / 127.0f;
        scale[r] = s;
        uint8_t *qr = q + r * k;
        /* Adding and taking away 1.5 x 2^23 rounds |v| <= 127 to the nearest integer, ties to
         * even (as torch.round), in a loop the compiler vectorizes. */
        for (i = 0; i < k; i++) qr[i] = (uint8_t)((int)((xr[i] / s + 12582912.0f) - 12582912.0f) + 128);
    }
}

/* y [rows, n], the integer sums, scaled in place by its row's and its column's scale, plus
 * bias [n] unless it is NULL. */
void int8_scale_rows(float *y, int64_t rows, int64_t n, const float *row_scale, const float *col_scale,
                     const float *bias, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * n, s = row_scale[r];
        if (bias)
            for (int64_t c = 0; c < n; c++) yr[c] = yr[c] * s * col_scale[c] + bias[c];
        else
            for (int64_t c = 0; c < n; c++) yr[c] = yr[c] * s * col_scale[c];
    }
}
