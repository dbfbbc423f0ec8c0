/* SwiGLU experts on the CPU, read straight from their slot form (the bytes a GPU slot holds).
 *
 * The `cpu` and `hybrid` MoE backends compute misses from the pinned host banks. Dequantizing a
 * whole expert to fp32 in PyTorch first costs milliseconds; this kernel streams each weight row
 * once instead: a row is decoded into a small fp32 buffer (L1-resident) and multiplied with each
 * of the expert's tokens (up to four at a time), or, for an expert with a lone token (most of a
 * decode step's), multiplied straight from the codes (`dot_row`: each scale group's products
 * summed, then scaled; bf16 and fp16 values converted in registers). Rows are split among
 * OpenMP threads in two passes (gate/up, then down) for all of a call's experts.
 * moeferry/ops/cpu/experts.py builds it with the system C compiler on first use and calls it
 * through ctypes (which releases the GIL).
 * Slot layouts: moeferry/ops/triton/moe_formats.py. fp32 arithmetic throughout; the decoded
 * weights equal the PyTorch reference's (`<form>_dequant`) bit for bit (but for E4M3's NaN codes,
 * which no weight holds: they decode as 480); only the order of the dot products' sums differs
 * (and, on the lone-token path, where the group scale is applied).
 *
 * E2M1 and E4M3 codes are decoded through fp16 bit patterns (the trick of the Triton steps): the
 * code's magnitude bits placed in an fp16's exponent and mantissa give value / 2^14 (E2M1) or
 * value / 2^8 (E4M3), subnormals included, and the power of two is folded into the scale.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define MF_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MF_AVX512 1 /* 16-wide decode and dot products where the CPU has them; AVX2 covers the rest */
#endif
#endif

enum { FORM_DENSE = 0, FORM_FP8_ROW = 1, FORM_FP8_BLOCK = 2, FORM_FP4 = 3, FORM_INT4 = 4 };
enum { T_F32 = 0, T_BF16 = 1, T_F16 = 2 };

/* One weight matrix [n, k] of a bank (mirrors SlotMatrix). Byte strides per slot. */
typedef struct {
    int32_t form;
    int32_t dtype;      /* dense: the weights' type; int4: the scales' type */
    int32_t n, k, part, group, group_n, s_cols;
    const uint8_t *w, *s, *z, *rs;
    int64_t w_slot, s_slot, z_slot, rs_slot;
} matrix_t;

#define E2M1_UNIT 16384.0f /* E2M1 through fp16 bits is value / 2^14 */
#define E4M3_UNIT 256.0f   /* E4M3 through fp16 bits is value / 2^8 */

static float half_bits_to_float(uint16_t h) {
#ifdef MF_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u, bits;
    float v;
    if (e == 0) {
        v = ldexpf((float)m, -24);
        memcpy(&bits, &v, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&v, &bits, 4);
    return v;
#endif
}

static float bf16_bits_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static uint16_t e2m1_half(uint32_t code) { return (uint16_t)(((code & 8u) << 12) | ((code & 7u) << 9)); }
static uint16_t e4m3_half(uint32_t code) { return (uint16_t)(((code & 0x80u) << 8) | ((code & 0x7fu) << 7)); }
static float e4m3(uint8_t code) { return half_bits_to_float(e4m3_half(code)) * E4M3_UNIT; }

static int type_size(int dtype) { return dtype == T_F32 ? 4 : 2; }

/* Element g of a row of fp32, bf16 or fp16 values. */
static float element(const uint8_t *row, int dtype, int g) {
    if (dtype == T_F32) {
        float v;
        memcpy(&v, row + 4 * (int64_t)g, 4);
        return v;
    }
    uint16_t h;
    memcpy(&h, row + 2 * (int64_t)g, 2);
    return dtype == T_BF16 ? bf16_bits_to_float(h) : half_bits_to_float(h);
}

#ifdef MF_AVX2
/* 8 bytes -> 16 nibbles as u16, in element order (byte j: low nibble = element 2j). */
static inline void nibbles16(const uint8_t *p, __m128i *a, __m128i *b) {
    __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i lo = _mm_and_si128(w, _mm_set1_epi16(15)), hi = _mm_srli_epi16(w, 4);
    *a = _mm_unpacklo_epi16(lo, hi);
    *b = _mm_unpackhi_epi16(lo, hi);
}

static inline __m256 e4m3x8(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7));
    return _mm256_cvtph_ps(h);
}

