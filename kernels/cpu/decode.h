/* GGUF block decoders for the CPU expert kernels (included by experts.c only).
 *
 * A decoder turns one chunk of a weight row (256 values: one K-quant super-block, or eight
 * 32-value blocks, fewer at a row's end) into integers q[256] (int8) and per-16-value float
 * factors, so that value i = fs[i / 16] * q[i] - fm[i / 16]. The integer dot products with the
 * int8 activations then run on q, shared by every type (experts.c: chunk_dot). fm is written
 * only by the types with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K: TYPE_HAS_MIN).
 *
 * The layouts follow gguf-py's gguf.quants and kernels/quant*.py (the torch references):
 *   Q8_0 (34): d | int8 q[32]              Q4_0 (18): d | qs 16 (low nibbles values 0-15)
 *   Q4_1 (20): d | m | qs 16               Q5_0 (22): d | qh u32 (5th bits) | qs 16
 *   Q5_1 (24): d | m | qh | qs 16          IQ4_NL (18): d | qs 16 (indices into kvalues)
 *   MXFP4 (17): e (E8M0 exponent) | qs 16 (as IQ4_NL's, indices into kvalues_mxfp4)
 *   Q2_K (84): scales 16 | qs 64 | d | dmin          Q3_K (110): hmask 32 | qs 64 | scales 12 | d
 *   Q4_K (144): d | dmin | scales 12 | qs 128        Q5_K (176): ... | qh 32 | qs 128
 *   Q6_K (210): ql 128 | qh 64 | int8 scales 16 | d  IQ4_XS (136): d | sh u16 | sl 4 | qs 128
 *   IQ3_S (110): d | qs 64 | qh 8 | signs 32 | scales 4
 *   the low-bit i-quants (IQ3_XXS, IQ2_*, IQ1_S): decode_iq_low.h
 * Split Q4_0 (kernels.experts.moe.split_q4_0): a matrix's fp16 scales [rows, nb], then its nibbles
 * [rows, nb, 16]; `row` is the row's scales and `aux` its nibbles.
 * Multi-byte fields are read with memcpy: a blob may sit at any byte offset.
 */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
    T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ4_XS = 23, T_BF16 = 30, T_MXFP4 = 39,
};

/* the tables buffer (kernels/formats/iq_tables.py): IQ3_S grid at 0, IQ4 levels at 2048,
 * MXFP4's levels (E2M1 doubled) at 33936 */
#define IQ3_S_GRID 0
#define IQ4_VALUES 2048
#define MXFP4_VALUES 33936

#define DECODE_ARGS                                                                  \
    const uint8_t *row, const uint8_t *aux, int64_t c, int n32, const uint8_t *tab, \
        int8_t *restrict q, float *restrict fs, float *restrict fm
typedef void (*decode_fn)(DECODE_ARGS);

static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* an MXFP4 block's E8M0 exponent e as 2^(e - 128), half its scale (the levels are doubled):
 * ggml_e8m0_to_fp32_half, from the bits (e < 2: subnormals) */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void scale32(float *f, int j, float v) { f[2 * j] = f[2 * j + 1] = v; }

/* --- 32-value blocks: chunk c holds blocks 8c .. 8c + n32 - 1 -------------------------- */

static void dec_q8_0(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 34;
    for (int j = 0; j < n32; j++, b += 34) {
        scale32(fs, j, f16(b));
        memcpy(q + 32 * j, b + 2, 32);
    }
}

static inline void nibbles_signed(const uint8_t *restrict qs, int8_t *restrict q, int off) {
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)((qs[i] & 15) - off);
        q[i + 16] = (int8_t)((qs[i] >> 4) - off);
    }
}

static void dec_q4_0(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 18;
    for (int j = 0; j < n32; j++, b += 18) {
        scale32(fs, j, f16(b));
        nibbles_signed(b + 2, q + 32 * j, 8);
    }
}

static void dec_q4_0_split(DECODE_ARGS) {
    const uint8_t *d = row + c * 8 * 2, *qs = aux + c * 8 * 16;
    for (int j = 0; j < n32; j++) {
        scale32(fs, j, f16(d + 2 * j));
        nibbles_signed(qs + 16 * j, q + 32 * j, 8);
    }
}

static void dec_q4_1(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 20;
    for (int j = 0; j < n32; j++, b += 20) {
        scale32(fs, j, f16(b));
        scale32(fm, j, -f16(b + 2));
        nibbles_signed(b + 4, q + 32 * j, 0);
    }
}

