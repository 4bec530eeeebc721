/* Fused dequantisation of the quantised KV cache (tuner/kv_cache.py's layout), CPU.
 *
 * One pass from packed codes to float32 rows written straight into the caller's
 * [batch, heads, tokens, head_dim] buffer, instead of torch's chain of unpack, cast, addcmul,
 * reshape and cat. Bit for bit the reference (tuner/_kv_codec.py): the product q * s is rounded
 * before zero is added (no FMA contraction: built with -ffp-contract=off, and the AVX2 path
 * multiplies and adds in separate instructions). The AVX2 path is chosen at run time; other
 * CPUs, and other architectures (where it is not compiled), take the portable one. Plain C
 * with no torch headers, so it builds in about a second (tuner/_kv_native.py).
 */
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define X86 1
#define AVX2 __attribute__((target("avx2,f16c")))
#endif
#define MAX_D 1024

/* IEEE binary16 to float, exactly (the portable path; AVX2 CPUs use F16C's instruction). */
INLINE float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { ++e; man <<= 1; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Codes of channels [from, d) of one row, one byte each (LSB first, as pack_codes); ``from``
 * is a multiple of the word's codes (4 at 2 and 6 bits, 2 at 4 bits). */
INLINE void unpack_tail(const uint8_t *restrict p, int64_t from, int64_t d, int bits,
                        uint8_t *restrict q) {
    int64_t c;
    switch (bits) {
    case 2:
        for (c = from; c < d; c += 4) {
            const uint8_t b = p[c / 4];
            q[c] = b & 3u; q[c + 1] = (b >> 2) & 3u; q[c + 2] = (b >> 4) & 3u; q[c + 3] = b >> 6;
        }
        break;
    case 4:
        for (c = from; c < d; c += 2) {
            q[c] = p[c / 2] & 15u;
            q[c + 1] = p[c / 2] >> 4;
        }
        break;
    case 6:
        for (c = from; c < d; c += 4) {
            const uint8_t *w = p + c / 4 * 3;
            const uint32_t word = w[0] | ((uint32_t)w[1] << 8) | ((uint32_t)w[2] << 16);
            q[c] = word & 63u; q[c + 1] = (word >> 6) & 63u; q[c + 2] = (word >> 12) & 63u;
            q[c + 3] = (uint8_t)(word >> 18);
        }
        break;
    default:
        memcpy(q + from, p + from, (size_t)(d - from));
    }
}

/* The row's parameters: ``s``/``z`` hold one value per channel (``per`` = 1) or one per
 * ``per`` channels (values' groups, ``per`` a multiple of 8 on the AVX2 path). */
typedef struct {
    const float *s, *z;
    int64_t per;
    float offset;
} params;

/* One row: out = zero + q s (asymmetric, as torch.addcmul) or (q - offset) s (symmetric). */
INLINE void row_portable(const uint8_t *restrict p, int64_t d, int bits, params k,
                         float *restrict o) {
    uint8_t q[MAX_D];
    unpack_tail(p, 0, d, bits, q);
    if (k.per == 1) {
        for (int64_t c = 0; c < d; ++c)
            o[c] = k.z ? k.z[c] + (float)q[c] * k.s[c] : ((float)q[c] - k.offset) * k.s[c];
        return;
    }
    for (int64_t g = 0; g < d / k.per; ++g) {
        const float s = k.s[g], z = k.z ? k.z[g] : 0.0f;
        for (int64_t c = g * k.per; c < (g + 1) * k.per; ++c)
            o[c] = k.z ? z + (float)q[c] * s : ((float)q[c] - k.offset) * s;
    }
}

#ifdef X86
/* 8 codes of channels [c, c + 8) as 32-bit lanes, straight from the packed bytes (an earlier
 * version unpacked a row to memory and loaded it back, and stalled on store forwarding). */
AVX2 INLINE __m256i codes8(const uint8_t *restrict p, int64_t c, int64_t d, int bits) {
    if (bits == 8)
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + c)));
    if (bits == 4) { /* 4 bytes -> 8 codes */
        int32_t word;
        memcpy(&word, p + c / 2, sizeof word);
        const __m128i v = _mm_cvtsi32_si128(word), low = _mm_set1_epi8(15);
        return _mm256_cvtepu8_epi32(
            _mm_unpacklo_epi8(_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)));
    }
    if (bits == 2) { /* 2 bytes -> 8 codes */
        uint16_t word;
        memcpy(&word, p + c / 4, sizeof word);
        const __m128i v = _mm_cvtsi32_si128(word), two = _mm_set1_epi8(3);
        const __m128i a = _mm_unpacklo_epi8(_mm_and_si128(v, two),
                                            _mm_and_si128(_mm_srli_epi16(v, 2), two));
        const __m128i b = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), two),
                                            _mm_and_si128(_mm_srli_epi16(v, 6), two));
        return _mm256_cvtepu8_epi32(_mm_unpacklo_epi16(a, b));
    }
    /* 6 bits: two 3-byte words -> 8 codes; lane k takes the bytes of word k / 4. Read with
     * one 8-byte load: past the 6 bytes while the row goes on, else ending at them. */
    const uint8_t *w = p + c / 4 * 3;
    __m128i six;
    if (c + 8 < d) {
        six = _mm_loadl_epi64((const __m128i *)w);
    } else if (c >= 8) {
        six = _mm_srli_epi64(_mm_loadl_epi64((const __m128i *)(w - 2)), 16);
    } else { /* a row of 8 channels: 6 bytes in all */
        uint64_t word = 0;
        memcpy(&word, w, 6);
        six = _mm_cvtsi64_si128((int64_t)word);
    }
    const __m256i bytes = _mm256_broadcastsi128_si256(six);
    const __m256i spread = _mm256_setr_epi8(
        0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1,
        3, 4, 5, -1, 3, 4, 5, -1, 3, 4, 5, -1, 3, 4, 5, -1);
    const __m256i shifts = _mm256_setr_epi32(0, 6, 12, 18, 0, 6, 12, 18);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(bytes, spread), shifts),
                            _mm256_set1_epi32(63));
}