#ifdef MF_AVX512
/* 16 E4M3 codes -> their values / 2^8 (as `e4m3x8`, 16 at a time). */
static inline __m512 e4m3x16(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
}
#endif

static inline __m256 u16x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(v)); }

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* 16 bytes -> their 32 nibbles as bytes, in element order (each u16 lane: low | high << 8). */
static inline __m256i codes32(const uint8_t *p) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi16(15)),
                           _mm256_slli_epi16(_mm256_srli_epi16(w, 4), 8));
}

/* An E2M1 code's fp16 bits have a zero low byte: the high byte, looked up by code. */
static inline __m128i e2m1_high_bytes(void) {
    return _mm_setr_epi8(0x00, 0x02, 0x04, 0x06, 0x08, 0x0a, 0x0c, 0x0e, (char)0x80, (char)0x82, (char)0x84,
                         (char)0x86, (char)0x88, (char)0x8a, (char)0x8c, (char)0x8e);
}

/* 8 bytes of E2M1 codes -> their 16 values / 2^14, in element order (`lo`: elements 0-7). */
static inline void e2m1x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m128i low4 = _mm_set1_epi8(15), zero = _mm_setzero_si128();
    __m128i b = _mm_loadl_epi64((const __m128i *)p);
    __m128i halves = _mm_shuffle_epi8(e2m1_high_bytes(),
                                      _mm_unpacklo_epi8(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4)));
    *lo = _mm256_cvtph_ps(_mm_unpacklo_epi8(zero, halves));
    *hi = _mm256_cvtph_ps(_mm_unpackhi_epi8(zero, halves));
}
#endif

/* An fp4 row of k elements (k even); `sc` = the row's e4m3 scales (one per 16 elements). */
static void fp4_row(const uint8_t *w, const uint8_t *sc, float rs, int k, float *out) {
    int k0 = 0;
#ifdef MF_AVX2
    float scale[8];
    const __m256 unit = _mm256_set1_ps(rs * E2M1_UNIT * E4M3_UNIT);
    for (; k0 + 128 <= k; k0 += 128) {  /* eight groups: their scales decoded together */
        _mm256_storeu_ps(scale, _mm256_mul_ps(e4m3x8(sc + k0 / 16), unit));
#ifdef MF_AVX512
        for (int g = 0; g < 8; g += 2) {  /* two groups, 32 codes, a step */
            int at = k0 + 16 * g;
            __m256i halves = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(e2m1_high_bytes()), codes32(w + at / 2));
            __m512i bits = _mm512_slli_epi16(_mm512_cvtepu8_epi16(halves), 8);
            _mm512_storeu_ps(out + at, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(bits)),
                                                     _mm512_set1_ps(scale[g])));
            _mm512_storeu_ps(out + at + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1)),
                                                          _mm512_set1_ps(scale[g + 1])));
        }
#else
        for (int g = 0; g < 8; g++) {
            int at = k0 + 16 * g;
            __m256 s = _mm256_broadcast_ss(scale + g), lo, hi;
            e2m1x16(w + at / 2, &lo, &hi);
            _mm256_storeu_ps(out + at, _mm256_mul_ps(lo, s));
            _mm256_storeu_ps(out + at + 8, _mm256_mul_ps(hi, s));
        }
#endif
    }
#endif
    for (int i = k0; i < k; i += 2) {
        float s = e4m3(sc[i / 16]) * rs * E2M1_UNIT;
        uint8_t byte = w[i / 2];
        out[i] = half_bits_to_float(e2m1_half(byte & 15u)) * s;
        out[i + 1] = half_bits_to_float(e2m1_half(byte >> 4)) * s;
    }
}