static inline void five_bits(const uint8_t *qh4, const uint8_t *restrict qs, int8_t *restrict q,
                             int off) {
    uint32_t qh = le32(qh4);
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)(((qs[i] & 15) | ((qh >> i) & 1) << 4) - off);
        q[i + 16] = (int8_t)(((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - off);
    }
}

static void dec_q5_0(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 22;
    for (int j = 0; j < n32; j++, b += 22) {
        scale32(fs, j, f16(b));
        five_bits(b + 2, b + 6, q + 32 * j, 16);
    }
}

static void dec_q5_1(DECODE_ARGS) {
    const uint8_t *b = row + c * 8 * 24;
    for (int j = 0; j < n32; j++, b += 24) {
        scale32(fs, j, f16(b));
        scale32(fm, j, -f16(b + 2));
        five_bits(b + 4, b + 8, q + 32 * j, 0);
    }
}

static void dec_iq4_nl(DECODE_ARGS) {
    const int8_t *kv = (const int8_t *)(tab + IQ4_VALUES);
    const uint8_t *b = row + c * 8 * 18;
    for (int j = 0; j < n32; j++, b += 18) {
        scale32(fs, j, f16(b));
        for (int i = 0; i < 16; i++) {
            q[32 * j + i] = kv[b[2 + i] & 15];
            q[32 * j + i + 16] = kv[b[2 + i] >> 4];
        }
    }
}

static void dec_mxfp4(DECODE_ARGS) {
    const int8_t *kv = (const int8_t *)(tab + MXFP4_VALUES);
    const uint8_t *b = row + c * 8 * 17;
    for (int j = 0; j < n32; j++, b += 17) {
        scale32(fs, j, e8m0_half(b[0]));
        for (int i = 0; i < 16; i++) {
            q[32 * j + i] = kv[b[1 + i] & 15];
            q[32 * j + i + 16] = kv[b[1 + i] >> 4];
        }
    }
}

/* split MXFP4: row holds the exponent bytes, aux the 16 code bytes of each block */
static void dec_mxfp4_split(DECODE_ARGS) {
    const int8_t *kv = (const int8_t *)(tab + MXFP4_VALUES);
    const uint8_t *e = row + c * 8, *qs = aux + c * 8 * 16;
    for (int j = 0; j < n32; j++) {
        scale32(fs, j, e8m0_half(e[j]));
        for (int i = 0; i < 16; i++) {
            q[32 * j + i] = kv[qs[16 * j + i] & 15];
            q[32 * j + i + 16] = kv[qs[16 * j + i] >> 4];
        }
    }
}

/* --- 256-value super-blocks: chunk c is super-block c ---------------------------------- */

static void dec_q2_k(DECODE_ARGS) {
    const uint8_t *b = row + c * 84, *qs = b + 16;
    float d = f16(b + 80), dmin = f16(b + 82);
    for (int s = 0; s < 16; s++) {
        fs[s] = d * (float)(b[s] & 15);
        fm[s] = dmin * (float)(b[s] >> 4);
    }
    /* each 128-value half is 32 bytes; 2-bit field k of byte l is value 32 k + l */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++)
                q[128 * h + 32 * k + l] = (int8_t)((qs[32 * h + l] >> (2 * k)) & 3);
}

static void dec_q3_k(DECODE_ARGS) {
    const uint8_t *b = row + c * 110, *hm = b, *qs = b + 32, *sc = b + 96;
    float d = f16(b + 108);
    for (int s = 0; s < 16; s++) {
        int lo = (sc[s % 8] >> (4 * (s / 8))) & 15, hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
        fs[s] = d * (float)((lo | hi << 4) - 32);
    }
    /* low 2 bits as Q2_K; a clear hmask bit (bit 32-value group, byte l) means 4 lower */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int low = (qs[32 * h + l] >> (2 * k)) & 3, high = (hm[l] >> (4 * h + k)) & 1;
                q[128 * h + 32 * k + l] = (int8_t)(low - (high ? 0 : 4));
            }
}

static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void k4_header(const uint8_t *b, float *fs, float *fm) {
    float d = f16(b), dmin = f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        scale_min_k4(b + 4, j, &sc, &mn);
        scale32(fs, j, d * (float)sc);
        scale32(fm, j, dmin * (float)mn);
    }
}

static void dec_q4_k(DECODE_ARGS) {
    const uint8_t *b = row + c * 144, *qs = b + 16;
    k4_header(b, fs, fm);
    for (int r = 0; r < 4; r++) /* 32-byte run r: low nibbles sub-block 2r, high 2r + 1 */
        for (int l = 0; l < 32; l++) {
            q[64 * r + l] = (int8_t)(qs[32 * r + l] & 15);
            q[64 * r + 32 + l] = (int8_t)(qs[32 * r + l] >> 4);
        }
}

