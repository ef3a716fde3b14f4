/* 4-bit (or 6-bit) weights x 8-bit activations on AVX-512 VNNI, AVX2 or plain C, the same
 * numbers for any row count and on each.
 *
 * Weights: asymmetric, one fp16 scale and one fp16 minimum per 32 inputs of each output
 * channel (w = scale * q + min, q in 0..15, or 0..63 at 6 bits). Activations: symmetric
 * int8, one scale per 32 inputs of each row (a = max |x| / 127). A group's dot product is
 *
 *     a * (scale * sum(q * xq) + min * sum(xq))
 *
 * with the integer sum exact (vpdpbusd, vpmaddubsw and vpmaddwd on AVX2, or int32 in C), so every (row, channel) result depends only on
 * that row and that channel: not on how many rows are multiplied together, nor on which
 * thread computes it. That is what keeps speculative decoding exact (int4_cpu.py).
 *
 * Layout, per block of 16 output channels and group of 32 inputs (BLOCK_BYTES bytes):
 * four 64-byte vectors of nibbles, byte 4c + i of vector t holding, for channel c, input
 * 8t + i in its low nibble and input 8t + 4 + i in its high nibble (the low 4 bits of q);
 * at 6 bits, two 64-byte vectors of the top 2 bits (unpack_group); then the 16
 * channels' fp16 scales and their 16 fp16 minimums.
 *
 * GGUF's Q4_K and Q6_K run here too, their values unchanged (gguf_cpu.c's gguf_repack moves
 * them into layouts K4 and K6). Their scales are d * sc, an fp16 d per channel and 256 inputs
 * times a small integer sc, which fp16 cannot hold but fp32 holds exactly: so each 8 groups
 * (256 inputs) of a block start with a head of the 16 channels' fp16 d and, for K4, their
 * fp16 -dmin (64 bytes); each group then has the same q bytes as above and 2 x 16 integer
 * bytes in place of the fp16 scales, and the kernel forms d * sc in fp32, exactly the
 * dequantization's own products. K4 (Q4_K): bytes sc (0..63), then m (0..63); w = (d * sc) *
 * q + (-dmin * m). K6 (Q6_K): int8 sc of inputs 0..15, then of 16..31; w = (d * sc) * (q - 32);
 * its group's product is
 *
 *     a * (s0 * (sum0(q * xq) - 32 * sum0(xq)) + s1 * (sum1(q * xq) - 32 * sum1(xq)))
 *
 * over the group's halves, the integer sums exact in float (below 2^24).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helper_cpu.h"
#include "simd16.h"

#define GROUP 32
#define LANES 16
/* Rows multiplied per pass over a block's weights: as many as the registers hold. */
#ifdef V16_SCALAR
#define TILE 4
#else
#define TILE 8
#endif
/* Groups ahead to prefetch: far enough that a group's lines arrive before it is read, near
 * enough that they are not evicted first. With the weights in 2 MB pages (huge_pages.py) the
 * prefetchers run further ahead on their own, and 16 groups evicts lines before they are read;
 * 8 suits both kinds of page (docs/performance.md#measurements-behind-the-design). */
#define PREFETCH 8
/* A pass with fewer rows than a tile streams its weights once and waits on memory. On an
 * Intel core, prefetches into L1 hold its few line fill buffers; into L2 (T1) more reads
 * are in flight, so a decoding pass prefetches into L2, 12 groups ahead. Full tiles (a
 * prompt's read, compute-bound) keep T0. native.py sets SPECDEC_INTEL_PREFETCH on Intel
 * CPUs; other CPUs and the AVX2 build (bound by its instructions, not memory) keep T0
 * (docs/engine.md#the-weights-in-2-mb-pages-huge_pagespy). */
#ifdef SPECDEC_INTEL_PREFETCH
#define STREAM_HINT _MM_HINT_T1
#define STREAM_AHEAD 12
#else
#define STREAM_HINT _MM_HINT_T0
#define STREAM_AHEAD PREFETCH
#endif
#define SCALE_BYTES (2 * LANES * 2)
/* |w| below half of fp16's largest value (65504), so a group's scale and minimum fit in fp16. */
#define FITS_LIMIT 32752.0f
/* `bits` names a layout: 4 or 6 (fp16 scales), or K4 and K6 (fp32 scales, above). The kernels
 * are inlined for each, so a layout's tests on `bits` are resolved when compiled. */
#define K_SCALES 0x10
#define K4 (4 | K_SCALES)
#define K6 (6 | K_SCALES)
#define QBITS(bits) ((bits) & 0x0F)
#define Q_BYTES(bits) (4 * 64 + (QBITS(bits) == 6 ? 2 * 64 : 0))
#define SCALES_AT(bits) (((bits) & K_SCALES) ? 2 * LANES : SCALE_BYTES)
#define BLOCK_BYTES(bits) (Q_BYTES(bits) + SCALES_AT(bits)) /* one group's */
#define K_HEAD 64 /* a K layout's fp16 d (and -dmin) of 16 channels, before each 8 groups */
#define K_GROUPS 8
/* Group g of a block of `bits`'s layout, and the bytes of a block of `groups` groups. */
#define GROUP_AT(w, g, bits)                                                                        \
    (((bits) & K_SCALES) ? (w) + (g) / K_GROUPS * (K_HEAD + K_GROUPS * BLOCK_BYTES(bits)) + K_HEAD + \
                               (g) % K_GROUPS * BLOCK_BYTES(bits)                                   \
                         : (w) + (g) * BLOCK_BYTES(bits))
#define BLOCK_STRIDE(bits, groups) \
    (((bits) & K_SCALES) ? (groups) / K_GROUPS * (K_HEAD + K_GROUPS * BLOCK_BYTES(bits)) : (groups) * BLOCK_BYTES(bits))