/* dot(fp4 row, x) for one token, without the decoded row: each group's products are summed
 * unscaled and the group's scale multiplies the partial sum (a lone token's hot path). */
static float fp4_dot(const uint8_t *w, const uint8_t *sc, float rs, const float *x, int k) {
    int k0 = 0;
    float sum = 0.0f;
#ifdef MF_AVX2
    const __m256 unit = _mm256_set1_ps(rs * E2M1_UNIT * E4M3_UNIT);
    __m256 total = _mm256_setzero_ps();
    float scale[8];
    for (; k0 + 128 <= k; k0 += 128) {
        _mm256_storeu_ps(scale, _mm256_mul_ps(e4m3x8(sc + k0 / 16), unit));
        for (int g = 0; g < 8; g++) {
            int at = k0 + 16 * g;
            __m256 lo, hi;
            e2m1x16(w + at / 2, &lo, &hi);
            __m256 part = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + at + 8), _mm256_mul_ps(lo, _mm256_loadu_ps(x + at)));
            total = _mm256_fmadd_ps(part, _mm256_broadcast_ss(scale + g), total);
        }
    }
    sum = hsum8(total);
#endif
    for (int i = k0; i < k; i += 2) {
        float s = e4m3(sc[i / 16]) * rs * E2M1_UNIT;
        uint8_t byte = w[i / 2];
        sum += (half_bits_to_float(e2m1_half(byte & 15u)) * x[i] + half_bits_to_float(e2m1_half(byte >> 4)) * x[i + 1]) * s;
    }
    return sum;
}

static void int4_span(const uint8_t *w, const uint8_t *sc, const uint8_t *zp, int dtype, int group,
                      int k0, int k1, float *out) {
    int k = k0;
#ifdef MF_AVX512
    for (; group % 32 == 0 && k + 32 <= k1 && k % 32 == 0; k += 32) {
        int g = k / group;
        __m512 s = _mm512_set1_ps(element(sc, dtype, g)), z = _mm512_set1_ps(zp ? (float)zp[g] : 8.0f);
        __m256i c = codes32(w + k / 2);
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)));
        _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_sub_ps(lo, z), s));
        _mm512_storeu_ps(out + k + 16, _mm512_mul_ps(_mm512_sub_ps(hi, z), s));
    }
#endif
#ifdef MF_AVX2
    for (; group % 16 == 0 && k + 16 <= k1 && k % 16 == 0; k += 16) {
        int g = k / group;
        __m256 s = _mm256_set1_ps(element(sc, dtype, g)), z = _mm256_set1_ps(zp ? (float)zp[g] : 8.0f);
        __m128i a, b;
        nibbles16(w + k / 2, &a, &b);
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_sub_ps(u16x8(a), z), s));
        _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(_mm256_sub_ps(u16x8(b), z), s));
    }
#endif
    for (; k < k1; k += 2) {
        uint8_t byte = w[k / 2];
        for (int j = 0; j < 2; j++) {
            int g = (k + j) / group;
            float z = zp ? (float)zp[g] : 8.0f;
            out[k + j] = ((float)(j ? byte >> 4 : byte & 15u) - z) * element(sc, dtype, g);
        }
    }
}

/* Elements [k0, k1) of an e4m3 row times `scale` (the caller splits rows at scale groups). */
static void fp8_span(const uint8_t *w, float scale, int k0, int k1, float *out) {
    int k = k0;
#ifdef MF_AVX512
    for (__m512 s16 = _mm512_set1_ps(scale * E4M3_UNIT); k + 16 <= k1; k += 16)
        _mm512_storeu_ps(out + k, _mm512_mul_ps(e4m3x16(w + k), s16));
#endif
#ifdef MF_AVX2
    __m256 s = _mm256_set1_ps(scale * E4M3_UNIT);
    for (; k + 8 <= k1; k += 8)
        _mm256_storeu_ps(out + k, _mm256_mul_ps(e4m3x8(w + k), s));
#endif
    for (; k < k1; k++) out[k] = e4m3(w[k]) * scale;
}

