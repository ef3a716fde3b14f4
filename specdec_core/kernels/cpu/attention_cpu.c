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

/* Pairs computed together, and keys (or value chunks) per step: RUN x STEP accumulators and
 * STEP vectors of keys (or values) in registers, so each load serves RUN pairs. AVX2 has
 * half the registers, each vector a pair of them: 2 x 2 there, since 4 x 4 spills registers
 * and is slower than unblocked pairs (docs/performance.md#measurements-behind-the-design);
 * plain C the same. */
#ifdef V16_AVX512
#define RUN 4
#define STEP 4
#else
#define RUN 2
#define STEP 2
#endif

/* The q.k vectors of `run` pairs (their queries q[0..run-1]) with keys i0 .. i0 + STEP - 1 of a
 * block (k: the block's first key), before their lanes are summed: dot[16 p + i], one chain of
 * FMAs over the chunks each, in order. Keys past `count` are neither read nor kept: their
 * vectors are zero. Inlined with a constant `run`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_keys(const float *const *q, int run, const float *k,
                                                           int64_t i0, int64_t count, int64_t dim, v16f *dot) {
    const float *key[STEP];
    for (int i = 0; i < STEP; i++) key[i] = k + (i0 + i < count ? i0 + i : count - 1) * dim; /* in bounds */
    v16f acc[RUN][STEP];
    for (int p = 0; p < run; p++)
        for (int i = 0; i < STEP; i++) acc[p][i] = v16_setzero_ps();
    for (int64_t c = 0; c < dim / 16; c++) {
        v16f kv[STEP];
        for (int i = 0; i < STEP; i++) kv[i] = v16_loadu_ps(key[i] + 16 * c);
        for (int p = 0; p < run; p++) {
            v16f qv = v16_loadu_ps(q[p] + 16 * c);
            for (int i = 0; i < STEP; i++) acc[p][i] = v16_fmadd_ps(qv, kv[i], acc[p][i]);
        }
    }
    for (int p = 0; p < run; p++)
        for (int i = 0; i < STEP; i++) dot[16 * p + i0 + i] = i0 + i < count ? acc[p][i] : v16_setzero_ps();
}

/* scale * q.k for keys k[0 .. count - 1] (count <= 16) of `run` pairs into scores[p * stride ..];
 * each pair's maximum into top[p] (as fmaxf(top, block maximum)). One lane reduction for 16
 * keys instead of one per key, since per-key reductions dominate a long prompt's attention
 * (docs/engine.md#fewer-bigger-calls-on-the-cpu-nativepy-attention_cpuc-layers_cpuc-kv_inplacepy). */
static void score_block(const float *const *q, int run, const float *k, int64_t count, int64_t dim, float scale,
                        float *scores, int64_t stride, float *top) {
    v16f dot[16 * RUN];
    for (int64_t i0 = 0; i0 < 16; i0 += STEP) {
        if (i0 >= count) {
            for (int p = 0; p < run; p++)
                for (int i = 0; i < STEP; i++) dot[16 * p + i0 + i] = v16_setzero_ps();
            continue;
        }
        switch (run) {
            case 1: dot_keys(q, 1, k, i0, count, dim, dot); break;
#if RUN == 4
            case 2: dot_keys(q, 2, k, i0, count, dim, dot); break;
            case 3: dot_keys(q, 3, k, i0, count, dim, dot); break;
#endif
            default: dot_keys(q, RUN, k, i0, count, dim, dot);
        }
    }
    v16mask mask = count >= 16 ? (v16mask)0xFFFF : (v16mask)((1u << count) - 1u);
    for (int p = 0; p < run; p++) {
        v16f scored = v16_mul_ps(v16_set1_ps(scale), lane_sums16(dot + 16 * p));
        v16_mask_storeu_ps(scores + p * stride, mask, scored);
        top[p] = fmaxf(top[p], v16_mask_reduce_max_ps(mask, scored));
    }
}

/* acc[p] += w[p][j] * v[j] for keys j0 .. end - 1, in that order, for `run` pairs (their
 * weights at w[p * stride]) and chunks c0 .. c0 + STEP - 1 of the head (a chunk past the last
 * is the last again: computed twice, the same numbers, stored twice). */