/* One row's groups: int8 values, scale a, and a * sum(values). The same numbers as
 *     a = max |x| / 127 (NaNs left out, as fmaxf does), v = (int)nearbyintf(x / a)
 * computed one value at a time; in vectors, since with one row it runs on one thread while
 * the other waits (docs/engine.md#the-cpu-4-bit-path-int4_cpupy-int4_cpuc). Unless
 * `half_sum` is NULL, also each group's sums of values 0..15 and 16..31 (K6's), as floats. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *scale, float *scaled_sum, float *half_sum) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *xs = x + g * GROUP;
        v16f lo = v16_loadu_ps(xs), hi = v16_loadu_ps(xs + 16);
        /* vmaxps gives its second operand where either is NaN: a NaN never becomes the max. */
        v16f m = v16_max_ps(v16_abs_ps(hi), v16_max_ps(v16_abs_ps(lo), v16_setzero_ps()));
        float a = v16_mask_reduce_max_ps((v16mask)0xFFFF, m) / 127.0f;
        float steps[GROUP];
        v16_storeu_ps(steps, v16_round_ps(v16_div_ps(lo, v16_set1_ps(a))));
        v16_storeu_ps(steps + 16, v16_round_ps(v16_div_ps(hi, v16_set1_ps(a))));
        int sum = 0, first = 0;
        for (int i = 0; i < GROUP; i++) {
            int v = a > 0.0f ? (int)steps[i] : 0;
            q[g * GROUP + i] = (int8_t)v;
            sum += v;
            if (i == GROUP / 2 - 1) first = sum;
        }
        scale[g] = a;
        scaled_sum[g] = a * (float)sum;
        if (half_sum) half_sum[2 * g] = (float)first, half_sum[2 * g + 1] = (float)(sum - first);
    }
}

/* A group's q values for its 16 channels: q[c][j] for input j, unpack_group's values in
 * the inputs' order (vector m holds inputs 4m .. 4m + 3). In int16, as the activations:
 * loops of int16 products summed in int32 are what compilers vectorize. */
static void unpack_values(const uint8_t *blk, int bits, int16_t q[LANES][GROUP]) {
    for (int t = 0; t < 4; t++)
        for (int c = 0; c < LANES; c++)
            for (int i = 0; i < 4; i++) {
                uint8_t byte = blk[64 * t + 4 * c + i];
                q[c][8 * t + i] = byte & 0x0F;
                q[c][8 * t + 4 + i] = byte >> 4;
            }
    if (bits != 6) return;
    for (int m = 0; m < 8; m++)
        for (int c = 0; c < LANES; c++)
            for (int i = 0; i < 4; i++)
                q[c][4 * m + i] |= (int16_t)(((blk[256 + 64 * (m / 4) + 4 * c + i] >> (2 * (m % 4))) & 3) << 4);
}

static float from_half(uint16_t half);

/* The fp16 value at `p`. */
static float half_at(const uint8_t *p) {
    uint16_t half;
    memcpy(&half, p, sizeof half);
    return from_half(half);
}

/* Group g's 2 x 16 scales as floats (scales, then minimums; at K6 the second half's scales):
 * fp16, or a K layout's d (or -dmin) from its head times the group's integers, in fp32. */
static void block_scales(const uint8_t *w, int64_t g, int bits, float s[2 * LANES]) {
    const uint8_t *blk = GROUP_AT(w, g, bits), *scales = blk + Q_BYTES(bits);
    if (!(bits & K_SCALES)) {
        for (int c = 0; c < 2 * LANES; c++) s[c] = half_at(scales + 2 * c);
        return;
    }
    const uint8_t *head = GROUP_AT(w, g - g % K_GROUPS, bits) - K_HEAD;
    for (int c = 0; c < LANES; c++) {
        int first = bits == K6 ? (int8_t)scales[c] : scales[c];
        int second = bits == K6 ? (int8_t)scales[LANES + c] : scales[LANES + c];
        s[c] = half_at(head + 2 * c) * (float)first;
        s[LANES + c] = half_at(head + (bits == K6 ? 0 : 32) + 2 * c) * (float)second;
    }
}

#ifdef V16_AVX512
/* acc + the bytes of w times x broadcast to every lane (vpdpbusd). GCC 12 loads the broadcast
 * into a register first (vpbroadcastd), one more instruction per product; the memory form
 * {1to16} folds it into the vpdpbusd's own load. */
static inline __attribute__((always_inline)) __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* The 8 weight vectors of a group: bytes 0..15 (4 bits) or 0..63 (6 bits) for vpdpbusd.
 * With `high_times_16` (4 bits only) the odd vectors keep their nibble where it lies, as
 * 16 x 0..15: one instruction less each, and their products' sum is 16 times the true one. */
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *blk, int bits, int high_times_16,
                                                               __m512i wv[8]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
    for (int t = 0; t < 4; t++) {
        __m512i packed = _mm512_loadu_si512((const void *)(blk + 64 * t));
        wv[2 * t] = _mm512_and_si512(packed, nibble);
        wv[2 * t + 1] = high_times_16 ? _mm512_and_si512(packed, high)
                                      : _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    }
    if (bits != 6) return;
    /* Two more vectors hold the top 2 bits: bits 2j..2j+1 of vector h belong to wv[4h + j].
     * 16-bit shifts move bits across bytes only into positions the 0x30 mask clears. */
    const __m512i top = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        __m512i high = _mm512_loadu_si512((const void *)(blk + 256 + 64 * h));
        wv[4 * h] = _mm512_or_si512(wv[4 * h], _mm512_and_si512(_mm512_slli_epi16(high, 4), top));
        wv[4 * h + 1] = _mm512_or_si512(wv[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(high, 2), top));
        wv[4 * h + 2] = _mm512_or_si512(wv[4 * h + 2], _mm512_and_si512(high, top));
        wv[4 * h + 3] = _mm512_or_si512(wv[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(high, 2), top));
    }
}

/* K6's group for `rows` rows: each half (vectors 0..3, then 4..7) on its own, so that a tile of
 * rows keeps one half's sums and the first half's products in registers, not both halves' sums.
 * `q`, `half_sum` and `scale` point at the group's first row; rows lie k, 2 * groups and groups
 * apart in them. */
static inline __attribute__((always_inline)) void k6_group(const __m512i wv[8], __m512 s0, __m512 s1,
                                                           const int8_t *q, int64_t k, const float *half_sum,
                                                           const float *scale, int64_t groups, int rows,
                                                           __m512 acc[TILE]) {
    const int chains = rows <= 3 ? 2 : 1;
    __m512 first[TILE];
    for (int r = 0; r < rows; r++) first[r] = _mm512_setzero_ps(); /* set below: for the compiler */
    for (int h = 0; h < 2; h++) {
        __m512i dot[TILE * 2];
        for (int i = 0; i < rows * chains; i++) dot[i] = _mm512_setzero_si512();
        for (int c = 4 * h; c < 4 * h + 4; c++)
            for (int r = 0; r < rows; r++) {
                __m512i *d = &dot[r * chains + c % chains];
                *d = dpbusd_broadcast(*d, wv[c], &((const int32_t *)(q + r * k))[c]);
            }
        for (int r = 0; r < rows; r++) {
            __m512i sum = chains == 2 ? _mm512_add_epi32(dot[2 * r], dot[2 * r + 1]) : dot[r];
            float xs = 32.0f * half_sum[2 * r * groups + h];
            __m512 part = _mm512_sub_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs));
            if (h == 0) {
                first[r] = _mm512_mul_ps(part, s0);
            } else {
                __m512 f = _mm512_fmadd_ps(part, s1, first[r]);
                acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(scale[r * groups]), acc[r]);
            }
        }
    }
}