/* out = zero + q s (asymmetric, as torch.addcmul) or (q - offset) s (symmetric), 8 lanes. */
AVX2 INLINE __m256 affine8(__m256i codes, __m256 s, __m256 z, __m256 off, int symmetric) {
    const __m256 q = _mm256_cvtepi32_ps(codes);
    return symmetric ? _mm256_mul_ps(_mm256_sub_ps(q, off), s)
                     : _mm256_add_ps(z, _mm256_mul_ps(q, s));
}

/* One row at a constant width and quantiser, so each expansion has no branch in its loops:
 * keys read a scale and zero per channel, values one per group of k.per channels. */
#define ROW_AVX2(BITS, SYMMETRIC)                                                              \
    do {                                                                                       \
        if (k.per == 1) {                                                                      \
            for (int64_t c = 0; c < d; c += 8)                                                 \
                _mm256_storeu_ps(o + c, affine8(codes8(p, c, d, BITS), _mm256_loadu_ps(k.s + c),  \
                                                SYMMETRIC ? off : _mm256_loadu_ps(k.z + c),    \
                                                off, SYMMETRIC));                              \
            break;                                                                             \
        }                                                                                      \
        for (int64_t g = 0, c = 0; g < d / k.per; ++g) {                                       \
            const __m256 s = _mm256_set1_ps(k.s[g]);                                           \
            const __m256 z = SYMMETRIC ? off : _mm256_set1_ps(k.z[g]);                         \
            for (const int64_t end = c + k.per; c < end; c += 8)                               \
                _mm256_storeu_ps(o + c, affine8(codes8(p, c, d, BITS), s, z, off, SYMMETRIC));    \
        }                                                                                      \
    } while (0)