static void dense_span(const uint8_t *w, int dtype, int k0, int k1, float *out) {
    int k = k0;
    const uint16_t *h = (const uint16_t *)w;
#ifdef MF_AVX2
    for (; dtype != T_F32 && k + 8 <= k1; k += 8) {
        __m128i v = _mm_loadu_si128((const __m128i *)(h + k));
        __m256 f = dtype == T_F16 ? _mm256_cvtph_ps(v)
                                  : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
        _mm256_storeu_ps(out + k, f);
    }
#endif
    for (; k < k1; k++)
        out[k] = dtype == T_BF16 ? bf16_bits_to_float(h[k]) : half_bits_to_float(h[k]);
}

/* dot(bf16 or fp16 row, x) for one token, each value converted in a register (no decoded row). */
static float dense_dot(const uint16_t *h, int dtype, const float *x, int k) {
    int i = 0;
    float sum = 0.0f;
#ifdef MF_AVX512
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    if (dtype == T_BF16) {
        for (; i + 32 <= k; i += 32) {
            __m512i v0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i)));
            __m512i v1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + i + 16)));
            a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), _mm512_loadu_ps(x + i), a0);
            a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), _mm512_loadu_ps(x + i + 16), a1);
        }
    } else {
        for (; i + 32 <= k; i += 32) {
            a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))), _mm512_loadu_ps(x + i), a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i + 16))),
                                 _mm512_loadu_ps(x + i + 16), a1);
        }
    }
    sum += _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
#ifdef MF_AVX2
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(h + i)), v1 = _mm_loadu_si128((const __m128i *)(h + i + 8));
        __m256 f0 = dtype == T_F16 ? _mm256_cvtph_ps(v0)
                                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v0), 16));
        __m256 f1 = dtype == T_F16 ? _mm256_cvtph_ps(v1)
                                   : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v1), 16));
        b0 = _mm256_fmadd_ps(f0, _mm256_loadu_ps(x + i), b0);
        b1 = _mm256_fmadd_ps(f1, _mm256_loadu_ps(x + i + 8), b1);
    }
    sum += hsum8(_mm256_add_ps(b0, b1));
#endif
    for (; i < k; i++) sum += (dtype == T_BF16 ? bf16_bits_to_float(h[i]) : half_bits_to_float(h[i])) * x[i];
    return sum;
}

/* Row n of slot `slot`, decoded to fp32: a pointer into the bank for fp32 weights, else `buf`. */
static const float *row(const matrix_t *m, int slot, int n, float *buf) {
    int k = m->k;
    if (m->form == FORM_DENSE) {
        const uint8_t *w = m->w + slot * m->w_slot + (int64_t)n * k * type_size(m->dtype);
        if (m->dtype == T_F32) return (const float *)w;
        dense_span(w, m->dtype, 0, k, buf);
        return buf;
    }
    if (m->form == FORM_FP4 || m->form == FORM_INT4) {
        const uint8_t *w = m->w + slot * m->w_slot + (int64_t)n * (k / 2);
        if (m->form == FORM_FP4) {
            float rs;
            memcpy(&rs, m->rs + slot * m->rs_slot + 4 * (int64_t)n, 4);
            fp4_row(w, m->s + slot * m->s_slot + (int64_t)n * m->s_cols, rs, k, buf);
        } else {
            int64_t g = (int64_t)n * m->s_cols;
            int4_span(w, m->s + slot * m->s_slot + type_size(m->dtype) * g, m->z ? m->z + slot * m->z_slot + g : NULL,
                      m->dtype, m->group, 0, k, buf);
        }
        return buf;
    }
    const uint8_t *w = m->w + slot * m->w_slot + (int64_t)n * k;
    if (m->form == FORM_FP8_ROW) {
        float rs;
        memcpy(&rs, m->rs + slot * m->rs_slot + 4 * (int64_t)n, 4);
        fp8_span(w, rs, 0, k, buf);
        return buf;
    }
    /* fp8_block: parts of `part` rows, each with ceil(part / group_n) scale rows */
    int brow = (n / m->part) * ((m->part + m->group_n - 1) / m->group_n) + (n % m->part) / m->group_n;
    const float *s = (const float *)(m->s + slot * m->s_slot) + (int64_t)brow * m->s_cols;
    for (int k0 = 0, g = 0; k0 < k; k0 += m->group, g++)
        fp8_span(w, s[g], k0, k0 + m->group < k ? k0 + m->group : k, buf);
    return buf;
}

