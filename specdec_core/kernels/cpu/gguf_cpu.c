/* GGUF weights as the file stores them, times fp32 activations, on AVX-512, AVX2 or plain C,
 * the same numbers for any row count, thread count and build.
 *
 *     y[r, o] = sum_i x[r, i] * W[o, i]   (+ bias[o])
 *
 * W is one tensor's bytes as they lie in the GGUF: rows of llama.cpp's blocks (Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0: 32 weights a block; Q4_K, Q5_K, Q6_K: 256), or F16, BF16, F32 values.
 * The activations are not quantized at all, so nothing here is coarser than llama.cpp, which
 * rounds them to Q8_0 or Q8_K blocks.
 *
 * Each weight is dequantized as llama.cpp's dequantize_row_* and the gguf package's
 * gguf.quants.dequantize compute it, bit for bit: a block's scale products (d * sc, dmin * m)
 * are exact in fp32, then the reference's one rounding (d * q - m, d * q + m, or d * sc * q for
 * Q6_K). So y is that dequantized matrix times x, and only the order of the sum is this
 * kernel's own: lane j of a 16-float accumulator takes inputs 16m + j, m increasing, one fused
 * multiply-add each (a tail of fewer than 16 inputs is masked, the weights there zero), then
 * v16_reduce_add_ps's fixed tree, then the bias. That order depends on the row and the column
 * alone: not on how many rows a call has, nor on the thread count (threads split the output
 * columns, never a sum), nor on the build (simd16.h gives all three the same operations).
 * Speculative decoding's exactness rests on it (gguf_blocks.py).
 *
 * Every block is read and decoded once per call: a span of SPAN inputs of COLS columns is
 * dequantized into floats that stay in the L1 cache, then multiplied by every row.
 */
#include <stdint.h>
#include <string.h>

#include "simd16.h"

#define LANES 16
#define SPAN 256 /* inputs decoded at a time: one K-quant block, eight of the 32-weight ones */
/* A column tile's accumulators, as many as the registers hold beside one weight vector. */
#ifdef V16_AVX512
#define COLS 4
#define ROW_TILE 4
#else
#define COLS 2
#define ROW_TILE 3
#endif
#define ROW_BLOCK 32 /* rows whose accumulators a column tile keeps (in L1) across spans */

/* ggml's type ids, as the GGUF header names them. */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       BF16 = 30 };

/* Weights per block and bytes per block of a type; 0 for a type this file does not know. */
static int block_format(int type, int64_t *weights, int64_t *bytes) {
    switch (type) {
        case F32: *weights = 1, *bytes = 4; return 1;
        case F16: case BF16: *weights = 1, *bytes = 2; return 1;
        case Q4_0: *weights = 32, *bytes = 18; return 1;
        case Q4_1: *weights = 32, *bytes = 20; return 1;
        case Q5_0: *weights = 32, *bytes = 22; return 1;
        case Q5_1: *weights = 32, *bytes = 24; return 1;
        case Q8_0: *weights = 32, *bytes = 34; return 1;
        case Q4_K: *weights = 256, *bytes = 144; return 1;
        case Q5_K: *weights = 256, *bytes = 176; return 1;
        case Q6_K: *weights = 256, *bytes = 210; return 1;
        default: return 0;
    }
}