/* rows (at most TILE) x one block of 16 channels; always inlined with constant `rows`, `bits`. */
static inline __attribute__((always_inline)) void block_tile(
    const uint8_t *w, int64_t groups, const int8_t *q, const float *scale, const float *scaled_sum,
    const float *half_sum, int64_t k, int rows, int bits, const float *bias, float *y, int64_t n_out, int64_t col) {
    __m512 acc[TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const int64_t block_bytes = BLOCK_BYTES(bits);
    __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps(); /* a K layout's, for 8 groups */
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = GROUP_AT(w, g, bits);
        for (int line = 0; line < block_bytes; line += 64) { /* never faults, even past the end */
            if (rows < TILE) /* constant: block_tile is inlined for each row count */
                _mm_prefetch((const char *)(blk + STREAM_AHEAD * block_bytes + line), STREAM_HINT);
            else
                _mm_prefetch((const char *)(blk + PREFETCH * block_bytes + line), _MM_HINT_T0);
        }
        /* One row is bound by instructions, not by dot products: there the high nibbles
         * stay in place, summed apart (chains 1 and 3 take the odd vectors) and divided by
         * 16 at the end, exactly (a sum of multiples of 16; at most 16 x 15 x 127 x 16). */
        const int high_times_16 = rows == 1 && QBITS(bits) == 4;
        __m512i wv[8];
        unpack_group(blk, QBITS(bits), high_times_16, wv);
        const uint8_t *scales = blk + Q_BYTES(bits);
        __m512 s, mn; /* at K6, mn is the second half's scale */
        if (bits & K_SCALES) {
            if (g % K_GROUPS == 0) {
                const uint8_t *head = blk - K_HEAD;
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)head));
                dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + 32)));
            }
            __m128i first = _mm_loadu_si128((const __m128i *)scales), second = _mm_loadu_si128((const __m128i *)(scales + 16));
            if (bits == K6) {
                s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)));
                mn = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)));
            } else {
                s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)));
                mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)));
            }
        } else {
            s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
        }
        if (bits == K6) {
            k6_group(wv, s, mn, q + g * GROUP, k, half_sum + 2 * g, scale + g, groups, rows, acc);
            continue;
        }
        /* Rows innermost: independent chains for the out-of-order core. With few rows one
         * chain of 8 dependent vpdpbusd per group would bound a core to ~20 GB/s, so each
         * row's sum is split over `chains` accumulators; integer addition is exact, so the
         * sum is the same number either way. */
        const int chains = rows == 1 ? 4 : rows <= 3 ? 2 : 1;
        __m512i dot[TILE * 4];
        for (int i = 0; i < rows * chains; i++) dot[i] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            for (int r = 0; r < rows; r++) {
                const int32_t *xq = (const int32_t *)(q + r * k + g * GROUP);
                __m512i *d = &dot[r * chains + c % chains];
                *d = dpbusd_broadcast(*d, wv[c], &xq[c]);
            }
        }
        for (int r = 0; r < rows; r++) {
            __m512i sum = dot[r * chains];
            if (high_times_16) /* one row: chains 0 and 2 hold the low nibbles, 1 and 3 16 x the high */
                sum = _mm512_add_epi32(_mm512_add_epi32(dot[0], dot[2]),
                                       _mm512_srai_epi32(_mm512_add_epi32(dot[1], dot[3]), 4));
            else
                for (int j = 1; j < chains; j++) sum = _mm512_add_epi32(sum, dot[r * chains + j]);
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), s);
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

#elif defined(V16_AVX2)
/* AVX2. A block is two halves of 8 channels (bytes 32h..32h+31 of each 64-byte vector and
 * the half's scales), each taken over all the groups, so that a half's weights stay in the
 * cache for its second pass. vpmaddubsw multiplies a weight vector by a row's 4 broadcast
 * values and adds pairs of products into int16 lanes, exact while a lane stays within int16:
 * at 4 bits a group's 8 vectors together reach at most 8 x 2 x 15 x 128 = 30,720, at 6 bits
 * two vectors 2 x 2 x 63 x 128 = 32,256. vpmaddwd then adds neighbouring lanes into the int32
 * sums vpdpbusd gives, and the float operations that follow are the AVX-512 build's, lane for
 * lane: the same numbers.
 *
 * Without a dot-product instruction every row pays for its products in instructions
 * (vpmaddubsw and an int16 add each), so nothing else is paid per row that can be paid once
 * per tile: the tile's rows are innermost, each 64-byte vector's two weight vectors are
 * unpacked once for all of them, and each row's running int16 (at 6 bits int32) sum stays
 * in a register. Two weight vectors, TILE sums and a few temporaries fill AVX2's 16
 * registers; the float accumulators, touched once a group, may wait in memory. */

/* Vector t of a group's half as its two vectors of q values for 8 channels (inputs 8t..8t+3
 * in `lo`, 8t+4..8t+7 in `hi`), at 6 bits with their top 2 bits: those of unpacked vectors
 * 2t and 2t + 1 sit in vector t / 2 of the top bits, bits 2j..2j+1 for j = 2t % 4 and
 * 2t % 4 + 1. 16-bit shifts move bits across bytes only into positions the masks clear. */
static inline __attribute__((always_inline)) void unpack_pair(const uint8_t *blk, int bits, int t, int half,
                                                              __m256i *lo, __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    __m256i packed = _mm256_loadu_si256((const __m256i *)(blk + 64 * t + 32 * half));
    *lo = _mm256_and_si256(packed, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    if (QBITS(bits) != 6) return;
    __m256i high = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * (t / 2) + 32 * half));
    if (t % 2 == 0) {
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
    } else {
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(high, top));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
    }
}

/* Vector t's products for one row: its two weight vectors times the row's values 8t..8t+7
 * (x points at the row's group), added in int16 lanes. */
static inline __attribute__((always_inline)) __m256i pair_products(__m256i lo, __m256i hi, const int8_t *x, int t) {
    const int32_t *values = (const int32_t *)x;
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(values[2 * t])),
                            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(values[2 * t + 1])));
}