/* dot(row n of slot `slot`, x) for one token: fused for fp4 (no decoded row), else row + dot. */
static float dot_row(const matrix_t *m, int slot, int n, const float *x, float *buf);

static float dot(const float *a, const float *b, int k) {
    int i = 0;
    float sum = 0.0f;
#ifdef MF_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (; i + 32 <= k; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    sum += hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#else
    float lanes[8] = {0};
    for (; i + 8 <= k; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < k; i++) sum += a[i] * b[i];
    return sum;
}

#define TOKEN_BLOCK 4

/* out[j] = dot(w, xs[j]) for j < count <= TOKEN_BLOCK: the weight row is loaded once for the
 * block (a lone token takes `dot`). */
static void dots(const float *w, const float *const *xs, int count, int k, float *out) {
    if (count == 1) {
        out[0] = dot(w, xs[0], k);
        return;
    }
    const float *x[TOKEN_BLOCK];
    for (int j = 0; j < TOKEN_BLOCK; j++) x[j] = xs[j < count ? j : 0];
    int i = 0;
    float sum[TOKEN_BLOCK] = {0};
#ifdef MF_AVX512
    __m512 z[TOKEN_BLOCK];
    for (int j = 0; j < TOKEN_BLOCK; j++) z[j] = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m512 w0 = _mm512_loadu_ps(w + i);
        for (int j = 0; j < TOKEN_BLOCK; j++) z[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + i), z[j]);
    }
    for (int j = 0; j < TOKEN_BLOCK; j++) sum[j] += _mm512_reduce_add_ps(z[j]);
#endif
#ifdef MF_AVX2
    __m256 a[TOKEN_BLOCK][2];
    for (int j = 0; j < TOKEN_BLOCK; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int j = 0; j < TOKEN_BLOCK; j++) {
            a[j][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[j] + i), a[j][0]);
            a[j][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[j] + i + 8), a[j][1]);
        }
    }
    for (int j = 0; j < TOKEN_BLOCK; j++) sum[j] += hsum8(_mm256_add_ps(a[j][0], a[j][1]));
#endif
    for (; i < k; i++)
        for (int j = 0; j < TOKEN_BLOCK; j++) sum[j] += w[i] * x[j][i];
    for (int j = 0; j < count; j++) out[j] = sum[j];
}

/* Sum of e4m3 codes [k0, k1) times x, by their fp16 bits (value / 2^8: the caller scales). */
static float e4m3_dot(const uint8_t *w, const float *x, int k0, int k1) {
    int k = k0;
    float sum = 0.0f;
#ifdef MF_AVX512
    __m512 wide0 = _mm512_setzero_ps(), wide1 = _mm512_setzero_ps();
    for (; k + 32 <= k1; k += 32) {
        wide0 = _mm512_fmadd_ps(e4m3x16(w + k), _mm512_loadu_ps(x + k), wide0);
        wide1 = _mm512_fmadd_ps(e4m3x16(w + k + 16), _mm512_loadu_ps(x + k + 16), wide1);
    }
    sum += _mm512_reduce_add_ps(_mm512_add_ps(wide0, wide1));
#endif
#ifdef MF_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= k1; k += 8) acc = _mm256_fmadd_ps(e4m3x8(w + k), _mm256_loadu_ps(x + k), acc);
    sum += hsum8(acc);
#endif
    for (; k < k1; k++) sum += half_bits_to_float(e4m3_half(w[k])) * x[k];
    return sum;
}