/* fp16 bits as fp32: exact. */
#ifdef V16_SCALAR
static float half_to_float(uint16_t half) {
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
#else
static inline float half_to_float(uint16_t half) { return _cvtsh_ss(half); }
#endif

/* The fp16 at p (blocks are packed: no alignment to rely on). */
static inline float half_at(const uint8_t *p) {
    uint16_t half;
    memcpy(&half, p, sizeof half);
    return half_to_float(half);
}

/* 16 bytes at a time, for the block decoders: SSE2 (and SSSE3's pshufb) where the build is
 * x86, plain C otherwise. Integer operations only, so every build gets the same bytes. */
#ifndef V16_SCALAR
typedef __m128i bytes16;
static inline bytes16 bytes_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
/* (v >> shift) & mask in each byte (16-bit shifts: bits crossing into a byte are masked off). */
static inline bytes16 bytes_field(bytes16 v, int shift, int mask) {
    return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8((char)mask));
}
/* low | high << 4, high at most 15 in each byte. */
static inline bytes16 bytes_join(bytes16 low, bytes16 high) { return _mm_or_si128(low, _mm_slli_epi16(high, 4)); }
static inline bytes16 bytes_sub(bytes16 v, int value) { return _mm_sub_epi8(v, _mm_set1_epi8((char)value)); }
/* Bit j of `bits` (16 of them) as byte j: 1 or 0. */
static inline bytes16 bytes_bits(uint32_t bits) {
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, (char)128, 1, 2, 4, 8, 16, 32, 64, (char)128);
    __m128i set = _mm_and_si128(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), spread), bit);
    return _mm_and_si128(_mm_cmpeq_epi8(set, bit), _mm_set1_epi8(1));
}
#ifdef V16_AVX512
static inline v16f bytes_unsigned(bytes16 v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
static inline v16f bytes_signed(bytes16 v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
#else
static inline v16f bytes_unsigned(bytes16 v) {
    return (v16f){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
static inline v16f bytes_signed(bytes16 v) {
    return (v16f){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
                  _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
#endif
#else
typedef struct {
    uint8_t b[16];
} bytes16;
#define BYTES_EACH(expression)                       \
    do {                                             \
        for (int i = 0; i < 16; i++) r.b[i] = (uint8_t)(expression); \
    } while (0)
static inline bytes16 bytes_load(const uint8_t *p) { bytes16 r; memcpy(r.b, p, sizeof r.b); return r; }
static inline bytes16 bytes_field(bytes16 v, int shift, int mask) { bytes16 r; BYTES_EACH((v.b[i] >> shift) & mask); return r; }
static inline bytes16 bytes_join(bytes16 low, bytes16 high) { bytes16 r; BYTES_EACH(low.b[i] | high.b[i] << 4); return r; }
static inline bytes16 bytes_sub(bytes16 v, int value) { bytes16 r; BYTES_EACH(v.b[i] - value); return r; }
static inline bytes16 bytes_bits(uint32_t bits) { bytes16 r; BYTES_EACH(bits >> i & 1); return r; }
static inline v16f bytes_unsigned(bytes16 v) {
    v16f r;
    for (int i = 0; i < 16; i++) r.f[i] = (float)v.b[i];
    return r;
}
static inline v16f bytes_signed(bytes16 v) {
    v16f r;
    for (int i = 0; i < 16; i++) r.f[i] = (float)(int8_t)v.b[i];
    return r;
}
#undef BYTES_EACH
#endif

/* 4-bit weights by table: a block's 16 possible values, computed with the very operations
 * the reference applies to each weight, then picked by each weight's 4 bits (vpermps). */
#if defined(V16_AVX512)
typedef __m512i ints16;
static inline ints16 ints_widen(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline ints16 ints_low4(ints16 v) { return _mm512_and_si512(v, _mm512_set1_epi32(0x0F)); }
static inline ints16 ints_high4(ints16 v) { return _mm512_srli_epi32(v, 4); }
static inline v16f lookup16(v16f table, ints16 index) { return _mm512_permutexvar_ps(index, table); }
static inline v16f iota16(void) { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#elif defined(V16_AVX2)
typedef struct {
    __m256i lo, hi;
} ints16;
static inline ints16 ints_widen(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (ints16){_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
}
static inline ints16 ints_low4(ints16 v) {
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    return (ints16){_mm256_and_si256(v.lo, nibble), _mm256_and_si256(v.hi, nibble)};
}
static inline ints16 ints_high4(ints16 v) { return (ints16){_mm256_srli_epi32(v.lo, 4), _mm256_srli_epi32(v.hi, 4)}; }
/* Entries 0..7 from the table's low half, 8..15 from its high half. */
static inline __m256 lookup8(v16f table, __m256i index) {
    __m256 from_lo = _mm256_permutevar8x32_ps(table.lo, index), from_hi = _mm256_permutevar8x32_ps(table.hi, index);
    return _mm256_blendv_ps(from_lo, from_hi, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
}
static inline v16f lookup16(v16f table, ints16 index) { return (v16f){lookup8(table, index.lo), lookup8(table, index.hi)}; }
static inline v16f iota16(void) {
    return (v16f){_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)};
}
#else
typedef struct {
    int32_t i[16];
} ints16;
static inline ints16 ints_widen(const uint8_t *p) {
    ints16 r;
    for (int j = 0; j < 16; j++) r.i[j] = p[j];
    return r;
}
static inline ints16 ints_low4(ints16 v) {
    for (int j = 0; j < 16; j++) v.i[j] &= 0x0F;
    return v;
}
static inline ints16 ints_high4(ints16 v) {
    for (int j = 0; j < 16; j++) v.i[j] >>= 4;
    return v;
}
static inline v16f lookup16(v16f table, ints16 index) {
    v16f r;
    for (int j = 0; j < 16; j++) r.f[j] = table.f[index.i[j]];
    return r;
}
static inline v16f iota16(void) {
    v16f r;
    for (int j = 0; j < 16; j++) r.f[j] = (float)j;
    return r;
}
#endif

/* The 32 weights of 16 bytes of nibbles: the low nibbles through table_low to out[0..15], the
 * high ones through table_high to out[offset..offset + 15]. */
static inline void nibbles_by_table(const uint8_t *qs, v16f table_low, v16f table_high, float *out, int offset) {
    ints16 q = ints_widen(qs);
    v16_storeu_ps(out, lookup16(table_low, ints_low4(q)));
    v16_storeu_ps(out + offset, lookup16(table_high, ints_high4(q)));
}

/* d * q and d * q - m or + m, one rounding where the reference rounds (d * q is exact). */
static inline void store_scaled(float *out, float d, v16f q) { v16_storeu_ps(out, v16_mul_ps(v16_set1_ps(d), q)); }
static inline void store_scaled_sub(float *out, float d, v16f q, float m) {
    v16_storeu_ps(out, v16_sub_ps(v16_mul_ps(v16_set1_ps(d), q), v16_set1_ps(m)));
}
static inline void store_scaled_add(float *out, float d, v16f q, float m) {
    v16_storeu_ps(out, v16_add_ps(v16_mul_ps(v16_set1_ps(d), q), v16_set1_ps(m)));
}

/* Q4_0: d, then 16 bytes: weight j in the low nibble of byte j, weight 16 + j in its high
 * nibble; w = d * (q - 8). */
static void block_q4_0(const uint8_t *b, float *out) {
    v16f d = v16_set1_ps(half_at(b));
    v16f table = v16_mul_ps(d, v16_sub_ps(iota16(), v16_set1_ps(8.0f))); /* q - 8 is exact */
    nibbles_by_table(b + 2, table, table, out, 16);
}

/* Q4_1: d, m, then Q4_0's nibbles; w = d * q + m. */
static void block_q4_1(const uint8_t *b, float *out) {
    v16f table = v16_add_ps(v16_mul_ps(v16_set1_ps(half_at(b)), iota16()), v16_set1_ps(half_at(b + 2)));
    nibbles_by_table(b + 4, table, table, out, 16);
}

/* Q5_0: d, 32 high bits (bit j: weight j's fifth bit), then Q4_0's nibbles; w = d * (q - 16). */
static void block_q5_0(const uint8_t *b, float *out) {
    float d = half_at(b);
    uint32_t qh;
    memcpy(&qh, b + 2, sizeof qh);
    bytes16 qs = bytes_load(b + 6);
    store_scaled(out, d, bytes_signed(bytes_sub(bytes_join(bytes_field(qs, 0, 0x0F), bytes_bits(qh & 0xFFFF)), 16)));
    store_scaled(out + 16, d, bytes_signed(bytes_sub(bytes_join(bytes_field(qs, 4, 0x0F), bytes_bits(qh >> 16)), 16)));
}

/* Q5_1: d, m, then Q5_0's high bits and nibbles; w = d * q + m. */
static void block_q5_1(const uint8_t *b, float *out) {
    float d = half_at(b), m = half_at(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, sizeof qh);
    bytes16 qs = bytes_load(b + 8);
    store_scaled_add(out, d, bytes_unsigned(bytes_join(bytes_field(qs, 0, 0x0F), bytes_bits(qh & 0xFFFF))), m);
    store_scaled_add(out + 16, d, bytes_unsigned(bytes_join(bytes_field(qs, 4, 0x0F), bytes_bits(qh >> 16))), m);
}

/* Q8_0: d, then 32 int8; w = q * d. */
static void block_q8_0(const uint8_t *b, float *out) {
    float d = half_at(b);
    store_scaled(out, d, bytes_signed(bytes_load(b + 2)));
    store_scaled(out + 16, d, bytes_signed(bytes_load(b + 18)));
}

/* Sub-block s's 6-bit scale and minimum in a K-quant's 12 scale bytes (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int s, const uint8_t *q, int *scale, int *minimum) {
    if (s < 4) {
        *scale = q[s] & 63, *minimum = q[s + 4] & 63;
    } else {
        *scale = (q[s + 4] & 0x0F) | ((q[s - 4] >> 6) << 4);
        *minimum = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
    }
}

/* Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles. Sub-block s (32 weights) takes the low
 * (s even) or high (s odd) nibbles of bytes 32 (s / 2) .. +31; w = (d * sc) * q - dmin * m. */
static void block_q4_k(const uint8_t *b, float *out) {
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *qs = b + 16;
    v16f table[8];
    for (int s = 0; s < 8; s++) {
        int sc, m;
        scale_min_k4(s, scales, &sc, &m);
        v16f d1 = v16_set1_ps(d * (float)sc), m1 = v16_set1_ps(dmin * (float)m);
        table[s] = v16_sub_ps(v16_mul_ps(d1, iota16()), m1);
    }
    for (int c = 0; c < 4; c++) /* bytes 32c.. hold sub-block 2c low, 2c + 1 high */
        for (int h = 0; h < 2; h++) nibbles_by_table(qs + 32 * c + 16 * h, table[2 * c], table[2 * c + 1], out + 64 * c + 16 * h, 32);
}

/* Q5_K: Q4_K's fields, with 32 bytes of fifth bits (bit s of byte l: sub-block s, weight l)
 * before the nibbles. */
static void block_q5_k(const uint8_t *b, float *out) {
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    for (int s = 0; s < 8; s++) {
        int sc, m;
        scale_min_k4(s, scales, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        for (int h = 0; h < 2; h++) {
            bytes16 low = bytes_field(bytes_load(qs + 32 * (s / 2) + 16 * h), 4 * (s & 1), 0x0F);
            bytes16 high = bytes_field(bytes_load(qh + 16 * h), s, 1);
            store_scaled_sub(out + 32 * s + 16 * h, d1, bytes_unsigned(bytes_join(low, high)), m1);
        }
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), d.
 * Weight 128 h + 32 p + l (p = 0..3, l = 0..31) takes nibble p / 2 of byte 64 h + 32 (p & 1) + l
 * and bits 2p..2p+1 of high byte 32 h + l; w = (d * sc) * (q - 32). */
static void block_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = half_at(b + 208);
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++)
            for (int half = 0; half < 2; half++) {
                int l = 16 * half;
                bytes16 low = bytes_field(bytes_load(ql + 64 * h + 32 * (p & 1) + l), 4 * (p / 2), 0x0F);
                bytes16 high = bytes_field(bytes_load(qh + 32 * h + l), 2 * p, 3);
                float ds = d * (float)scales[8 * h + 2 * p + half];
                store_scaled(out + 128 * h + 32 * p + l, ds, bytes_signed(bytes_sub(bytes_join(low, high), 32)));
            }
}

static void f16_values(const uint8_t *p, int64_t n, float *out) {
    int64_t i = 0;
#ifndef V16_SCALAR
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
    for (; i < n; i++) out[i] = half_at(p + 2 * i);
}

/* bf16 is fp32's top half: the bits shifted up, exact. */
static void bf16_values(const uint8_t *p, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        uint16_t half;
        memcpy(&half, p + 2 * i, sizeof half);
        uint32_t bits = (uint32_t)half << 16;
        memcpy(out + i, &bits, sizeof bits);
    }
}

/* Weights [first, first + n) of one row of W (`row` its first byte) as floats; first and n
 * are whole blocks. */
static void decode(int type, const uint8_t *row, int64_t block, int64_t bytes, int64_t first, int64_t n,
                   float *out) {
    const uint8_t *p = row + first / block * bytes;
    switch (type) {
        case F32: memcpy(out, p, sizeof(float) * (size_t)n); return;
        case F16: f16_values(p, n, out); return;
        case BF16: bf16_values(p, n, out); return;
        default: break;
    }
    void (*one)(const uint8_t *, float *) = type == Q4_0   ? block_q4_0
                                            : type == Q4_1 ? block_q4_1
                                            : type == Q5_0 ? block_q5_0
                                            : type == Q5_1 ? block_q5_1
                                            : type == Q8_0 ? block_q8_0
                                            : type == Q4_K ? block_q4_k
                                            : type == Q5_K ? block_q5_k
                                                           : block_q6_k;
    for (int64_t i = 0; i < n / block; i++) one(p + i * bytes, out + i * block);
}

/* acc [rows][COLS][16] += the span's weights [COLS][SPAN] times rows of x (x at the span's
 * first input, rows k apart), n inputs, the last chunk masked when n is not a multiple of 16.
 * Always inlined with a constant `rows`, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void multiply_span(const float *weights, int64_t n, const float *x,
                                                                int64_t k, int rows, float *acc) {
    v16f a[ROW_TILE][COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COLS; c++) a[r][c] = v16_loadu_ps(acc + (r * COLS + c) * LANES);
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int c = 0; c < COLS; c++) {
            v16f w = v16_loadu_ps(weights + c * SPAN + j);
            for (int r = 0; r < rows; r++) a[r][c] = v16_fmadd_ps(w, v16_loadu_ps(x + r * k + j), a[r][c]);
        }
    if (j < n) {
        v16mask mask = (v16mask)((1u << (n - j)) - 1u);
        for (int c = 0; c < COLS; c++) {
            v16f w = v16_maskz_loadu_ps(mask, weights + c * SPAN + j);
            for (int r = 0; r < rows; r++)
                a[r][c] = v16_fmadd_ps(w, v16_maskz_loadu_ps(mask, x + r * k + j), a[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < COLS; c++) v16_storeu_ps(acc + (r * COLS + c) * LANES, a[r][c]);
}

static void multiply_rows(const float *weights, int64_t n, const float *x, int64_t k, int rows, float *acc) {
    switch (rows) {
        case 1: multiply_span(weights, n, x, k, 1, acc); break;
        case 2: multiply_span(weights, n, x, k, 2 < ROW_TILE ? 2 : ROW_TILE, acc); break;
        case 3: multiply_span(weights, n, x, k, 3 < ROW_TILE ? 3 : ROW_TILE, acc); break;
        default: multiply_span(weights, n, x, k, ROW_TILE, acc);
    }
}

/* Columns [col, col + COLS) of y (those below n_out) for every row. */
static void column_tile(int type, const uint8_t *w, int64_t block, int64_t bytes, int64_t n_out, int64_t k,
                        const float *x, int64_t rows, const float *bias, float *y, int64_t col) {
    int cols = n_out - col < COLS ? (int)(n_out - col) : COLS;
    int64_t row_bytes = k / block * bytes;
    float weights[COLS * SPAN] __attribute__((aligned(64)));
    float acc[ROW_BLOCK * COLS * LANES] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int64_t block_rows = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        memset(acc, 0, sizeof(float) * (size_t)(block_rows * COLS * LANES));
        for (int64_t first = 0; first < k; first += SPAN) {
            int64_t n = k - first < SPAN ? k - first : SPAN;
            for (int c = 0; c < cols; c++) decode(type, w + (col + c) * row_bytes, block, bytes, first, n, weights + c * SPAN);
            /* columns past n_out: zeros, computed and never stored */
            for (int c = cols; c < COLS; c++) memset(weights + c * SPAN, 0, sizeof(float) * (size_t)n);
            for (int64_t t = 0; t < block_rows; t += ROW_TILE) {
                int tile = block_rows - t < ROW_TILE ? (int)(block_rows - t) : ROW_TILE;
                multiply_rows(weights, n, x + (r0 + t) * k + first, k, tile, acc + t * COLS * LANES);
            }
        }
        for (int64_t r = 0; r < block_rows; r++)
            for (int c = 0; c < cols; c++) {
                float sum = v16_reduce_add_ps(v16_loadu_ps(acc + (r * COLS + c) * LANES));
                y[(r0 + r) * n_out + col + c] = bias ? sum + bias[col + c] : sum;
            }
    }
}

/* y [rows, n_out] = x [rows, k] times W [n_out, k] of ggml type `type`, stored as the GGUF
 * does (n_out rows of k / block_weights blocks each), plus bias [n_out] unless it is NULL.
 * 0; -1 for a type not handled here; -2 when k is not a whole number of blocks. */
int gguf_linear(int type, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t rows,
                const float *bias, float *y, int threads) {
    int64_t block, bytes;
    if (!block_format(type, &block, &bytes)) return -1;
    if (k % block) return -2;
    int64_t tiles = (n_out + COLS - 1) / COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) column_tile(type, w, block, bytes, n_out, k, x, rows, bias, y, t * COLS);
    return 0;
}

/* W [n_rows, k] as floats, exactly the values gguf_linear multiplies by; the same return codes. */
int gguf_dequantize(int type, const uint8_t *w, int64_t n_rows, int64_t k, float *out, int threads) {
    int64_t block, bytes;
    if (!block_format(type, &block, &bytes)) return -1;
    if (k % block) return -2;
    int64_t row_bytes = k / block * bytes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n_rows; r++) decode(type, w + r * row_bytes, block, bytes, 0, k, out + r * k);
    return 0;
}

/* Bytes per block of `type` (weights per block into *weights), or 0 for a type not handled
 * here: the Python side checks its sizes against these. */
int64_t gguf_block_bytes(int type, int64_t *weights) {
    int64_t bytes;
    return block_format(type, weights, &bytes) ? bytes : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Integer activations, as llama.cpp computes a GGUF linear on the CPU.
 *
 *     y[r, o] = ggml_vec_dot_<type>_<q8>(W[o], quantize_row_<q8>_ref(x[r]))   (+ bias[o])
 *
 * Each row of x is quantized once per call exactly as ggml-quants.c's reference quantizers do:
 * Q8_K (256 inputs a block, d = max / -127 with the sign of the largest, nearest_int, bsums
 * of 16) for Q4_K, Q5_K and Q6_K; Q8_0 (32 a block, fp16 d = amax / 127, roundf) for Q4_0,
 * Q5_0 and Q8_0; Q8_1 (Q8_0 plus fp16 s = d * the sum of the quants) for Q4_1 and Q5_1.
 * Weight and activation quants then meet as integers, the sums exact in int32, and only the
 * block scales are floats: the function llama.cpp's ggml_vec_dot_* computes, up to the order
 * of the float sums, which is this kernel's own and fixed:
 *
 *   - A group is 256 inputs (a K-quant block; eight 32-input blocks) in four chunks of 64.
 *     Lane j (0..15) of a chunk is the exact integer sum of weight x activation over the
 *     chunk's inputs 4j..4j+3, which lie in one block (one K-quant sub-block) each.
 *   - K-quants: lane j of a group is the sum over its chunks of lane j times the lane's
 *     sub-block scale, still exact; then acc = fma(d_w * d_x, lane, acc) for each of 16 float
 *     lanes, and for Q4_K/Q5_K acc = fnma(dmin_w * d_x, min(g) * bsum(g), acc), lane g
 *     holding the g-th 16 inputs (the product exact).
 *   - 32-input blocks: per chunk, acc = fma(d_w * d_x of the lane's block, lane, acc), and for
 *     Q4_1/Q5_1 acc = fma(m_w, s_x, acc) in one lane per block.
 *   - y = v16_reduce_add_ps(acc) (+ bias), groups taken in order.
 *
 * The integer lanes are computed differently by each build (VNNI's vpdpbusd, AVX2's
 * pmaddubsw and pmaddwd, plain C) but are exact, and every float operation above is the same
 * IEEE operation in the same order on all three, so a row's result depends on that row and
 * the weights alone: not on the number of rows, the thread count (threads split the output
 * columns) or the build.
 * ------------------------------------------------------------------------------------------- */
#include <math.h>
#include <stdlib.h>

#define GROUP 256
#define CHUNK 64
#define CHUNKS (GROUP / CHUNK)

/* The VNNI build multiplies unsigned weights by signed activations (vpdpbusd): it stores each
 * weight plus 128 and adds -128 x each lane's activation sum back (act_group.offset). */
#ifdef V16_AVX512
#define WEIGHT_FLIP 0x80
#else
#define WEIGHT_FLIP 0
#endif
#define STORE_WEIGHT(value) ((int8_t)((uint8_t)(int8_t)(value) ^ WEIGHT_FLIP))

/* One row's 256 inputs, quantized; inputs past k are zeros. */
typedef struct {
    int8_t q[GROUP] __attribute__((aligned(64)));
    int32_t offset[CHUNKS][LANES] __attribute__((aligned(64))); /* VNNI: -128 x the lane's q sum */
    float d[CHUNKS][LANES] __attribute__((aligned(64)));        /* Q8_0/Q8_1: the lane's block d */
    float s[CHUNKS][LANES] __attribute__((aligned(64)));        /* Q8_1: the lane's block s */
    float bsums[LANES] __attribute__((aligned(64)));            /* Q8_K: sums of 16 quants */
    float dk;                                                   /* Q8_K: the block's d */
} act_group;

/* One output column's 256 weights as integers, with their scales. */
typedef struct {
    int8_t w[GROUP] __attribute__((aligned(64)));                /* STORE_WEIGHT of each */
    int32_t scale[CHUNKS][LANES] __attribute__((aligned(64)));   /* K-quants: the lane's sub-block scale */
    float d[CHUNKS][LANES] __attribute__((aligned(64)));         /* 32-weight blocks: the lane's block d */
    float m[CHUNKS][LANES] __attribute__((aligned(64)));         /* Q4_1/Q5_1: m in a block's first lane, 0 elsewhere */
    float mins[LANES] __attribute__((aligned(64)));              /* Q4_K/Q5_K: the min of inputs 16g..16g+15 */
    float dk, dmin;                                              /* K-quants */
} weight_group;

/* fp32 to fp16 bits, rounding to nearest even (ggml's GGML_FP32_TO_FP16; F16C's vcvtps2ph). */
#ifdef V16_SCALAR
static uint16_t float_to_half(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t sign = (bits >> 16) & 0x8000, magnitude = bits & 0x7FFFFFFF;
    if (magnitude > 0x7F800000) return (uint16_t)(sign | 0x7E00); /* NaN */
    if (magnitude >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* rounds past 65504: inf */
    if (magnitude < 0x38800000) { /* fp16 subnormal or zero: units of 2^-24, to nearest even */
        float scaled = fabsf(value) * 0x1p24f; /* exact: a power of two */
        return (uint16_t)(sign | (uint32_t)nearbyintf(scaled));
    }
    uint32_t rounded = magnitude + 0xFFF + ((magnitude >> 13) & 1);
    return (uint16_t)(sign | (rounded - 0x38000000) >> 13);
}
#else
static inline uint16_t float_to_half(float value) { return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT); }
#endif

/* The fp16 rounding of an fp32, back as fp32. */
static inline float half_rounded(float value) { return half_to_float(float_to_half(value)); }

/* ggml-quants.c's nearest_int: to nearest, ties to even, for |value| < 2^22. */
static inline int nearest_int(float value) {
    float shifted = value + 12582912.f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007FFFFF) - 0x00400000;
}

/* quantize_row_q8_K_ref on 256 inputs. */
static void quantize_q8_k(const float *x, act_group *a) {
    float max = 0, amax = 0;
    for (int j = 0; j < GROUP; j++) {
        float ax = fabsf(x[j]);
        if (ax > amax) amax = ax, max = x[j];
    }
    memset(a->bsums, 0, sizeof a->bsums);
    if (!amax) {
        a->dk = 0;
        memset(a->q, 0, sizeof a->q);
        return;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < GROUP; j++) {
        int v = nearest_int(iscale * x[j]);
        a->q[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int g = 0; g < LANES; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += a->q[16 * g + i];
        a->bsums[g] = (float)sum;
    }
    a->dk = 1 / iscale;
}

/* quantize_row_q8_0_ref (with_sum: quantize_row_q8_1_ref) on n <= 256 inputs, n a multiple
 * of 32; the rest of the group zero. */
static void quantize_q8_0(const float *x, int n, int with_sum, act_group *a) {
    memset(a->q, 0, sizeof a->q);
    memset(a->d, 0, sizeof a->d);
    memset(a->s, 0, sizeof a->s);
    for (int b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = amax > fabsf(xb[j]) ? amax : fabsf(xb[j]);
        const float d = amax / ((1 << 7) - 1);
        const float id = d ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            a->q[32 * b + j] = (int8_t)roundf(xb[j] * id);
            sum += a->q[32 * b + j];
        }
        float *d_lanes = a->d[b / 2] + 8 * (b % 2), *s_lanes = a->s[b / 2] + 8 * (b % 2);
        for (int j = 0; j < 8; j++) d_lanes[j] = half_rounded(d);
        if (with_sum) s_lanes[0] = half_rounded((float)sum * d);
    }
}

/* The VNNI build's correction for its weights' +128: -128 x each lane's four quants. */
static void lane_offsets(act_group *a) {
    for (int c = 0; c < CHUNKS; c++)
        for (int j = 0; j < LANES; j++) {
            const int8_t *q = a->q + CHUNK * c + 4 * j;
            a->offset[c][j] = -128 * (q[0] + q[1] + q[2] + q[3]);
        }
}

/* Which activation blocks a weight type meets: 'K' (Q8_K), '0' (Q8_0), '1' (Q8_1), 0: none. */
static int activation_kind(int type) {
    switch (type) {
        case Q4_K: case Q5_K: case Q6_K: return 'K';
        case Q4_0: case Q5_0: case Q8_0: return '0';
        case Q4_1: case Q5_1: return '1';
        default: return 0;
    }
}

/* Row x [k] into groups [ceil(k / 256)]. */
static void quantize_row(int kind, const float *x, int64_t k, act_group *groups) {
    for (int64_t g = 0; g * GROUP < k; g++) {
        int n = k - g * GROUP < GROUP ? (int)(k - g * GROUP) : GROUP;
        if (kind == 'K')
            quantize_q8_k(x + g * GROUP, groups + g);
        else
            quantize_q8_0(x + g * GROUP, n, kind == '1', groups + g);
        lane_offsets(groups + g);
    }
}

/* ---- weights: one column's group of 256 (or the last, shorter one) as integers ---- */

/* Lane scales of a K-quant: lane j of chunk c covers inputs 64c + 4j.., in sub-block 2c + j / 8
 * of 32 inputs, or 4c + j / 4 of 16. */
static inline void lane_scales_32(weight_group *g, const int *scale) {
    for (int s = 0; s < 8; s++) {
#ifndef V16_SCALAR
        _mm256_store_si256((__m256i *)(g->scale[s / 2] + 8 * (s % 2)), _mm256_set1_epi32(scale[s]));
#else
        for (int j = 0; j < 8; j++) g->scale[s / 2][8 * (s % 2) + j] = scale[s];
#endif
    }
}
static inline void lane_scales_16(weight_group *g, const int *scale) {
    for (int s = 0; s < 16; s++) {
#ifndef V16_SCALAR
        _mm_store_si128((__m128i *)(g->scale[s / 4] + 4 * (s % 4)), _mm_set1_epi32(scale[s]));
#else
        for (int j = 0; j < 4; j++) g->scale[s / 4][4 * (s % 4) + j] = scale[s];
#endif
    }
}

/* The 8 scales and 8 mins of a K-quant's 12 scale bytes, as scale_min_k4 reads them, without
 * branches (ggml's kmask form). */
static inline void scales_mins_k4(const uint8_t *bytes, int *sc, int *m) {
    uint32_t u[4];
    memcpy(u, bytes, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    uint32_t low_mins = u[1] & six;
    u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    u[2] = low_mins;
    u[0] &= six;
    uint8_t bytes_out[16];
    memcpy(bytes_out, u, sizeof bytes_out);
    for (int s = 0; s < 8; s++) sc[s] = bytes_out[s], m[s] = bytes_out[8 + s];
}

static void group_q4_k(const uint8_t *b, weight_group *g) {
    int sc[8], m[8];
    scales_mins_k4(b + 4, sc, m);
    const uint8_t *qs = b + 16;
#ifndef V16_SCALAR
    const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)WEIGHT_FLIP);
    for (int c = 0; c < 4; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        _mm256_store_si256((__m256i *)(g->w + 64 * c), _mm256_xor_si256(_mm256_and_si256(v, nibble), flip));
        _mm256_store_si256((__m256i *)(g->w + 64 * c + 32),
                           _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), flip));
    }
#else
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            g->w[64 * c + l] = STORE_WEIGHT(qs[32 * c + l] & 0x0F);
            g->w[64 * c + 32 + l] = STORE_WEIGHT(qs[32 * c + l] >> 4);
        }
#endif
    lane_scales_32(g, sc);
    for (int i = 0; i < LANES; i++) g->mins[i] = (float)m[i / 2];
    g->dk = half_at(b), g->dmin = half_at(b + 2);
}

static void group_q5_k(const uint8_t *b, weight_group *g) {
    int sc[8], m[8];
    scales_mins_k4(b + 4, sc, m);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int s = 0; s < 8; s++)
        for (int l = 0; l < 32; l++)
            g->w[32 * s + l] = STORE_WEIGHT(((qs[32 * (s / 2) + l] >> 4 * (s & 1)) & 0x0F) | ((qh[l] >> s) & 1) << 4);
    lane_scales_32(g, sc);
    for (int i = 0; i < LANES; i++) g->mins[i] = (float)m[i / 2];
    g->dk = half_at(b), g->dmin = half_at(b + 2);
}

static void group_q6_k(const uint8_t *b, weight_group *g) {
    const uint8_t *ql = b, *qh = b + 128;
    int sc[16];
    for (int i = 0; i < 16; i++) sc[i] = ((const int8_t *)(b + 192))[i];
#ifndef V16_SCALAR
    const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3), minus = _mm256_set1_epi8(32),
                  flip = _mm256_set1_epi8((char)WEIGHT_FLIP);
    for (int h = 0; h < 2; h++) {
        __m256i high = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        for (int p = 0; p < 4; p++) {
            __m256i low = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (p & 1)));
            low = _mm256_and_si256(_mm256_srli_epi16(low, 4 * (p / 2)), nibble);
            __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * p), two), 4);
            __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, top), minus);
            _mm256_store_si256((__m256i *)(g->w + 128 * h + 32 * p), _mm256_xor_si256(q, flip));
        }
    }