/* v, held in a register at this point. Integer sums may be reordered freely, and GCC would
 * keep all of a group's products (in memory, past 16 registers) to add them at the end; this
 * keeps each row's running sum in one register instead. */
static inline __attribute__((always_inline)) __m256i in_register(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

static inline __attribute__((always_inline)) void half_tile(
    const uint8_t *w, int64_t groups, const int8_t *q, const float *scale, const float *scaled_sum,
    const float *half_sum, int64_t k, int rows, int bits, const float *bias, float *y, int64_t n_out, int64_t col,
    int half) {
    __m256 acc[TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const int64_t block_bytes = BLOCK_BYTES(bits);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 d = _mm256_setzero_ps(), dmin = _mm256_setzero_ps(); /* a K layout's, for 8 groups */
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = GROUP_AT(w, g, bits);
        if (half == 0)
            for (int line = 0; line < block_bytes; line += 64)
                _mm_prefetch((const char *)(blk + PREFETCH * block_bytes + line), _MM_HINT_T0);
        const uint8_t *scales = blk + Q_BYTES(bits);
        __m256 s, mn; /* at K6, mn is the second half's scale */
        if (bits & K_SCALES) {
            if (g % K_GROUPS == 0) {
                const uint8_t *head = blk - K_HEAD;
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * half)));
                dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 32 + 16 * half)));
            }
            __m128i first = _mm_loadl_epi64((const __m128i *)(scales + 8 * half));
            __m128i second = _mm_loadl_epi64((const __m128i *)(scales + 16 + 8 * half));
            if (bits == K6) {
                s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)));
                mn = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)));
            } else {
                s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first)));
                mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second)));
            }
        } else {
            s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16 * half)));
            mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 32 + 16 * half)));
        }
        const int8_t *x = q + g * GROUP; /* row r's group at x + r * k */
        __m256i sums[TILE];
        /* Unrolled, so that each t's tests are resolved when compiled and the sums stay in registers. */
        if (QBITS(bits) == 4) { /* the group's 8 vectors in int16, then widened once */
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                __m256i lo, hi;
                unpack_pair(blk, bits, t, half, &lo, &hi);
                for (int r = 0; r < rows; r++) {
                    __m256i pair = pair_products(lo, hi, x + r * k, t);
                    sums[r] = in_register(t ? _mm256_add_epi16(sums[r], pair) : pair);
                }
            }
            for (int r = 0; r < rows; r++) sums[r] = _mm256_madd_epi16(sums[r], ones);
        } else { /* two vectors at a time in int16; K6 keeps its halves (vectors 0..3, 4..7) apart */
            __m256 first[TILE];
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                __m256i lo, hi;
                unpack_pair(blk, bits, t, half, &lo, &hi);
                int fresh = bits == K6 ? t % 2 == 0 : t == 0;
                for (int r = 0; r < rows; r++) {
                    __m256i wide = _mm256_madd_epi16(pair_products(lo, hi, x + r * k, t), ones);
                    sums[r] = in_register(fresh ? wide : _mm256_add_epi32(sums[r], wide));
                }
                if (bits != K6 || t % 2 == 0) continue;
                for (int r = 0; r < rows; r++) {
                    float xs = 32.0f * half_sum[2 * (r * groups + g) + t / 2];
                    __m256 part = _mm256_sub_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(xs));
                    if (t == 1) {
                        first[r] = _mm256_mul_ps(part, s);
                    } else {
                        __m256 f = _mm256_fmadd_ps(part, mn, first[r]);
                        acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(scale[r * groups + g]), acc[r]);
                    }
                }
            }
            if (bits == K6) continue;
        }
        for (int r = 0; r < rows; r++) {
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), s);
            acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(scale[r * groups + g]), acc[r]);
            acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(scaled_sum[r * groups + g]), acc[r]);
        }
    }
    int64_t first = col + 8 * half, valid = n_out - first < 8 ? n_out - first : 8;
    if (valid <= 0) return;
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (bias) {
        __m256 b = _mm256_maskload_ps(bias + first, mask);
        for (int r = 0; r < rows; r++) acc[r] = _mm256_add_ps(acc[r], b);
    }
    for (int r = 0; r < rows; r++) _mm256_maskstore_ps(y + r * n_out + first, mask, acc[r]);
}

static inline __attribute__((always_inline)) void block_tile(
    const uint8_t *w, int64_t groups, const int8_t *q, const float *scale, const float *scaled_sum,
    const float *half_sum, int64_t k, int rows, int bits, const float *bias, float *y, int64_t n_out, int64_t col) {
    half_tile(w, groups, q, scale, scaled_sum, half_sum, k, rows, bits, bias, y, n_out, col, 0);
    half_tile(w, groups, q, scale, scaled_sum, half_sum, k, rows, bits, bias, y, n_out, col, 1);
}

#else
/* Plain C, a value at a time. Each channel's integer sum is exact, as vpdpbusd's, and the
 * float operations after it are the vector builds', lane for lane (fmaf where they fuse):
 * the same numbers. */


static void block_tile(const uint8_t *w, int64_t groups, const int8_t *q, const float *scale,
                       const float *scaled_sum, const float *half_sum, int64_t k, int rows, int bits,
                       const float *bias, float *y, int64_t n_out, int64_t col) {
    float acc[TILE][LANES] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *blk = GROUP_AT(w, g, bits);
        float s[2 * LANES]; /* scales, then minimums (at K6 the second half's scales) */
        block_scales(w, g, bits, s);
        int16_t wq[LANES][GROUP]; /* channel c, input j */
        unpack_values(blk, QBITS(bits), wq);
        for (int r = 0; r < rows; r++) {
            int16_t xq[GROUP];
            for (int j = 0; j < GROUP; j++) xq[j] = q[r * k + g * GROUP + j];
            for (int c = 0; c < LANES; c++) {
                int32_t sums[2] = {0, 0};
                for (int j = 0; j < GROUP; j++) sums[j >= GROUP / 2] += (int32_t)wq[c][j] * xq[j];
                if (bits == K6) {
                    const float *halves = half_sum + 2 * (r * groups + g);
                    float h0 = (float)sums[0] - 32.0f * halves[0], h1 = (float)sums[1] - 32.0f * halves[1];
                    acc[r][c] = fmaf(fmaf(h1, s[LANES + c], h0 * s[c]), scale[r * groups + g], acc[r][c]);
                    continue;
                }
                float f = (float)(sums[0] + sums[1]) * s[c];
                acc[r][c] = fmaf(f, scale[r * groups + g], acc[r][c]);
                acc[r][c] = fmaf(s[LANES + c], scaled_sum[r * groups + g], acc[r][c]);
            }
        }
    }
    int64_t valid = n_out - col < LANES ? n_out - col : LANES;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < valid; c++) y[r * n_out + col + c] = bias ? acc[r][c] + bias[col + c] : acc[r][c];
}
#endif