/* Sum of (u - z) x over one int4 group [k0, k1) (u the unsigned nibbles; the caller scales). */
static float int4_group_dot(const uint8_t *w, float z, const float *x, int k0, int k1) {
    int k = k0;
    float sum = 0.0f;
#ifdef MF_AVX512
    if (k % 2 == 0 && k + 32 <= k1) {  /* u - z looked up by code: a 16-entry table for the group */
        const __m512 table = _mm512_sub_ps(_mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f,
                                                          12.f, 13.f, 14.f, 15.f), _mm512_set1_ps(z));
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (; k + 32 <= k1; k += 32) {
            __m256i c = codes32(w + k / 2);
            s0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)), table),
                                 _mm512_loadu_ps(x + k), s0);
            s1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)), table),
                                 _mm512_loadu_ps(x + k + 16), s1);
        }
        sum += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#endif
#ifdef MF_AVX2
    __m256 acc = _mm256_setzero_ps(), vz = _mm256_set1_ps(z);
    for (; k + 16 <= k1 && k % 2 == 0; k += 16) {
        __m128i a, b;
        nibbles16(w + k / 2, &a, &b);
        acc = _mm256_fmadd_ps(_mm256_sub_ps(u16x8(a), vz), _mm256_loadu_ps(x + k), acc);
        acc = _mm256_fmadd_ps(_mm256_sub_ps(u16x8(b), vz), _mm256_loadu_ps(x + k + 8), acc);
    }
    sum += hsum8(acc);
#endif
    for (; k < k1; k++) sum += ((float)(k % 2 ? w[k / 2] >> 4 : w[k / 2] & 15u) - z) * x[k];
    return sum;
}

/* dot(row n of slot `slot`, x) for one token. The quantized forms skip the decoded row: each
 * scale group's products are summed unscaled and the group's scale multiplies the sum; bf16 and
 * fp16 rows are converted in registers. */
static float dot_row(const matrix_t *m, int slot, int n, const float *x, float *buf) {
    int k = m->k;
    if (m->form == FORM_FP4) {
        float rs;
        memcpy(&rs, m->rs + slot * m->rs_slot + 4 * (int64_t)n, 4);
        return fp4_dot(m->w + slot * m->w_slot + (int64_t)n * (k / 2), m->s + slot * m->s_slot + (int64_t)n * m->s_cols,
                       rs, x, k);
    }
    if (m->form == FORM_INT4) {
        const uint8_t *w = m->w + slot * m->w_slot + (int64_t)n * (k / 2);
        const uint8_t *sc = m->s + slot * m->s_slot + type_size(m->dtype) * (int64_t)n * m->s_cols;
        const uint8_t *zp = m->z ? m->z + slot * m->z_slot + (int64_t)n * m->s_cols : NULL;
        float sum = 0.0f;
        for (int k0 = 0, g = 0; k0 < k; k0 += m->group, g++)
            sum += int4_group_dot(w, zp ? (float)zp[g] : 8.0f, x, k0, k0 + m->group < k ? k0 + m->group : k)
                   * element(sc, m->dtype, g);
        return sum;
    }
    if (m->form == FORM_FP8_ROW) {
        float rs;
        memcpy(&rs, m->rs + slot * m->rs_slot + 4 * (int64_t)n, 4);
        return e4m3_dot(m->w + slot * m->w_slot + (int64_t)n * k, x, 0, k) * (rs * E4M3_UNIT);
    }
    if (m->form == FORM_FP8_BLOCK) {
        const uint8_t *w = m->w + slot * m->w_slot + (int64_t)n * k;
        int brow = (n / m->part) * ((m->part + m->group_n - 1) / m->group_n) + (n % m->part) / m->group_n;
        const float *s = (const float *)(m->s + slot * m->s_slot) + (int64_t)brow * m->s_cols;
        float sum = 0.0f;
        for (int k0 = 0, g = 0; k0 < k; k0 += m->group, g++)
            sum += e4m3_dot(w, x, k0, k0 + m->group < k ? k0 + m->group : k) * (s[g] * E4M3_UNIT);
        return sum;
    }
    if (m->form == FORM_DENSE && m->dtype != T_F32)
        return dense_dot((const uint16_t *)(m->w + slot * m->w_slot + (int64_t)n * k * 2), m->dtype, x, k);
    return dot(row(m, slot, n, buf), x, k);
}

