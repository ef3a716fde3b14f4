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
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"

#define MAX_CHUNKS 32

/* The 16 lanes of each of v[0..15] summed: lane i of the result is v[i]'s total. Every
 * vector's lanes are added in the same order, ((e0 + e2) + (e1 + e3)) within each 128-bit
 * lane and then ((L0 + L2) + (L1 + L3)) across them, whichever slot it sits in: a key's
 * score does not depend on the keys scored beside it. */
static inline v16f lane_sums16(const v16f v[16]) {
    v16f a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = v16_add_ps(v16_unpacklo_ps(v[2 * i], v[2 * i + 1]), v16_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = v16_add_ps(v16_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             v16_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    v16f s01 = v16_add_ps(v16_shuffle_f32x4(b[0], b[1], 0x44), v16_shuffle_f32x4(b[0], b[1], 0xEE));
    v16f s23 = v16_add_ps(v16_shuffle_f32x4(b[2], b[3], 0x44), v16_shuffle_f32x4(b[2], b[3], 0xEE));
    return v16_add_ps(v16_shuffle_f32x4(s01, s23, 0x88), v16_shuffle_f32x4(s01, s23, 0xDD));
}

/* scale * q.k for keys k[0 .. count - 1] (count <= 16) into scores; returns their maximum.
 * One reduction for 16 keys instead of one per key: a long prompt's prefill spent ~40%
 * of its time in attention, most of it in per-key reductions. */
static inline float score_block(const float *q, const float *k, int64_t count, int64_t dim, float scale,
                                float *scores) {
    int64_t chunks = dim / 16;
    v16f acc[16];
    for (int64_t j = 0; j < 16; j++) {
        acc[j] = v16_setzero_ps();
        if (j >= count) continue;
        for (int64_t c = 0; c < chunks; c++)
            acc[j] = v16_fmadd_ps(v16_loadu_ps(q + 16 * c), v16_loadu_ps(k + j * dim + 16 * c), acc[j]);
    }
    v16mask mask = count >= 16 ? (v16mask)0xFFFF : (v16mask)((1u << count) - 1u);
    v16f scored = v16_mul_ps(v16_set1_ps(scale), lane_sums16(acc));
    v16_mask_storeu_ps(scores, mask, scored);
    return v16_mask_reduce_max_ps(mask, scored);
}

/* One query row over n keys: out = softmax(scale * q.k) . v; `scores` holds n floats. */
static void attend_row(const float *q, const float *k, const float *v, int64_t n, int64_t dim,
                       float scale, float *scores, float *out) {
    int64_t chunks = dim / 16;
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j += 16) {
        int64_t count = n - j < 16 ? n - j : 16;
        top = fmaxf(top, score_block(q, k + j * dim, count, dim, scale, scores + j));
    }
    v16f total = v16_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        v16mask mask = n - j >= 16 ? (v16mask)0xFFFF : (v16mask)((1u << (n - j)) - 1u);
        v16f e = exp16(v16_sub_ps(v16_maskz_loadu_ps(mask, scores + j), v16_set1_ps(top)));
        total = v16_mask_add_ps(total, mask, total, e);
        v16_mask_storeu_ps(scores + j, mask, e);
    }
    float inverse = 1.0f / v16_reduce_add_ps(total);
    v16f acc[MAX_CHUNKS];
    for (int64_t c = 0; c < chunks; c++) acc[c] = v16_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        v16f weight = v16_set1_ps(scores[j]);
        for (int64_t c = 0; c < chunks; c++)
            acc[c] = v16_fmadd_ps(weight, v16_loadu_ps(v + j * dim + 16 * c), acc[c]);
    }
    for (int64_t c = 0; c < chunks; c++)
        v16_storeu_ps(out + 16 * c, v16_mul_ps(acc[c], v16_set1_ps(inverse)));
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
        /* Round-robin, not halves: a causal prefill's later rows see more keys, and in halves
         * the second thread got three quarters of the work. Which thread computes a pair does
         * not change its numbers. */
#pragma omp for schedule(static, 1)
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