/* Tiles have at most TILE rows; CAP keeps the cases past it (AVX2) valid code that never runs. */
#define CAP(rows) ((rows) < TILE ? (rows) : TILE)
#define BLOCK_ROWS(bits)                                                                            \
    static void block_rows_##bits(const uint8_t *w, int64_t groups, const int8_t *q, const float *scale, \
                                  const float *scaled_sum, const float *half_sum, int64_t k, int rows,  \
                                  const float *bias, float *y, int64_t n_out, int64_t col) {            \
        switch (rows) {                                                                                 \
            case 1: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, 1, bits, bias, y, n_out, col); break; \
            case 2: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, 2, bits, bias, y, n_out, col); break; \
            case 3: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, 3, bits, bias, y, n_out, col); break; \
            case 4: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, 4, bits, bias, y, n_out, col); break; \
            case 5: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, CAP(5), bits, bias, y, n_out, col); break; \
            case 6: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, CAP(6), bits, bias, y, n_out, col); break; \
            case 7: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, CAP(7), bits, bias, y, n_out, col); break; \
            default: block_tile(w, groups, q, scale, scaled_sum, half_sum, k, TILE, bits, bias, y, n_out, col);    \
        }                                                                                               \
    }
BLOCK_ROWS(4)
BLOCK_ROWS(6)
BLOCK_ROWS(K4)
BLOCK_ROWS(K6)
#undef BLOCK_ROWS
#undef CAP

/* Blocks [first, last) of y [rows, n_out] from the rows' quantized activations: every row
 * tile reads a block's weights while they are in cache. */
static void compute_blocks(const uint8_t *w, int bits, int64_t k, const int8_t *q, const float *scale,
                           const float *scaled_sum, const float *half_sum, int64_t rows, const float *bias,
                           float *y, int64_t n_out, int64_t first, int64_t last) {
    int64_t groups = k / GROUP;
    for (int64_t b = first; b < last; b++) {
        const uint8_t *wb = w + b * BLOCK_STRIDE(bits, groups);
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            int tile_rows = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            const int8_t *tq = q + r0 * k;
            const float *ts = scale + r0 * groups, *tsum = scaled_sum + r0 * groups;
            const float *thalf = half_sum ? half_sum + 2 * r0 * groups : NULL;
            float *ty = y + r0 * n_out;
            switch (bits) {
                case 6: block_rows_6(wb, groups, tq, ts, tsum, thalf, k, tile_rows, bias, ty, n_out, b * LANES); break;
                case K4: block_rows_K4(wb, groups, tq, ts, tsum, thalf, k, tile_rows, bias, ty, n_out, b * LANES); break;
                case K6: block_rows_K6(wb, groups, tq, ts, tsum, thalf, k, tile_rows, bias, ty, n_out, b * LANES); break;
                default: block_rows_4(wb, groups, tq, ts, tsum, thalf, k, tile_rows, bias, ty, n_out, b * LANES);
            }
        }
    }
}

/* The same op on `threads` OpenMP threads, its activations quantized into q, scale, scaled_sum. */
static void linear_openmp(const uint8_t *w, int bits, int64_t n_out, int64_t k, const float *x, int64_t rows,
                          const float *bias, float *y, int threads, int8_t *q, float *scale, float *scaled_sum,
                          float *half_sum) {
    int64_t groups = k / GROUP, blocks = (n_out + LANES - 1) / LANES;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * k, k, q + r * k, scale + r * groups, scaled_sum + r * groups,
                         half_sum ? half_sum + 2 * r * groups : NULL);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            compute_blocks(w, bits, k, q, scale, scaled_sum, half_sum, rows, bias, y, n_out, b, b + 1);
    }
}

/* Rows per shared op: the helper's staging holds this many rows of outputs (a prompt's
 * many rows go in pieces, each reading the weights again, which its dot products outweigh). */
#define SHARE_ROWS 64
enum { ARG_W, ARG_BIAS, ARG_Y, ARG_STAGING, ARG_STAGE_FLOATS, ARG_Q, ARG_SCALE, ARG_SUM, ARG_HALF, ARG_N_OUT,
       ARG_K, ARG_ROWS, ARG_BITS, ARG_BLOCKS, ARG_CHUNK_BLOCKS, ARG_COUNT };
_Static_assert(ARG_COUNT <= HELPER_WORDS, "a linear's arguments fit the helper's words");
#define ARG(type, args, name) ((type)(uintptr_t)(args)[ARG_##name])

/* A linear on one thread, shared with the helpers (helper_cpu.c) in chunks of blocks of output
 * channels. Its quantized activations and each helper's staging [rows, n_out] are kept here
 * across calls, as a helper may still read them after an op. */
static struct {
    int8_t *q;
    float *scale, *scaled_sum, *half_sum, *staging;
    size_t q_bytes, groups, staging_floats;
} shared;

/* Buffers for `rows` of k inputs and n_out outputs; 0, or -1 when out of memory. */
static int reserve_shared(int64_t rows, int64_t k, int64_t n_out) {
    size_t q_bytes = (size_t)(rows * k), groups = (size_t)(rows * (k / GROUP));
    size_t staging = (size_t)(rows * n_out) * HELPER_THREADS;
    if (q_bytes <= shared.q_bytes && groups <= shared.groups && staging <= shared.staging_floats) return 0;
    helper_settle();  /* it may be reading the old ones */
    free(shared.q), free(shared.scale), free(shared.scaled_sum), free(shared.half_sum), free(shared.staging);
    shared.q_bytes = q_bytes > shared.q_bytes ? q_bytes : shared.q_bytes;
    shared.groups = groups > shared.groups ? groups : shared.groups;
    shared.staging_floats = staging > shared.staging_floats ? staging : shared.staging_floats;
    shared.q = malloc(shared.q_bytes);
    shared.scale = malloc(sizeof(float) * shared.groups);
    shared.scaled_sum = malloc(sizeof(float) * shared.groups);
    shared.half_sum = malloc(sizeof(float) * 2 * shared.groups);
    shared.staging = malloc(sizeof(float) * shared.staging_floats);
    if (shared.q && shared.scale && shared.scaled_sum && shared.half_sum && shared.staging) return 0;
    free(shared.q), free(shared.scale), free(shared.scaled_sum), free(shared.half_sum), free(shared.staging);
    shared = (typeof(shared)){0};
    return -1;
}