/* The call's experts: expert e (bank slot slots[e]) has pairs [start[e], start[e+1]), pair p
 * being token pair_tok[p] with routing weight pair_w[p]. out[tok] += w * down(silu(gate x) * up x).
 * Called by every thread of a team. Two passes: the gate/up rows of every expert, shared out,
 * give h [pairs, I] (a barrier after); then each thread takes a range of output features and adds
 * every expert's down rows for them, expert by expert, so each output gets its terms in expert
 * order whatever the thread count (the result does not depend on it). */
static void experts(const matrix_t *gu, const matrix_t *dn, const float *x, int count, const int32_t *slots,
                    const int32_t *start, const int32_t *tok, const float *pw, float *h, float *out, float *buf) {
    int hidden = gu->k, inter = gu->part;
    float *gbuf = buf, *ubuf = buf + hidden + 16, gv[TOKEN_BLOCK], uv[TOKEN_BLOCK];
    const float *xs[TOKEN_BLOCK];
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t item = 0; item < (int64_t)count * inter; item++) {
        int e = (int)(item / inter), i = (int)(item % inter);
        if (start[e + 1] - start[e] == 1) {  /* a lone token: no decoded row */
            const float *xt = x + (int64_t)tok[start[e]] * hidden;
            float gl = dot_row(gu, slots[e], i, xt, gbuf), ul = dot_row(gu, slots[e], inter + i, xt, ubuf);
            h[(int64_t)start[e] * inter + i] = gl / (1.0f + expf(-gl)) * ul;
            continue;
        }
        const float *g = row(gu, slots[e], i, gbuf), *u = row(gu, slots[e], inter + i, ubuf);
        for (int p0 = start[e]; p0 < start[e + 1]; p0 += TOKEN_BLOCK) {
            int n = start[e + 1] - p0 < TOKEN_BLOCK ? start[e + 1] - p0 : TOKEN_BLOCK;
            for (int j = 0; j < n; j++) xs[j] = x + (int64_t)tok[p0 + j] * hidden;
            dots(g, xs, n, hidden, gv);
            dots(u, xs, n, hidden, uv);
            for (int j = 0; j < n; j++) h[(int64_t)(p0 + j) * inter + i] = gv[j] / (1.0f + expf(-gv[j])) * uv[j];
        }
    }
    /* this thread's output features, read expert by expert (one weight stream at a time) */
    int team = 1, me = 0;
#ifdef _OPENMP
    team = omp_get_num_threads(), me = omp_get_thread_num();
#endif
    int first = (int)((int64_t)hidden * me / team), last = (int)((int64_t)hidden * (me + 1) / team);
    for (int e = 0; e < count; e++) {
        for (int feature = first; feature < last; feature++) {
            if (start[e + 1] - start[e] == 1) {  /* a lone token: no decoded row */
                int p = start[e];
                out[(int64_t)tok[p] * hidden + feature] += pw[p] * dot_row(dn, slots[e], feature, h + (int64_t)p * inter, gbuf);
                continue;
            }
            const float *d = row(dn, slots[e], feature, gbuf);
            for (int p0 = start[e]; p0 < start[e + 1]; p0 += TOKEN_BLOCK) {
                int n = start[e + 1] - p0 < TOKEN_BLOCK ? start[e + 1] - p0 : TOKEN_BLOCK;
                for (int j = 0; j < n; j++) xs[j] = h + (int64_t)(p0 + j) * inter;
                dots(d, xs, n, inter, gv);
                for (int j = 0; j < n; j++) out[(int64_t)tok[p0 + j] * hidden + feature] += pw[p0 + j] * gv[j];
            }
        }
    }
}