#else
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++) {
                int low = (ql[64 * h + 32 * (p & 1) + l] >> 4 * (p / 2)) & 0x0F, high = (qh[32 * h + l] >> 2 * p) & 3;
                g->w[128 * h + 32 * p + l] = STORE_WEIGHT((low | high << 4) - 32);
            }
#endif
    lane_scales_16(g, sc);
    g->dk = half_at(b + 208);
}

/* A 32-weight block's scale d (and m, or 0) into the lanes of its half chunk. */
static void block_scales(weight_group *g, int block, float d, float m) {
    float *d_lanes = g->d[block / 2] + 8 * (block % 2), *m_lanes = g->m[block / 2] + 8 * (block % 2);
    for (int j = 0; j < 8; j++) d_lanes[j] = d, m_lanes[j] = 0.0f;
    m_lanes[0] = m;
}

/* Weights 16 + j take bit 16 + j of qh; the low and high nibbles as Q4_0's. */
static void nibbles_q5(const uint8_t *qs, uint32_t qh, int minus, int8_t *w) {
    for (int j = 0; j < 16; j++) {
        w[j] = STORE_WEIGHT(((qs[j] & 0x0F) | ((qh >> j) & 1) << 4) - minus);
        w[16 + j] = STORE_WEIGHT(((qs[j] >> 4) | ((qh >> (16 + j)) & 1) << 4) - minus);
    }
}