static void chunk_blocks(const uint64_t *args, int64_t chunk, int64_t *first, int64_t *last) {
    int64_t size = ARG(int64_t, args, CHUNK_BLOCKS), blocks = ARG(int64_t, args, BLOCKS);
    *first = chunk * size;
    *last = *first + size < blocks ? *first + size : blocks;
}

/* Where `helper` stages its chunks (-1: the caller, straight into y). */
static float *stage(const uint64_t *args, int helper) {
    if (helper < 0) return ARG(float *, args, Y);
    return ARG(float *, args, STAGING) + (size_t)helper * ARG(size_t, args, STAGE_FLOATS);
}

static void run_chunk(const uint64_t *args, int64_t chunk, int helper) {
    int64_t first, last;
    chunk_blocks(args, chunk, &first, &last);
    compute_blocks(ARG(const uint8_t *, args, W), ARG(int, args, BITS), ARG(int64_t, args, K),
                   ARG(const int8_t *, args, Q), ARG(const float *, args, SCALE), ARG(const float *, args, SUM),
                   ARG(const float *, args, HALF), ARG(int64_t, args, ROWS), ARG(const float *, args, BIAS),
                   stage(args, helper), ARG(int64_t, args, N_OUT),
                   first, last);
}

static void merge_chunk(const uint64_t *args, int64_t chunk, int helper) {
    int64_t first, last, n_out = ARG(int64_t, args, N_OUT);
    chunk_blocks(args, chunk, &first, &last);
    int64_t start = first * LANES, end = last * LANES < n_out ? last * LANES : n_out;
    const float *staging = stage(args, helper);
    float *y = ARG(float *, args, Y);
    for (int64_t r = 0; r < ARG(int64_t, args, ROWS); r++)
        memcpy(y + r * n_out + start, staging + r * n_out + start, sizeof(float) * (size_t)(end - start));
}

static const helper_work linear_work = {run_chunk, merge_chunk};

/* 0 when done (shared), 1 when the helper is not to be had, -1 when out of memory. */
static int share_linear(const uint8_t *w, int bits, int64_t n_out, int64_t k, const float *x, int64_t rows,
                        const float *bias, float *y) {
    if (!helper_begin()) return 1;
    if (reserve_shared(rows, k, n_out)) {
        helper_end();
        return -1;
    }
    int64_t groups = k / GROUP, blocks = (n_out + LANES - 1) / LANES;
    float *half_sum = bits == K6 ? shared.half_sum : NULL;
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * k, k, shared.q + r * k, shared.scale + r * groups, shared.scaled_sum + r * groups,
                     half_sum ? half_sum + 2 * r * groups : NULL);
    int64_t chunks = blocks < HELPER_CHUNKS ? blocks : HELPER_CHUNKS;
    int64_t size = (blocks + chunks - 1) / chunks;
    uint64_t args[HELPER_WORDS] = {
        [ARG_W] = (uintptr_t)w, [ARG_BIAS] = (uintptr_t)bias, [ARG_Y] = (uintptr_t)y,
        /* Each helper's place is the same for every op: a late helper writes only into its own. */
        [ARG_STAGING] = (uintptr_t)shared.staging, [ARG_STAGE_FLOATS] = shared.staging_floats / HELPER_THREADS,
        [ARG_Q] = (uintptr_t)shared.q,
        [ARG_SCALE] = (uintptr_t)shared.scale, [ARG_SUM] = (uintptr_t)shared.scaled_sum, [ARG_HALF] = (uintptr_t)half_sum,
        [ARG_N_OUT] = (uint64_t)n_out, [ARG_K] = (uint64_t)k, [ARG_ROWS] = (uint64_t)rows, [ARG_BITS] = (uint64_t)bits,
        [ARG_BLOCKS] = (uint64_t)blocks, [ARG_CHUNK_BLOCKS] = (uint64_t)size,
    };
    helper_share(&linear_work, args, (blocks + size - 1) / size);
    helper_end();
    return 0;
}

/* int4_linear's work, for any layout. */
static int linear(const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t rows, const float *bias,
                  float *y, int threads, int bits) {
    int64_t done = 0;
    while (threads == 1 && done < rows) {
        int64_t piece = rows - done < SHARE_ROWS ? rows - done : SHARE_ROWS;
        int status = share_linear(w, bits, n_out, k, x + done * k, piece, bias, y + done * n_out);
        if (status == 1) break; /* no helper to be had: the rest alone */
        if (status) return -1;
        done += piece;
    }
    if (done == rows) return 0;
    int64_t left = rows - done, groups = k / GROUP;
    int8_t *q = malloc((size_t)(left * k));
    float *scale = malloc(sizeof(float) * (size_t)(left * groups));
    float *scaled_sum = malloc(sizeof(float) * (size_t)(left * groups));
    float *half_sum = bits == K6 ? malloc(sizeof(float) * 2 * (size_t)(left * groups)) : NULL;
    if (!q || !scale || !scaled_sum || (bits == K6 && !half_sum)) {
        free(q), free(scale), free(scaled_sum), free(half_sum);
        return -1;
    }
    linear_openmp(w, bits, n_out, k, x + done * k, left, bias, y + done * n_out, threads, q, scale, scaled_sum,
                  half_sum);
    free(q), free(scale), free(scaled_sum), free(half_sum);
    return 0;
}

/* Whether `bits` names a layout whose groups fit k inputs: 4 and 6 take whole groups of 32,
 * the K layouts whole blocks of 256. */
static int layout_fits(int bits, int64_t k) {
    if (bits == 4 || bits == 6) return k % GROUP == 0;
    return (bits == K4 || bits == K6) && k % (K_GROUPS * GROUP) == 0;
}

/* y [rows, n_out] = x [rows, k] times the packed weights of layout `bits` (4, 6, K4 or K6), plus
 * bias [n_out] unless it is NULL (one float add, as `y += bias` would); 0, or -1 when out of
 * memory (or `bits` names no layout for k). On one thread, shared with the helper when it is
 * on: the weights and bias may then be freed only after helper_settle (int4_cpu.py settles as
 * a linear is freed). */
int int4_linear(const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t rows, const float *bias,
                float *y, int threads, int bits) {
    if (!layout_fits(bits, k)) return -1;
    return linear(w, n_out, k, x, rows, bias, y, threads, bits);
}