/* The routing pairs grouped by expert, in expert order and, within an expert, in token order. */
typedef struct {
    int count;                          /* experts on this lane with at least one pair */
    int32_t *slots, *start, *tok;       /* [count] bank slot, [count + 1] first pair, [pairs] token */
    float *w;                           /* [pairs] routing weight */
} pairs_t;

static void pairs_free(pairs_t *p) {
    free(p->slots), free(p->start), free(p->tok), free(p->w);
}

/* A counting sort of the (token, choice) pairs whose expert has a slot in `table` ([num_experts],
 * -1 = not on this lane; out-of-range ids are skipped). Returns -1 when out of memory. */
static int group_pairs(const int64_t *ids, const float *weights, int tokens, int top_k, const int32_t *table,
                       int num_experts, pairs_t *p) {
    int64_t n = (int64_t)tokens * top_k;
    int *first = calloc((size_t)num_experts + 1, sizeof(int));
    p->slots = malloc(sizeof(int32_t) * ((size_t)num_experts + 1));
    p->start = malloc(sizeof(int32_t) * ((size_t)num_experts + 2));
    p->tok = malloc(sizeof(int32_t) * ((size_t)n + 1));
    p->w = malloc(sizeof(float) * ((size_t)n + 1));
    if (!first || !p->slots || !p->start || !p->tok || !p->w) {
        free(first);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < num_experts && table[ids[i]] >= 0) first[ids[i] + 1]++;
    p->count = 0;
    p->start[0] = 0;
    for (int e = 0; e < num_experts; e++) {
        if (first[e + 1]) {
            p->slots[p->count] = table[e];
            p->start[p->count + 1] = p->start[p->count] + first[e + 1];
            p->count++;
        }
        first[e + 1] += first[e]; /* first[e]: expert e's first pair */
    }
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] >= 0 && ids[i] < num_experts && table[ids[i]] >= 0) {
            int at = first[ids[i]]++;
            p->tok[at] = (int32_t)(i / top_k);
            p->w[at] = weights[i];
        }
    }
    free(first);
    return 0;
}

/* out [tokens, hidden] (fp32) += the experts of x [tokens, hidden] for the pairs of ids / weights
 * ([tokens, top_k]) whose expert has a bank slot in `table` ([num_experts], -1 = none): the contract of
 * SlotBuffer.run_reference. Returns 0, or -1 when memory for the buffers could not be had. */
int moe_cpu_experts(const matrix_t *gu, const matrix_t *dn, const float *x, int tokens, int top_k,
                    const int64_t *ids, const float *weights, const int32_t *table, int num_experts, float *out,
                    int threads) {
    pairs_t p = {0};
    int failed = 0;
    if (group_pairs(ids, weights, tokens, top_k, table, num_experts, &p) != 0) {
        pairs_free(&p);
        return -1;
    }
    float *h = malloc(sizeof(float) * ((size_t)p.start[p.count] * gu->part + 1));
    size_t buf_floats = 2 * ((size_t)(gu->k > dn->k ? gu->k : dn->k) + 16);
    if (!h || p.count == 0) {
        free(h);
        pairs_free(&p);
        return h ? 0 : -1;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
#endif
    {
        float *buf = malloc(sizeof(float) * buf_floats);
        int all_ok = buf != NULL;
#ifdef _OPENMP
#pragma omp atomic update
        failed += !all_ok;
#pragma omp barrier
#pragma omp atomic read
        all_ok = failed;
        all_ok = !all_ok;
#else
        (void)threads;
        failed = !all_ok;
#endif
        if (all_ok) experts(gu, dn, x, p.count, p.slots, p.start, p.tok, p.w, h, out, buf);
        free(buf);
    }
    free(h);
    pairs_free(&p);
    return failed ? -1 : 0;
}

/* Bit 0: built with the AVX2/F16C paths (else the portable loops); bit 1: OpenMP; bit 2: AVX-512. */
int moe_cpu_features(void) {
    int f = 0;
#ifdef MF_AVX2
    f |= 1;
#endif
#ifdef MF_AVX512
    f |= 4;
#endif
#ifdef _OPENMP
    f |= 2;
#endif
    return f;
}
