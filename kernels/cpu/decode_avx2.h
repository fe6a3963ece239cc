/* AVX2 bit and nibble unpacking shared by the fused row dots (fused_avx2.h,
 * fused_k16_avx2.h); included by experts.c when __AVX2__. Each turns packed codes into 32
 * bytes, one per value, in the order of GGUF's 32-value blocks.
 */
#include <immintrin.h>

/* 16 packed bytes -> 32 values: low nibbles (values 0-15) then high nibbles (16-31) */
static inline __m256i nib32(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* bit j of every byte of v, moved to bit 4 */
static inline __m256i bit_to_16(__m256i v, int j) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, j), _mm256_set1_epi8(1)), 4);
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