/* The bytes gguf_repack writes for an [n_out, k] tensor in layout K4 (`bits` 4) or K6 (6). */
int64_t int4_repacked_bytes(int64_t n_out, int64_t k, int bits) {
    int64_t blocks = (n_out + LANES - 1) / LANES, groups = k / GROUP;
    return blocks * (bits == 6 ? BLOCK_STRIDE(K6, groups) : BLOCK_STRIDE(K4, groups));
}

/* Where gguf_repack writes into a K layout's block (bytes from its start): the head of group
 * g's 8 groups, and group g; `bits` 4 for K4, 6 for K6. */
int64_t int4_repacked_head(int64_t g, int bits) {
    return (bits == 6 ? GROUP_AT(0, g, K6) : GROUP_AT(0, g, K4)) - K_HEAD;
}
int64_t int4_repacked_group(int64_t g, int bits) { return bits == 6 ? GROUP_AT(0, g, K6) : GROUP_AT(0, g, K4); }

/* Channel c's q values of one group (0..15, or 0..63 at 6 bits) into a zeroed block, in the
 * layout above: vector t, byte 4c + i holds input 8t + i low, 8t + 4 + i high; at 6 bits the
 * top 2 bits of unpacked vector m = 2t + half sit in vector m / 4, bits 2 (m % 4). */
void int4_place(uint8_t *blk, int bits, int c, const uint8_t q[GROUP]) {
    for (int t = 0; t < 4; t++) {
        for (int i = 0; i < 4; i++) {
            uint8_t first = q[8 * t + i], second = q[8 * t + 4 + i];
            blk[64 * t + 4 * c + i] = (uint8_t)((first & 0x0F) | ((second & 0x0F) << 4));
            if (bits != 6) continue;
            for (int half = 0; half < 2; half++) {
                int m = 2 * t + half;
                uint8_t top_bits = (uint8_t)(((half ? second : first) >> 4) & 3);
                blk[256 + 64 * (m / 4) + 4 * c + i] |= (uint8_t)(top_bits << (2 * (m % 4)));
            }
        }
    }
}

#ifdef V16_SCALAR
/* fp16 bits as fp32: exact. */
static float from_half(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000) << 16, exponent = (half >> 10) & 0x1F, fraction = half & 0x3FF, bits;
    if (exponent == 0x1F)
        bits = sign | 0x7F800000 | fraction << 13;
    else if (exponent)
        bits = sign | (exponent + 112) << 23 | fraction << 13;
    else { /* zero or subnormal: fraction x 2^-24, exact in fp32 */
        float value = (float)fraction * 0x1p-24f;
        memcpy(&bits, &value, sizeof bits);
        bits |= sign;
    }
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* fp32 as fp16 bits, rounding to nearest even (as vcvtps2ph and torch's .half()). */
static uint16_t half_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint16_t sign = (uint16_t)(bits >> 16 & 0x8000);
    uint32_t magnitude = bits & 0x7FFFFFFF;
    if (magnitude > 0x7F800000) return sign | 0x7E00 | (uint16_t)(magnitude >> 13 & 0x3FF); /* NaN, quiet */
    if (magnitude >= 0x477FF000) return sign | 0x7C00; /* 65520 and up round to infinity */
    uint32_t kept, rest, halfway;
    if (magnitude >= 0x38800000) { /* normal: 2^-14 and up */
        kept = (magnitude >> 13) - (112u << 10), rest = magnitude & 0x1FFF, halfway = 0x1000;
    } else { /* subnormal: units of 2^-24, the significand (implicit bit too) shifted right */
        int shift = 126 - (int)(magnitude >> 23);
        if (shift > 24) return sign; /* below 2^-25: zero */
        uint32_t significand = (magnitude & 0x7FFFFF) | 0x800000;
        kept = significand >> shift, rest = significand & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    }
    if (rest > halfway || (rest == halfway && (kept & 1))) kept++; /* a carry moves into the exponent, rightly */
    return sign | (uint16_t)kept;
}

/* fp32 -> fp16 -> fp32, rounding to nearest even as torch's .half() does. */
static inline float to_half(float x, uint16_t *bits) {
    *bits = half_bits(x);
    return from_half(*bits);
}

/* minps and maxps on one value: the second operand where either is NaN or both are zero. */
static inline float min1(float a, float b) { return a < b ? a : b; }
static inline float max1(float a, float b) { return a > b ? a : b; }

/* The smallest and largest of 8 lanes, in the vector builds' order (lanes_min below). */
static float lanes_min8(const float v[8]) {
    float m[4];
    for (int i = 0; i < 4; i++) m[i] = min1(v[i], v[4 + i]);
    return min1(min1(m[0], m[2]), min1(m[1], m[3]));
}
static float lanes_max8(const float v[8]) {
    float m[4];
    for (int i = 0; i < 4; i++) m[i] = max1(v[i], v[4 + i]);
    return max1(max1(m[0], m[2]), max1(m[1], m[3]));
}

/* quantize_group below, a value at a time in its order. */
static int quantize_group(const float *w, int top, uint8_t q[GROUP], uint16_t *scale, uint16_t *minimum) {
    float lows[8], highs[8];
    int unordered = 0;
    for (int i = 0; i < 8; i++) {
        lows[i] = min1(min1(w[i], w[8 + i]), min1(w[16 + i], w[24 + i]));
        highs[i] = max1(max1(w[i], w[8 + i]), max1(w[16 + i], w[24 + i]));
    }
    for (int i = 0; i < GROUP; i++) unordered |= w[i] != w[i];
    float lo = lanes_min8(lows), hi = lanes_max8(highs);
    if (unordered || !(lo > -FITS_LIMIT && hi < FITS_LIMIT)) {
        for (int i = 0; i < GROUP; i++) q[i] = 0;
        return -1;
    }
    float low = to_half(lo, minimum);
    float step = to_half((hi - low) / (float)top, scale);
    for (int i = 0; i < GROUP; i++) {
        float v = min1(max1(nearbyintf((w[i] - low) / step), 0.0f), (float)top);
        q[i] = step > 0.0f ? (uint8_t)(int32_t)v : 0;
    }
    return 0;
}

#else
static inline float from_half(uint16_t half) { return _cvtsh_ss(half); }

/* fp32 -> fp16 -> fp32, rounding to nearest even as torch's .half() does. */
static inline float to_half(float x, uint16_t *bits) {
    *bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    return _cvtsh_ss(*bits);
}