AVX2 INLINE void row_avx2(const uint8_t *restrict p, int64_t d, int bits, params k,
                          float *restrict o) {
    const __m256 off = _mm256_set1_ps(k.offset);
    const int symmetric = k.z == NULL;
    switch (bits * 2 + symmetric) {
    case 4: ROW_AVX2(2, 0); break;
    case 5: ROW_AVX2(2, 1); break;
    case 8: ROW_AVX2(4, 0); break;
    case 9: ROW_AVX2(4, 1); break;
    case 12: ROW_AVX2(6, 0); break;
    case 13: ROW_AVX2(6, 1); break;
    case 16: ROW_AVX2(8, 0); break;
    default: ROW_AVX2(8, 1);
    }
}
#undef ROW_AVX2
#endif /* X86 */

/* Keys (per-channel groups of ``group`` tokens) or values (per-token groups of ``group``
 * channels) of ``blocks`` (batch x heads) blocks of ``t`` tokens. ``packed`` is
 * [blocks, t, d * bits / 8]; ``scale`` and ``zero`` (NULL when symmetric) are float16, keys
 * [blocks, t / group, d], values [blocks, t, d / group]; block i's row j is written to
 * out + i * out_stride + j * d. Expanded once per row kernel and float16 conversion, so each
 * inlines its own. */
#define DEQUANTIZE_BLOCKS(ROW, HALF)                                                           \
    float sbuf[MAX_D], zbuf[MAX_D];                                                            \
    const int64_t row_bytes = d * bits / 8, n = keys ? d : d / group;                          \
    const params k = {sbuf, zero ? zbuf : NULL, keys ? 1 : group, (float)(1 << (bits - 1))};   \
    for (int64_t blk = 0; blk < blocks; ++blk) {                                               \
        const uint8_t *p = packed + blk * t * row_bytes;                                       \
        float *o = out + blk * out_stride;                                                     \
        for (int64_t j = 0, left = 0; j < t; ++j, p += row_bytes, o += d) {                    \
            if (!keys || left-- == 0) { /* keys: a new group of tokens; values: each token */  \
                left = group - 1;                                                              \
                const int64_t at = keys ? (blk * (t / group) + j / group) * d                  \
                                        : (blk * t + j) * n;                                   \
                for (int64_t i = 0; i < n; ++i) sbuf[i] = HALF(scale[at + i]);                 \
                if (zero)                                                                      \
                    for (int64_t i = 0; i < n; ++i) zbuf[i] = HALF(zero[at + i]);              \
            }                                                                                  \
            ROW(p, d, bits, k, o);                                                             \
        }                                                                                      \
    }

#define BLOCK_ARGS const uint8_t *packed, const uint16_t *scale, const uint16_t *zero,        \
    int bits, int keys, int64_t group, int64_t blocks, int64_t t, int64_t d, float *out,       \
    int64_t out_stride

static void blocks_portable(BLOCK_ARGS) { DEQUANTIZE_BLOCKS(row_portable, half_to_float) }

#ifdef X86
AVX2 static void blocks_avx2(BLOCK_ARGS) { DEQUANTIZE_BLOCKS(row_avx2, _cvtsh_ss) }
#endif

/* Returns 0, or -1 for arguments it does not handle (the caller then takes the torch path).
 * ``simd`` 0 keeps to the portable path (what a CPU without AVX2 runs; the tests check both). */
EXPORT int seedance_kv_dequantize(BLOCK_ARGS, int simd) {
    if ((bits != 2 && bits != 4 && bits != 6 && bits != 8) || d <= 0 || d > MAX_D || group <= 0
        || d % 8 || (keys && t % group) || (!keys && d % group))
        return -1;
#ifdef X86
    __builtin_cpu_init();
    if (simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")
        && (keys || group % 8 == 0)) {
        blocks_avx2(packed, scale, zero, bits, keys, group, blocks, t, d, out, out_stride);
        return 0;
    }
#else
    (void)simd;
#endif
    blocks_portable(packed, scale, zero, bits, keys, group, blocks, t, d, out, out_stride);
    return 0;
}