static inline __attribute__((always_inline)) void add_values(const float *v, int64_t j0, int64_t end, int64_t dim,
                                                             const float *w, int64_t stride, int run, float *acc,
                                                             int64_t c0) {
    int64_t chunks = dim / 16, chunk[STEP];
    for (int i = 0; i < STEP; i++) chunk[i] = c0 + i < chunks ? c0 + i : chunks - 1;
    v16f sum[RUN][STEP];
    for (int p = 0; p < run; p++)
        for (int i = 0; i < STEP; i++) sum[p][i] = v16_loadu_ps(acc + p * dim + 16 * chunk[i]);
    for (int64_t j = j0; j < end; j++) {
        v16f vv[STEP];
        for (int i = 0; i < STEP; i++) vv[i] = v16_loadu_ps(v + j * dim + 16 * chunk[i]);
        for (int p = 0; p < run; p++) {
            v16f weight = v16_set1_ps(w[p * stride + j]);
            for (int i = 0; i < STEP; i++) sum[p][i] = v16_fmadd_ps(weight, vv[i], sum[p][i]);
        }
    }
    for (int p = 0; p < run; p++)
        for (int i = 0; i < STEP; i++) v16_storeu_ps(acc + p * dim + 16 * chunk[i], sum[p][i]);
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

/* The pairs from `first` on that see as many keys as it does, at most RUN (a row's heads). */
static int64_t run_length(const pair *pairs, int64_t first, int64_t count) {
    int64_t m = 1;
    while (m < RUN && first + m < count && pairs[first + m].n == pairs[first].n) m++;
    return m;
}

/* out = softmax(scale * q.k) . v for each of `count` pairs, each pair's numbers exactly those
 * of the pair alone: its scores 16 keys at a time from its first key, their maximum, the
 * exponentials and their sum, then the weighted values key by key, in that order. The pairs
 * only share loads: each block of keys and values is read from memory once for all of
 * them, and each vector loaded into a register serves the pairs of a run (a row's heads).
 * `scores` holds count * stride floats (stride >= every n), `acc` count * dim, `top` count. */
static void attend_pairs(const pair *pairs, int64_t count, const float *k, const float *v, int64_t dim,
                         float scale, float *scores, int64_t stride, float *acc, float *top) {
    int64_t chunks = dim / 16, longest = 0;
    const float *q[RUN];
    for (int64_t p = 0; p < count; p++) {
        top[p] = -INFINITY;
        if (pairs[p].n > longest) longest = pairs[p].n;
    }
    for (int64_t j = 0; j < longest; j += 16)
        for (int64_t p = 0, m; p < count; p += m) {
            m = run_length(pairs, p, count);
            int64_t n = pairs[p].n;
            if (j >= n) continue;
            for (int64_t i = 0; i < m; i++) q[i] = pairs[p + i].q;
            score_block(q, (int)m, k + j * dim, n - j < 16 ? n - j : 16, dim, scale, scores + p * stride + j,
                        stride, top + p);
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
        for (int64_t p = 0, m; p < count; p += m) {
            m = run_length(pairs, p, count);
            int64_t end = pairs[p].n < j0 + VALUE_BLOCK ? pairs[p].n : j0 + VALUE_BLOCK;
            if (j0 >= end) continue;
            const float *w = scores + p * stride;
            float *a = acc + p * dim;
            for (int64_t c0 = 0; c0 < chunks; c0 += STEP) switch (m) {
                    case 1: add_values(v, j0, end, dim, w, stride, 1, a, c0); break;
#if RUN == 4
                    case 2: add_values(v, j0, end, dim, w, stride, 2, a, c0); break;
                    case 3: add_values(v, j0, end, dim, w, stride, 3, a, c0); break;
#endif
                    default: add_values(v, j0, end, dim, w, stride, RUN, a, c0);
                }
        }
    for (int64_t p = 0; p < count; p++)
        for (int64_t c = 0; c < chunks; c++)
            v16_storeu_ps(pairs[p].out + 16 * c,
                          v16_mul_ps(v16_loadu_ps(acc + p * dim + 16 * c), v16_set1_ps(top[p])));
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
        float *scores = malloc(sizeof(float) * (size_t)(most * keys)); /* keys >= rows >= 1 */
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
            int64_t h0 = kv * group + task % slices * slice, last = (kv + 1) * group;
            int64_t h1 = h0 + slice < last ? h0 + slice : last;
            int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows, first = 0, count = 0;
            for (int64_t r = r0; r < r1; r++) {
                int64_t end = keys - rows + r + 1;
                first = window > 0 && end > window ? end - window : 0;
                for (int64_t h = h0; h < h1; h++)
                    pairs[count++] =
                        (pair){query + (h * rows + r) * dim, out + (r * heads + h) * dim, end - first};
            }
            attend_pairs(pairs, count, key + kv * kv_stride + first * dim, value + kv * kv_stride + first * dim,
                         dim, scale, scores, keys, acc, top);
        }
        free(scores), free(acc), free(top), free(pairs);
    }
    return failed ? -1 : 0;
}