static void block_int(int type, const uint8_t *b, int block, weight_group *g) {
    int8_t *w = g->w + 32 * block;
    uint32_t qh;
    switch (type) {
        case Q4_0:
        case Q4_1: {
            int minus = type == Q4_0 ? 8 : 0;
            const uint8_t *qs = b + (type == Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) {
                w[j] = STORE_WEIGHT((qs[j] & 0x0F) - minus);
                w[16 + j] = STORE_WEIGHT((qs[j] >> 4) - minus);
            }
            block_scales(g, block, half_at(b), type == Q4_1 ? half_at(b + 2) : 0.0f);
            return;
        }
        case Q5_0:
            memcpy(&qh, b + 2, sizeof qh);
            nibbles_q5(b + 6, qh, 16, w);
            block_scales(g, block, half_at(b), 0.0f);
            return;
        case Q5_1:
            memcpy(&qh, b + 4, sizeof qh);
            nibbles_q5(b + 8, qh, 0, w);
            block_scales(g, block, half_at(b), half_at(b + 2));
            return;
        default: /* Q8_0 */
            for (int j = 0; j < 32; j++) w[j] = STORE_WEIGHT((int8_t)b[2 + j]);
            block_scales(g, block, half_at(b), 0.0f);
    }
}

/* Group `index` of one column's row of blocks (`row`, k inputs) into g. */
static void weight_group_at(int type, const uint8_t *row, int64_t bytes, int64_t k, int64_t index, weight_group *g) {
    switch (type) {
        case Q4_K: group_q4_k(row + index * bytes, g); return;
        case Q5_K: group_q5_k(row + index * bytes, g); return;
        case Q6_K: group_q6_k(row + index * bytes, g); return;
        default: break;
    }
    int64_t first = index * (GROUP / 32), blocks = (k - index * GROUP) / 32;
    if (blocks > GROUP / 32) blocks = GROUP / 32;
    for (int b = 0; b < blocks; b++) block_int(type, row + (first + b) * bytes, b, g);
    if (blocks % 2) { /* the last chunk's second half: no weights */
        memset(g->w + 32 * blocks, STORE_WEIGHT(0), 32);
        block_scales(g, (int)blocks, 0.0f, 0.0f);
    }
}

