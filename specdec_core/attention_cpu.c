/* Causal attention one query row at a time, the same numbers however many rows come together.
 *
 * Each (row, head) pair is computed start to finish by one thread, over exactly that
 * row's keys (its causal prefix, or its sliding window), in a fixed order: scores,
 * their maximum, exponentials and their sum, then the weighted sum of values. Nothing
 * depends on how many rows share the call or on the thread count, so a 9-row verify
 * and a prefill give each token the numbers a one-token step gives it
 * (attention_cpu.py). One call per layer replaces a call per row. The pairs that read
 * the same key/value head (a group's query heads, and rows with the same first key) are
 * computed side by side, so that each block of keys and values is read from memory once
 * for all of them; each pair's arithmetic stays its own, in the same order.
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

/* (query row, head) pairs that read the same key/value head from the same first key: each
 * pair's query, its output and how many keys it sees (n, from k and v). */
typedef struct {
    const float *q;
    float *out;
    int64_t n;
} pair;

/* Keys per block of the weighted sum: a block of values (16 KB at 128 floats a key) stays in
 * L1 while every pair adds it in. */
#define VALUE_BLOCK 32

/* out = softmax(scale * q.k) . v for each of `count` pairs, each pair's numbers exactly those
 * of the pair alone: its scores 16 keys at a time from its first key, their maximum, the
 * exponentials and their sum, then the weighted values key by key, in that order. The pairs
 * only share each block of keys and values while it is in the cache: a decode step's query
 * heads read their key/value head's cache once instead of once each, and a verify's rows
 * too (at 2,000 keys the 1.5B's attention took 13 ms a token, 42 for a 5-row verify).
 * `scores` holds count * stride floats (stride >= every n), `acc` count * dim. */
static void attend_pairs(const pair *pairs, int64_t count, const float *k, const float *v, int64_t dim,
                         float scale, float *scores, int64_t stride, float *acc, float *top) {
    int64_t chunks = dim / 16, longest = 0;
    for (int64_t p = 0; p < count; p++) {
        top[p] = -INFINITY;
        if (pairs[p].n > longest) longest = pairs[p].n;
    }
    for (int64_t j = 0; j < longest; j += 16)
        for (int64_t p = 0; p < count; p++) {
            int64_t n = pairs[p].n;
            if (j >= n) continue;
            float block_top = score_block(pairs[p].q, k + j * dim, n - j < 16 ? n - j : 16, dim, scale,
                                          scores + p * stride + j);
            top[p] = fmaxf(top[p], block_top);
        }
    for (int64_t p = 0; p < count; p++) {
        int64_t n = pairs[p].n;
        float *row = scores + p * stride;
        v16f total = v16_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            v16mask mask = n - j >= 16 ? (v16mask)0xFFFF : (v16mask)((1u << (n - j)) - 1u);
            v16f e = exp16(v16_sub_ps(v16_maskz_loadu_ps(mask, row + j), v16_set1_ps(top[p])));
            total = v16_mask_add_ps(total, mask, total, e);
            v16_mask_storeu_ps(row + j, mask, e);
        }
        top[p] = 1.0f / v16_reduce_add_ps(total); /* from here: the inverse of the sum */
        for (int64_t c = 0; c < chunks; c++) v16_storeu_ps(acc + p * dim + 16 * c, v16_setzero_ps());
    }
    for (int64_t j0 = 0; j0 < longest; j0 += VALUE_BLOCK)
        for (int64_t p = 0; p < count; p++) {
            int64_t end = pairs[p].n < j0 + VALUE_BLOCK ? pairs[p].n : j0 + VALUE_BLOCK;
            if (j0 >= end) continue;
            const float *row = scores + p * stride;
            v16f sum[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) sum[c] = v16_loadu_ps(acc + p * dim + 16 * c);
            for (int64_t j = j0; j < end; j++) {
                v16f weight = v16_set1_ps(row[j]);
                for (int64_t c = 0; c < chunks; c++)
                    sum[c] = v16_fmadd_ps(weight, v16_loadu_ps(v + j * dim + 16 * c), sum[c]);
            }
            for (int64_t c = 0; c < chunks; c++) v16_storeu_ps(acc + p * dim + 16 * c, sum[c]);
        }
    for (int64_t p = 0; p < count; p++)
        for (int64_t c = 0; c < chunks; c++)
            v16_storeu_ps(pairs[p].out + 16 * c, v16_mul_ps(v16_loadu_ps(acc + p * dim + 16 * c), v16_set1_ps(top[p])));
}

/* Rows taken together per task where they share their first key (no window): a verify's
 * rows, or a prefill's in blocks, read each block of keys once for all of them. */
#define ROW_BLOCK 8

/* Row r is the token at keys - rows + r: it sees keys up to and including that one, the last
 * `window` of them when window > 0. A task is one key/value head's query heads (or a slice of
 * them, so that every thread has work) for a block of rows; which thread takes a task does
 * not change its numbers. 0, or -1 when out of memory or the shapes do not fit. */
int causal_attention(const float *query, const float *key, const float *value, float *out,
                     int64_t rows, int64_t keys, int64_t kv_stride, int64_t heads, int64_t kv_heads,
                     int64_t dim, float scale, int64_t window, int threads) {
    if (dim % 16 || dim > 16 * MAX_CHUNKS || kv_heads <= 0 || heads % kv_heads || rows > keys ||
        kv_stride < keys * dim)
        return -1;
    if (rows == 0) return 0;
    int64_t group = heads / kv_heads;
    /* With a window each row starts at its own key, and its blocks of 16 from there. */
    int64_t row_block = window > 0 ? 1 : ROW_BLOCK, row_blocks = (rows + row_block - 1) / row_block;
    int64_t slices = (threads + kv_heads * row_blocks - 1) / (kv_heads * row_blocks);
    if (slices > group) slices = group;
    int64_t slice = (group + slices - 1) / slices;
    slices = (group + slice - 1) / slice; /* none left empty */
    int64_t most = row_block * slice, tasks = row_blocks * kv_heads * slices;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(most * (keys > 0 ? keys : 1)));
        float *acc = malloc(sizeof(float) * (size_t)(most * dim));
        float *top = malloc(sizeof(float) * (size_t)most);
        pair *pairs = malloc(sizeof(pair) * (size_t)most);
        if (!scores || !acc || !top || !pairs) failed = 1;
        /* Round-robin, not halves: a causal prefill's later rows see more keys, and in halves
         * the second thread got three quarters of the work. */
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (failed) continue;
            int64_t r0 = task / (kv_heads * slices) * row_block, kv = task / slices % kv_heads;
            int64_t h0 = kv * group + task % slices * slice, h1 = h0 + slice < (kv + 1) * group ? h0 + slice : (kv + 1) * group;
            int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows, first = 0, count = 0;
            for (int64_t r = r0; r < r1; r++) {
                int64_t end = keys - rows + r + 1;
                first = window > 0 && end > window ? end - window : 0;
                for (int64_t h = h0; h < h1; h++)
                    pairs[count++] = (pair){query + (h * rows + r) * dim, out + (r * heads + h) * dim, end - first};
            }
            attend_pairs(pairs, count, key + kv * kv_stride + first * dim, value + kv * kv_stride + first * dim, dim,
                         scale, scores, keys > 0 ? keys : 1, acc, top);
        }
        free(scores), free(acc), free(top), free(pairs);
    }
    return failed ? -1 : 0;
}