static void dec_q5_k(DECODE_ARGS) {
    const uint8_t *b = row + c * 176, *qh = b + 16, *qs = b + 48;
    k4_header(b, fs, fm);
    for (int r = 0; r < 4; r++)
        for (int l = 0; l < 32; l++) {
            q[64 * r + l] = (int8_t)((qs[32 * r + l] & 15) | ((qh[l] >> (2 * r)) & 1) << 4);
            q[64 * r + 32 + l] =
                (int8_t)((qs[32 * r + l] >> 4) | ((qh[l] >> (2 * r + 1)) & 1) << 4);
        }
}

/* a Q6_K block's codes and scales at b (ql 128 | qh 64 | scales 16), its d given */
static inline void q6_k_block(const uint8_t *b, float d, int8_t *restrict q,
                              float *restrict fs) {
    for (int s = 0; s < 16; s++) fs[s] = d * (float)(int8_t)b[192 + s];
    /* per 128-value half: ql 64 bytes (low nibbles values 0-63, high 64-127), qh 32 bytes
     * (2-bit field k of byte l: value 32 k + l) */
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int lo = (ql[32 * (k & 1) + l] >> (4 * (k >> 1))) & 15;
                int hi = (qh[l] >> (2 * k)) & 3;
                q[128 * h + 32 * k + l] = (int8_t)((lo | hi << 4) - 32);
            }
    }
}

static void dec_q6_k(DECODE_ARGS) {
    const uint8_t *b = row + c * 210;
    q6_k_block(b, f16(b + 208), q, fs);
}

/* split Q6_K (kernels.experts.moe.split_q6_k): row points at the row's 208-byte block
 * bodies, aux at its blocks' fp16 d */
static void dec_q6_k_split(DECODE_ARGS) {
    q6_k_block(row + c * 208, f16(aux + 2 * c), q, fs);
}

static void dec_iq4_xs(DECODE_ARGS) {
    const int8_t *kv = (const int8_t *)(tab + IQ4_VALUES);
    const uint8_t *b = row + c * 136, *sl = b + 4, *qs = b + 8;
    float d = f16(b);
    unsigned sh = b[2] | b[3] << 8;
    for (int j = 0; j < 8; j++) {
        int ls = (((sl[j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4) - 32;
        scale32(fs, j, d * (float)ls);
        for (int i = 0; i < 16; i++) {
            q[32 * j + i] = kv[qs[16 * j + i] & 15];
            q[32 * j + i + 16] = kv[qs[16 * j + i] >> 4];
        }
    }
}

static void dec_iq3_s(DECODE_ARGS) {
    const uint8_t *b = row + c * 110, *qs = b + 2, *qh = b + 66, *sg = b + 74, *sc = b + 106;
    const uint8_t *grid = tab + IQ3_S_GRID; /* 512 points x 4 values (odd, 1..15) */
    float d = f16(b);
    for (int j = 0; j < 8; j++)
        scale32(fs, j, d * (float)(1 + 2 * ((sc[j / 2] >> (4 * (j % 2))) & 15)));
    for (int i = 0; i < 64; i++) {
        const uint8_t *g = grid + 4 * (qs[i] | ((qh[i / 8] >> (i % 8)) & 1) << 8);
        for (int k = 0; k < 4; k++) {
            int v = 4 * i + k;
            q[v] = (int8_t)((sg[v / 8] >> (v % 8)) & 1 ? -g[k] : g[k]);
        }
    }
}

#include "decode_iq_low.h" /* IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S */

/* --- float types: decoded to float32 (experts.c: float_chunk) -------------------------- */

static void dec_float(int qtype, const uint8_t *row, int64_t c, int n, float *v) {
    const uint8_t *p = row + c * 256 * (qtype == T_F32 ? 4 : 2);
    int i = 0;
    if (qtype == T_F32) {
        memcpy(v, p, 4 * (size_t)n);
        return;
    }
#ifdef __AVX2__ /* F16C comes with every AVX2 CPU */
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(p + 2 * i));
        __m256i bf = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
        __m256 f = qtype == T_F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(bf);
        _mm256_storeu_ps(v + i, f);
    }
#endif
    for (; i < n; i++) {
        if (qtype == T_F16) {
            v[i] = f16(p + 2 * i);
        } else { /* BF16: the high half of a float32 */
            uint32_t bits = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16;
            memcpy(v + i, &bits, 4);
        }
    }
}