/* The smallest and largest of 8 lanes. */
static inline float lanes_min(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}
static inline float lanes_max(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* One channel's group of 32 weights: its q values and fp16 scale and minimum, the same IEEE
 * operations as int4_cpu.quantize (torch): a subtraction, a division, rounding half to even,
 * a clamp; so the same bytes. */
static int quantize_group(const float *w, int top, uint8_t q[GROUP], uint16_t *scale, uint16_t *minimum) {
    __m256 x[4];
    for (int j = 0; j < 4; j++) x[j] = _mm256_loadu_ps(w + 8 * j);
    float lo = lanes_min(_mm256_min_ps(_mm256_min_ps(x[0], x[1]), _mm256_min_ps(x[2], x[3])));
    float hi = lanes_max(_mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3])));
    /* min/max drop a NaN, so NaNs are looked for apart. */
    __m256 unordered = _mm256_cmp_ps(x[0], x[0], _CMP_UNORD_Q);
    for (int j = 1; j < 4; j++) unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x[j], x[j], _CMP_UNORD_Q));
    if (_mm256_movemask_ps(unordered) || !(lo > -FITS_LIMIT && hi < FITS_LIMIT)) {
        for (int i = 0; i < GROUP; i++) q[i] = 0;
        return -1;
    }
    float low = to_half(lo, minimum);
    float step = to_half((hi - low) / (float)top, scale);
    int32_t values[GROUP];
    for (int j = 0; j < 4; j++) {
        __m256 v = _mm256_div_ps(_mm256_sub_ps(x[j], _mm256_set1_ps(low)), _mm256_set1_ps(step));
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, _mm256_setzero_ps()), _mm256_set1_ps((float)top));
        _mm256_storeu_si256((__m256i *)(values + 8 * j), _mm256_cvtps_epi32(v));
    }
    for (int i = 0; i < GROUP; i++) q[i] = step > 0.0f ? (uint8_t)values[i] : 0;
    return 0;
}
#endif

/* The packed layout above from fp32 weights [n_out, k], as int4_cpu.pack(*quantize(w)) makes
 * it: `packed` holds ceil(n_out / 16) * (k / 32) * BLOCK_BYTES(bits) bytes, channels past n_out
 * zero. 0; -1 when k or bits do not fit; -2 when a weight is NaN or too large for fp16 scales
 * (checked here, in the same pass, rather than in a separate pass over the weights in torch:
 * docs/engine.md#quantizing-at-load-in-c-int4_pack). */
int int4_pack(const float *w, int64_t n_out, int64_t k, int bits, uint8_t *packed, int threads) {
    if ((bits != 4 && bits != 6) || k % GROUP) return -1;
    int64_t groups = k / GROUP, blocks = (n_out + LANES - 1) / LANES, block_bytes = BLOCK_BYTES(bits);
    int top = (1 << bits) - 1, unfit = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : unfit)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *blk = packed + (b * groups + g) * block_bytes, q[GROUP];
            uint16_t *scales = (uint16_t *)(blk + block_bytes - SCALE_BYTES);
            for (int i = 0; i < block_bytes; i++) blk[i] = 0;
            for (int c = 0; c < LANES && b * LANES + c < n_out; c++) {
                unfit |= quantize_group(w + (b * LANES + c) * k + g * GROUP, top, q, &scales[c], &scales[LANES + c]);
                int4_place(blk, bits, c, q);
            }
        }
    }
    return unfit ? -2 : 0;
}

/* int4_unpack for the K layouts: w = (d * sc) * q + (-dmin * m) at K4, (d * sc) * (q - 32) at
 * K6 (sc of inputs 0..15, then of 16..31), each product in fp32 as the kernel forms it: the
 * GGUF tensor's own de-quantized values. */
static int unpack_k(const uint8_t *packed, int64_t n_out, int64_t k, int bits, float *w, int threads) {
    int64_t groups = k / GROUP, blocks = (n_out + LANES - 1) / LANES, stride = BLOCK_STRIDE(bits, groups);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = packed + b * stride;
        for (int64_t g = 0; g < groups; g++) {
            float s[2 * LANES];
            int16_t q[LANES][GROUP];
            block_scales(wb, g, bits, s);
            unpack_values(GROUP_AT(wb, g, bits), QBITS(bits), q);
            for (int c = 0; c < LANES && b * LANES + c < n_out; c++) {
                float *out = w + (b * LANES + c) * k + g * GROUP;
                for (int j = 0; j < GROUP; j++)
                    out[j] = bits == K6 ? s[j < GROUP / 2 ? c : LANES + c] * (float)(q[c][j] - 32)
                                        : s[c] * (float)q[c][j] + s[LANES + c];
            }
        }
    }
    return 0;
}

/* int4_pack's inverse, as floats: w [n_out, k] = scale * q + minimum (a multiply, then an add),
 * the values the kernel multiplies by, as int4_cpu.dequantize(*unpack(packed)) gives them.
 * 0, or -1 when k or bits do not fit. */
int int4_unpack(const uint8_t *packed, int64_t n_out, int64_t k, int bits, float *w, int threads) {
    if (!layout_fits(bits, k)) return -1;
    if (bits & K_SCALES) return unpack_k(packed, n_out, k, bits, w, threads);
    int64_t groups = k / GROUP, blocks = (n_out + LANES - 1) / LANES, block_bytes = BLOCK_BYTES(bits);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *blk = packed + (b * groups + g) * block_bytes;
            const uint16_t *scales = (const uint16_t *)(blk + block_bytes - SCALE_BYTES);
            for (int c = 0; c < LANES && b * LANES + c < n_out; c++) {
                float step = from_half(scales[c]), low = from_half(scales[LANES + c]);
                float *out = w + (b * LANES + c) * k + g * GROUP;
                for (int t = 0; t < 4; t++) {
                    for (int i = 0; i < 4; i++) {
                        uint8_t byte = blk[64 * t + 4 * c + i];
                        int q[2] = {byte & 0x0F, byte >> 4}; /* inputs 8t + i and 8t + 4 + i */
                        for (int half = 0; half < 2 && bits == 6; half++) {
                            int m = 2 * t + half;
                            q[half] |= ((blk[256 + 64 * (m / 4) + 4 * c + i] >> (2 * (m % 4))) & 3) << 4;
                        }
                        out[8 * t + i] = step * (float)q[0] + low;
                        out[8 * t + 4 + i] = step * (float)q[1] + low;
                    }
                }
            }
        }
    }
    return 0;
}

/* The activations' quantization alone, as int4_linear does it to each row (for tests). */
void int4_quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *q, float *scale, float *scaled_sum) {
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * k, k, q + r * k, scale + r * (k / GROUP), scaled_sum + r * (k / GROUP), NULL);
}
