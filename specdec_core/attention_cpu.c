/* Causal attention one query row at a time, the same numbers however many rows come together.
 *
 * Each (row, head) pair is computed start to finish by one thread, over exactly that
 * row's keys (its causal prefix, or its sliding window), in a fixed order: scores,
 * their maximum, exponentials and their sum, then the weighted sum of values. Nothing
 * depends on how many rows share the call or on the thread count, so a 9-row verify
 * and a prefill give each token the numbers a one-token step gives it
 * (attention_cpu.py). One call per layer replaces a call per row.
 *
 * Layouts (fp32): query [heads, rows, dim], key and value [kv_heads, keys, dim] with
 * kv_stride floats from one head to the next (keys * dim when contiguous, more when they
 * sit in a buffer with room to grow), out [rows, heads, dim]. Query head h reads key/value
 * head h / (heads / kv_heads).
 * dim is a multiple of 16 and at most 16 * MAX_CHUNKS.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"

#define MAX_CHUNKS 32

static inline float dot(const float *a, const float *b, int64_t chunks) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + 16 * c), _mm512_loadu_ps(b + 16 * c), acc);
    return _mm512_reduce_add_ps(acc);
}

/* One query row over n keys: out = softmax(scale * q.k) . v; `scores` holds n floats. */
static void attend_row(const float *q, const float *k, const float *v, int64_t n, int64_t dim,
                       float scale, float *scores, float *out) {
    int64_t chunks = dim / 16;
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        scores[j] = scale * dot(q, k + j * dim, chunks);
        top = fmaxf(top, scores[j]);
    }
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 mask = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + j), _mm512_set1_ps(top)));
        total = _mm512_mask_add_ps(total, mask, total, e);
        _mm512_mask_storeu_ps(scores + j, mask, e);
    }
    float inverse = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 weight = _mm512_set1_ps(scores[j]);
        for (int64_t c = 0; c < chunks; c++)
            acc[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v + j * dim + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; c++)
        _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inverse)));
}

/* Row r is the token at keys - rows + r: it sees keys up to and including that one, the last
 * `window` of them when window > 0. 0, or -1 when out of memory or the shapes do not fit. */
int causal_attention(const float *query, const float *key, const float *value, float *out,
                     int64_t rows, int64_t keys, int64_t kv_stride, int64_t heads, int64_t kv_heads,
                     int64_t dim, float scale, int64_t window, int threads) {
    if (dim % 16 || dim > 16 * MAX_CHUNKS || kv_heads <= 0 || heads % kv_heads || rows > keys ||
        kv_stride < keys * dim)
        return -1;
    int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(keys > 0 ? keys : 1));
        if (!scores) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * heads; task++) {
            if (!scores) continue;
            int64_t r = task / heads, h = task % heads, kv = h / group;
            int64_t end = keys - rows + r + 1;
            int64_t start = window > 0 && end > window ? end - window : 0;
            attend_row(query + (h * rows + r) * dim, key + kv * kv_stride + start * dim,
                       value + kv * kv_stride + start * dim, end - start, dim, scale, scores,
                       out + (r * heads + h) * dim);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