/* ---- the integer lanes ---- */

#if defined(V16_AVX512)
typedef __m512i lanes32;
static inline lanes32 lanes_zero(void) { return _mm512_setzero_si512(); }
/* Lane j: sum of w x q over bytes 4j..4j+3 of the chunk. */
static inline lanes32 chunk_dot(const int8_t *w, const act_group *a, int c) {
    return _mm512_dpbusd_epi32(_mm512_load_si512(a->offset[c]), _mm512_load_si512(w), _mm512_load_si512(a->q + CHUNK * c));
}
static inline lanes32 lanes_add_scaled(lanes32 sum, lanes32 v, const int32_t *scale) {
    return _mm512_add_epi32(sum, _mm512_mullo_epi32(v, _mm512_load_si512(scale)));
}
static inline v16f lanes_float(lanes32 v) { return _mm512_cvtepi32_ps(v); }
#elif defined(V16_AVX2)
typedef struct {
    __m256i lo, hi;
} lanes32;
static inline lanes32 lanes_zero(void) { return (lanes32){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
/* |w| x (q with w's sign): pairs of products fit int16 (at most 2 x 128 x 127). */
static inline __m256i half_dot(const int8_t *w, const int8_t *q) {
    __m256i wv = _mm256_load_si256((const __m256i *)w), qv = _mm256_load_si256((const __m256i *)q);
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
static inline lanes32 chunk_dot(const int8_t *w, const act_group *a, int c) {
    const int8_t *q = a->q + CHUNK * c;
    return (lanes32){half_dot(w, q), half_dot(w + 32, q + 32)};
}
static inline lanes32 lanes_add_scaled(lanes32 sum, lanes32 v, const int32_t *scale) {
    __m256i lo = _mm256_mullo_epi32(v.lo, _mm256_load_si256((const __m256i *)scale));
    __m256i hi = _mm256_mullo_epi32(v.hi, _mm256_load_si256((const __m256i *)(scale + 8)));
    return (lanes32){_mm256_add_epi32(sum.lo, lo), _mm256_add_epi32(sum.hi, hi)};
}
static inline v16f lanes_float(lanes32 v) { return (v16f){_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
#else
typedef struct {
    int32_t i[LANES];
} lanes32;
static inline lanes32 lanes_zero(void) { return (lanes32){{0}}; }
static inline lanes32 chunk_dot(const int8_t *w, const act_group *a, int c) {
    const int8_t *q = a->q + CHUNK * c;
    lanes32 r;
    for (int j = 0; j < LANES; j++) {
        int32_t sum = 0;
        for (int t = 0; t < 4; t++) sum += w[4 * j + t] * q[4 * j + t];
        r.i[j] = sum;
    }
    return r;
}
static inline lanes32 lanes_add_scaled(lanes32 sum, lanes32 v, const int32_t *scale) {
    for (int j = 0; j < LANES; j++) sum.i[j] += v.i[j] * scale[j];
    return sum;
}
static inline v16f lanes_float(lanes32 v) {
    v16f r;
    for (int j = 0; j < LANES; j++) r.f[j] = (float)v.i[j];
    return r;
}
#endif

/* acc plus one column's group times one row's: the float steps in the header's order. */
static inline v16f group_dot(int type, const weight_group *w, const act_group *a, int chunks, v16f acc) {
    if (activation_kind(type) == 'K') {
        lanes32 sum = lanes_zero();
        for (int c = 0; c < CHUNKS; c++) sum = lanes_add_scaled(sum, chunk_dot(w->w + CHUNK * c, a, c), w->scale[c]);
        acc = v16_fmadd_ps(v16_set1_ps(w->dk * a->dk), lanes_float(sum), acc);
        if (type != Q6_K)
            acc = v16_fnmadd_ps(v16_set1_ps(w->dmin * a->dk), v16_mul_ps(v16_loadu_ps(w->mins), v16_loadu_ps(a->bsums)), acc);
        return acc;
    }
    for (int c = 0; c < chunks; c++) {
        v16f d = v16_mul_ps(v16_loadu_ps(w->d[c]), v16_loadu_ps(a->d[c]));
        acc = v16_fmadd_ps(d, lanes_float(chunk_dot(w->w + CHUNK * c, a, c)), acc);
        if (type == Q4_1 || type == Q5_1) acc = v16_fmadd_ps(v16_loadu_ps(w->m[c]), v16_loadu_ps(a->s[c]), acc);
    }
    return acc;
}

/* Columns [col, col + COLS) of y (those below n_out) for every row. */
static void int_column_tile(int type, const uint8_t *w, int64_t block, int64_t bytes, int64_t n_out, int64_t k,
                            const act_group *acts, int64_t rows, const float *bias, float *y, int64_t col) {
    int cols = n_out - col < COLS ? (int)(n_out - col) : COLS;
    int64_t groups = (k + GROUP - 1) / GROUP, per_row = k / block * bytes;
    weight_group decoded[COLS];
    float acc[ROW_BLOCK][COLS][LANES] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int64_t block_rows = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        memset(acc, 0, sizeof acc[0] * (size_t)block_rows);
        for (int64_t g = 0; g < groups; g++) {
            int chunks = (int)((k - g * GROUP + CHUNK - 1) / CHUNK);
            if (chunks > CHUNKS) chunks = CHUNKS;
            for (int c = 0; c < cols; c++) weight_group_at(type, w + (col + c) * per_row, bytes, k, g, &decoded[c]);
            for (int64_t r = 0; r < block_rows; r++) {
                const act_group *a = acts + (r0 + r) * groups + g;
                for (int c = 0; c < cols; c++)
                    v16_storeu_ps(acc[r][c], group_dot(type, &decoded[c], a, chunks, v16_loadu_ps(acc[r][c])));
            }
        }
        for (int64_t r = 0; r < block_rows; r++)
            for (int c = 0; c < cols; c++) {
                float sum = v16_reduce_add_ps(v16_loadu_ps(acc[r][c]));
                y[(r0 + r) * n_out + col + c] = bias ? sum + bias[col + c] : sum;
            }
    }
}

/* y [rows, n_out] = x [rows, k] times W [n_out, k] as llama.cpp computes it: x quantized to
 * the Q8 blocks W's type meets, integer block products (see above). 0; -1 for a type with no
 * integer path here (the float types); -2 when k is not a whole number of blocks; -3 when
 * memory for the quantized rows cannot be had. */
int gguf_linear_q8(int type, const uint8_t *w, int64_t n_out, int64_t k, const float *x, int64_t rows,
                   const float *bias, float *y, int threads) {
    int64_t block, bytes;
    int kind = activation_kind(type);
    if (!kind || !block_format(type, &block, &bytes)) return -1;
    if (k % block) return -2;
    int64_t groups = (k + GROUP - 1) / GROUP;
    act_group *acts = aligned_alloc(64, sizeof(act_group) * (size_t)(rows * groups > 0 ? rows * groups : 1));
    if (!acts) return -3;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) quantize_row(kind, x + r * k, k, acts + r * groups);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (n_out + COLS - 1) / COLS; t++)
            int_column_tile(type, w, block, bytes, n_out, k, acts, rows, bias, y, t * COLS);
    }
    free(acts);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Q4_K and Q6_K repacked into int4_cpu.c's layouts K4 and K6, whose kernel (int4_linear_repacked)
 * multiplies them at the pace of int4's own weights. Nothing of the file's values changes: each
 * q value, d and sc is moved as it is (dmin with its sign flipped), and the kernel forms each
 * scale as the dequantization does, d * sc, exact in fp32; so (d * sc) * q + (-dmin * m) (Q4_K)
 * and (d * sc) * (q - 32) (Q6_K) are the file's weights.
 */
void int4_place(uint8_t *blk, int bits, int c, const uint8_t q[32]);
int64_t int4_repacked_bytes(int64_t n_out, int64_t k, int bits);
int64_t int4_repacked_head(int64_t g, int bits);
int64_t int4_repacked_group(int64_t g, int bits);

/* One K-quant block of one channel: its fp16 d and -dmin (Q4_K), and per group of 32 the q
 * values and two bytes (Q4_K: sc and m; Q6_K: the int8 sc of inputs 0..15 and of 16..31). */
typedef struct {
    uint16_t d, minus_dmin;
    uint8_t q[8][32], first[8], second[8];
} k_block;

/* Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles (sub-block s: the low (s even) or high
 * nibbles of bytes 32 (s / 2) ..). */
static void read_q4_k(const uint8_t *b, k_block *out) {
    memcpy(&out->d, b, 2);
    memcpy(&out->minus_dmin, b + 2, 2);
    out->minus_dmin ^= 0x8000; /* the sign bit: -dmin exactly */
    for (int s = 0; s < 8; s++) {
        int sc, m;
        scale_min_k4(s, b + 4, &sc, &m);
        out->first[s] = (uint8_t)sc, out->second[s] = (uint8_t)m;
        for (int l = 0; l < 32; l++) out->q[s][l] = (uint8_t)((b[16 + 32 * (s / 2) + l] >> (4 * (s & 1))) & 0x0F);
    }
}

/* Q6_K (group 4h + p: weights 128 h + 32 p ..): q values 0..63, and the int8 scales. */
static void read_q6_k(const uint8_t *b, k_block *out) {
    const uint8_t *ql = b, *qh = b + 128, *scales = b + 192;
    memcpy(&out->d, b + 208, 2);
    out->minus_dmin = 0;
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 4; p++) {
            int g = 4 * h + p;
            out->first[g] = scales[8 * h + 2 * p], out->second[g] = scales[8 * h + 2 * p + 1];
            for (int l = 0; l < 32; l++) {
                int low = (ql[64 * h + 32 * (p & 1) + l] >> (4 * (p / 2))) & 0x0F;
                int high = (qh[32 * h + l] >> (2 * p)) & 3;
                out->q[g][l] = (uint8_t)(low | high << 4);
            }
        }
}

/* W [n_out, k] of `type` (Q4_K or Q6_K, as the GGUF stores it) into `packed`, which holds
 * gguf_repacked_bytes(type, n_out, k) bytes; channels past n_out are zero. 0; -1 for another
 * type; -2 when k is not a whole number of blocks. */
int gguf_repack(int type, const uint8_t *w, int64_t n_out, int64_t k, uint8_t *packed, int threads) {
    if (type != Q4_K && type != Q6_K) return -1;
    if (k % 256) return -2;
    const int bits = type == Q4_K ? 4 : 6, lanes = 16;
    const int64_t supers = k / 256, stride = int4_repacked_bytes(lanes, k, bits);
    const int64_t row_bytes = supers * (type == Q4_K ? 144 : 210), blocks = (n_out + lanes - 1) / lanes;
    const int64_t scales_at = 4 * 64 + (bits == 6 ? 2 * 64 : 0);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t *out = packed + b * stride;
        memset(out, 0, (size_t)stride);
        for (int c = 0; c < lanes && b * lanes + c < n_out; c++) {
            const uint8_t *row = w + (b * lanes + c) * row_bytes;
            for (int64_t s = 0; s < supers; s++) {
                k_block block;
                if (type == Q4_K)
                    read_q4_k(row + s * 144, &block);
                else
                    read_q6_k(row + s * 210, &block);
                uint8_t *head = out + int4_repacked_head(8 * s, bits);
                memcpy(head + 2 * c, &block.d, 2);
                memcpy(head + 32 + 2 * c, &block.minus_dmin, 2);
                for (int j = 0; j < 8; j++) {
                    uint8_t *group = out + int4_repacked_group(8 * s + j, bits);
                    int4_place(group, bits, c, block.q[j]);
                    group[scales_at + c] = block.first[j];
                    group[scales_at + lanes + c] = block.second[j];
                }
            }
        }
    }
    return 0;
}

/* The bytes gguf_repack writes for W [n_out, k] of `type`; 0 for a type it does not take. */
int64_t gguf_repacked_bytes(int type, int64_t n_out, int64_t k) {
    if ((type != Q4_K && type != Q6_K) || k % 256) return 0;
    return int4_repacked_bytes(n_out, k, type == Q4_K ? 4 : 6);
}
