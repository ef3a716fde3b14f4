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
 * Q4_K and Q6_K repacked into int4_cpu.c's layouts K4 and K6, whose kernel (int4_linear)
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
