/* AVX2 versions of the hottest decoders in decode.h (included by experts.c when __AVX2__).
 *
 * gcc -O3 does not vectorize the scalar nibble loops well (it sees uint8/int8 stores that may
 * alias and mixed-width shifts), and a decoder running at 1-2 GB/s per core, not the memory's
 * ~10, was what bounded Q4_0/Q4_K. These produce the same q/fs/fm as the scalar versions
 * (tests/test_cpu_experts.py checks the results of whichever is compiled in).
 */
#include <immintrin.h>

/* 16 packed bytes -> 32 values: low nibbles (values 0-15) then high nibbles (16-31) */
static inline __m256i nib32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline void store32(int8_t *q, __m256i v) { _mm256_storeu_si256((__m256i *)q, v); }

static void dec_q4_0_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 18;
    const __m256i eight = _mm256_set1_epi8(8);
    for (int j = 0; j < n32; j++, b += 18) {
        scale32(fs, j, f16(b));
        store32(q + 32 * j, _mm256_sub_epi8(nib32(b + 2), eight));
    }
}

static void dec_q4_0_split_avx2(DECODE_ARGS) {
    const uint8_t *d = row + c * 8 * 2, *qs = aux + c * 8 * 16;
    const __m256i eight = _mm256_set1_epi8(8);
    for (int j = 0; j < n32; j++) {
        scale32(fs, j, f16(d + 2 * j));
        store32(q + 32 * j, _mm256_sub_epi8(nib32(qs + 16 * j), eight));
    }
}

static void dec_q4_1_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 20;
    for (int j = 0; j < n32; j++, b += 20) {
        scale32(fs, j, f16(b));
        scale32(fm, j, -f16(b + 2));
        store32(q + 32 * j, nib32(b + 4));
    }
}

static void dec_iq4_nl_avx2(DECODE_ARGS) {
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(tab + IQ4_VALUES)));
    const uint8_t *b = row + c * 8 * 18;
    for (int j = 0; j < n32; j++, b += 18) {
        scale32(fs, j, f16(b));
        store32(q + 32 * j, _mm256_shuffle_epi8(kv, nib32(b + 2)));
    }
}

static void dec_iq4_xs_avx2(DECODE_ARGS) {
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(tab + IQ4_VALUES)));
    const uint8_t *b = row + c * 136, *sl = b + 4, *qs = b + 8;
    float d = f16(b);
    unsigned sh = b[2] | b[3] << 8;
    for (int j = 0; j < 8; j++) {
        int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32;
        scale32(fs, j, d * (float)ls);
        store32(q + 32 * j, _mm256_shuffle_epi8(kv, nib32(qs + 16 * j)));
    }
}

static void dec_q4_k_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 144, *qs = b + 16;
    const __m256i m = _mm256_set1_epi8(15);
    k4_header(b, fs, fm);
    for (int r = 0; r < 4; r++) { /* 32-byte run r: low nibbles sub-block 2r, high 2r + 1 */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * r));
        store32(q + 64 * r, _mm256_and_si256(v, m));
        store32(q + 64 * r + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    }
}

/* bit j of every byte of v, moved to bit 4 */
static inline __m256i bit_to_16(__m256i v, int j) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, j), _mm256_set1_epi8(1)), 4);
}

static void dec_q5_k_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 176, *qs = b + 48;
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    k4_header(b, fs, fm);
    for (int r = 0; r < 4; r++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * r));
        store32(q + 64 * r, _mm256_or_si256(_mm256_and_si256(v, m), bit_to_16(qh, 2 * r)));
        store32(q + 64 * r + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m),
                                                 bit_to_16(qh, 2 * r + 1)));
    }
}

static void dec_q6_k_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 210;
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    const __m256i off = _mm256_set1_epi8(32);
    float d = f16(b + 208);
    for (int s = 0; s < 16; s++) fs[s] = d * (float)(int8_t)b[192 + s];
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h;
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                         _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        for (int k = 0; k < 4; k++) {
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
            __m256i v = _mm256_or_si256(lo[k], _mm256_slli_epi16(hi, 4));
            store32(q + 128 * h + 32 * k, _mm256_sub_epi8(v, off));
        }
    }
}

/* 32 bits -> 32 bytes: 0xFF where bit i of the little-endian word is set (llama.cpp's
 * bytes_from_bits_32) */
static inline __m256i bit_bytes(const uint8_t *p) {
    uint32_t x32;
    memcpy(&x32, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static inline __m256i five32(const uint8_t *qh, const uint8_t *qs) {
    return _mm256_or_si256(nib32(qs), _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
}

static void dec_q5_0_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 22;
    for (int j = 0; j < n32; j++, b += 22) {
        scale32(fs, j, f16(b));
        store32(q + 32 * j, _mm256_sub_epi8(five32(b + 2, b + 6), _mm256_set1_epi8(16)));
    }
}

static void dec_q5_1_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 24;
    for (int j = 0; j < n32; j++, b += 24) {
        scale32(fs, j, f16(b));
        scale32(fm, j, -f16(b + 2));
        store32(q + 32 * j, five32(b + 4, b + 8));
    }
}

static void dec_q2_k_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 84;
    float d = f16(b + 80), dmin = f16(b + 82);
    for (int s = 0; s < 16; s++) {
        fs[s] = d * (float)(b[s] & 15);
        fm[s] = dmin * (float)(b[s] >> 4);
    }
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
        for (int k = 0; k < 4; k++)
            store32(q + 128 * h + 32 * k, _mm256_and_si256(_mm256_srli_epi16(v, 2 * k), m2));
    }
}

static void dec_q3_k_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 110, *sc = b + 96;
    float d = f16(b + 108);
    for (int s = 0; s < 16; s++) {
        int lo = (sc[s % 8] >> (4 * (s / 8))) & 15, hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        fs[s] = d * (float)((lo | hi << 4) - 32);
    }
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1), four = _mm256_set1_epi8(4);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
        for (int k = 0; k < 4; k++) { /* a clear hmask bit means 4 lower */
            __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 2 * k), m2);
            __m256i high = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + k), one);
            __m256i w = _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
            store32(q + 128 * h + 32 * k, _mm256_sub_epi8(w, four));
        }
    }
}

static void dec_iq3_s_avx2(DECODE_ARGS) {
    const uint8_t *b = row + c * 110, *qs = b + 2, *qh = b + 66, *sg = b + 74, *sc = b + 106;
    const uint8_t *grid = tab + IQ3_S_GRID;
    float d = f16(b);
    for (int j = 0; j < 8; j++)
        scale32(fs, j, d * (float)(1 + 2 * ((sc[j / 2] >> (4 * (j % 2))) & 15)));
    for (int i = 0; i < 64; i++) /* 4 grid values per 9-bit index */
        memcpy(q + 4 * i, grid + 4 * (qs[i] | ((qh[i / 8] >> (i % 8)) & 1) << 8), 4);
    for (int j = 0; j < 8; j++) { /* negate where the sign bit is set: (g ^ m) - m */
        __m256i m = bit_bytes(sg + 4 * j);
        __m256i g = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
        store32(q + 32 * j, _mm256_sub_epi8(_mm256_xor_si256(g, m), m));
    }
}
