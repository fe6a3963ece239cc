/* AVX2 row dots for the common types (Q4_0 plain and split, Q8_0, Q4_K, Q5_K, IQ4_NL, IQ4_XS
 * here; Q6_K, Q2_K, Q3_K in fused_k16_avx2.h), included by experts.c when __AVX2__: a block
 * is decoded into a register and dotted at once with every activation that uses the row,
 * with no trip through the decode buffer, and the scales of 8 blocks are taken in one vector
 * (times the activation's 8 in one multiply, then permuted per block). Measured on a 2-core
 * EPYC VM (bench/cpu_experts.py): 1.4-2.6x the decode-then-dot path per type.
 *
 * A row dot: acc[j] = row . activation vec[j] for j < nt (nt <= VEC_TILE). The activation
 * of vec[j] is a->q + vec[j] * k (int8), its block scales a->d, its 16-value sums a->s.
 */

/* 8 int32 lanes of w . x for 32 int8 pairs; aw = |w|, so x takes w's sign */
static inline __m256i dot32(__m256i aw, __m256i w, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* lane i of v in every lane */
static inline __m256 lane(__m256 v, int i) {
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(i));
}

/* the same with unsigned weights u (0..127): no sign juggling */
static inline __m256i udot32(__m256i u, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1));
}

/* Q4_0 and Q8_0: one fp16 scale per 32 signed values. Block b adds into acc[b % 2][j]: two
 * chains, since one fma chain per row was bound by the fma's latency (about 1.6x on Q4_0). */
static inline __attribute__((always_inline)) void block_32(
    const uint8_t *row, const uint8_t *aux, int64_t b, const acts_t *a, const int64_t *vec,
    int64_t nt, __m256 *acc, int kind) {
    __m256i w;
    float dw;
    if (kind == 0) { /* Q4_0 */
        dw = f16(row + 18 * b);
        w = _mm256_sub_epi8(nib32(row + 18 * b + 2), _mm256_set1_epi8(8));
    } else if (kind == 1) { /* Q4_0 split */
        dw = f16(row + 2 * b);
        w = _mm256_sub_epi8(nib32(aux + 16 * b), _mm256_set1_epi8(8));
    } else { /* Q8_0 */
        dw = f16(row + 34 * b);
        w = _mm256_loadu_si256((const __m256i *)(row + 34 * b + 2));
    }
    __m256i aw = _mm256_sign_epi8(w, w);
    for (int64_t j = 0; j < nt; j++) {
        int64_t v = vec[j];
        __m256i s = dot32(aw, w, a->q + v * a->k + 32 * b);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                 _mm256_set1_ps(dw * a->d[v * (a->k / 32) + b]), acc[j]);
    }
}

static inline __attribute__((always_inline)) void rowdot_32(
    const uint8_t *row, const uint8_t *aux, int64_t nb, const acts_t *a, const int64_t *vec,
    int64_t nt, float *out, int kind) {
    __m256 acc[2][VEC_TILE], sx[VEC_TILE];
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    int64_t b = 0;
    /* 8 blocks at a time: their 8 scales in one vector (split Q4_0 keeps them together; the
     * GGUF blocks' are gathered), times the activation's 8 in one multiply. Q4_0's nibbles
     * stay unsigned (maddubs takes them as they are) and the -8 comes off through the
     * activation's block sums: sum (q - 8) x = sum q x - 8 sum x, one fma per 8 blocks. */
    __m256 corr[VEC_TILE];
    for (int64_t j = 0; j < nt; j++) corr[j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const int64_t stride = kind == 2 ? 34 : 18;
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(a->tab + IQ4_VALUES)));
    for (; b + 8 <= nb; b += 8) {
        __m128i h;
        if (kind == 1) {
            h = _mm_loadu_si128((const __m128i *)(row + 2 * b));
        } else {
            const uint8_t *p = row + stride * b;
#define H(i) (short)(p[stride * (i)] | p[stride * (i) + 1] << 8)
            h = _mm_setr_epi16(H(0), H(1), H(2), H(3), H(4), H(5), H(6), H(7));
#undef H
        }
        __m256 dw = _mm256_cvtph_ps(h);
        for (int64_t j = 0; j < nt; j++) {
            int64_t ib = vec[j] * (a->k / 32) + b;
            sx[j] = _mm256_mul_ps(dw, _mm256_loadu_ps(a->d + ib));
            if (kind < 2) corr[j] = _mm256_fmadd_ps(dw, _mm256_loadu_ps(a->xf + ib), corr[j]);
        }
        for (int i = 0; i < 8; i += 2) {
            __m256i w0, w1; /* blocks b + i, b + i + 1 */
            if (kind == 1) { /* two blocks' nibbles in one load */
                __m256i v = _mm256_loadu_si256((const __m256i *)(aux + 16 * (b + i)));
                __m256i lo = _mm256_and_si256(v, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
                w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
            } else if (kind == 0) {
                w0 = nib32(row + 18 * (b + i) + 2);
                w1 = nib32(row + 18 * (b + i + 1) + 2);
            } else if (kind == 3) { /* IQ4_NL: the nibbles index the 16 levels */
                w0 = _mm256_shuffle_epi8(kv, nib32(row + 18 * (b + i) + 2));
                w1 = _mm256_shuffle_epi8(kv, nib32(row + 18 * (b + i + 1) + 2));
            } else {
                w0 = _mm256_loadu_si256((const __m256i *)(row + 34 * (b + i) + 2));
                w1 = _mm256_loadu_si256((const __m256i *)(row + 34 * (b + i + 1) + 2));
            }
            __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);
            for (int64_t j = 0; j < nt; j++) {
                const int8_t *x = a->q + vec[j] * a->k + 32 * (b + i);
                __m256i s0, s1;
                if (kind >= 2) { /* Q8_0, IQ4_NL: signed weights */
                    s0 = dot32(aw0, w0, x), s1 = dot32(aw1, w1, x + 32);
                } else {
                    s0 = udot32(w0, x), s1 = udot32(w1, x + 32);
                }
                acc[0][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), lane(sx[j], i), acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), lane(sx[j], i + 1), acc[1][j]);
            }
        }
    }
    for (int64_t j = 0; j < nt; j++)
        acc[0][j] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), corr[j], acc[0][j]);
    for (; b + 1 < nb; b += 2) {
        block_32(row, aux, b, a, vec, nt, acc[0], kind);
        block_32(row, aux, b + 1, a, vec, nt, acc[1], kind);
    }
    if (b < nb) block_32(row, aux, b, a, vec, nt, acc[0], kind);
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

#define ROWDOT_32(name, kind)                                                                 \
    static void name(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,   \
                     const int64_t *vec, int64_t nt, float *out) {                            \
        if (nt == 1)                                                                          \
            rowdot_32(row, aux, cols / 32, a, vec, 1, out, kind);                             \
        else                                                                                  \
            rowdot_32(row, aux, cols / 32, a, vec, nt, out, kind);                            \
    }
ROWDOT_32(rowdot_q4_0, 0)
ROWDOT_32(rowdot_q4_0_split, 1)
ROWDOT_32(rowdot_q8_0, 2)
ROWDOT_32(rowdot_iq4_nl, 3)

/* Q4_K's 8 6-bit scales and mins (llama.cpp's utmp shuffle), times d and dmin */
static inline void q4_k_scales(const uint8_t *b, __m256 *sc, __m256 *mn) {
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1; /* bytes 0-7: scales, 8-15: mins */
    __m128i v = _mm_loadu_si128((const __m128i *)u);
    __m256 s8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
    *sc = _mm256_mul_ps(_mm256_set1_ps(f16(b)), s8);
    *mn = _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), m8);
}

/* Q4_K and Q5_K (five: the 5th bits from qh): the 8 sub-block scales times the activation's
 * 8 block scales in one multiply, the minimums against its block sums in one fma per
 * super-block */
static inline __attribute__((always_inline)) void rowdot_q4_k_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out, int five) {
    __m256 acc[VEC_TILE], acc1[VEC_TILE], mins[VEC_TILE], scx[VEC_TILE];
    for (int64_t j = 0; j < nt; j++)
        acc[j] = acc1[j] = mins[j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + (five ? 176 : 144) * c, *qs = b + (five ? 48 : 16);
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m256 sc, mn;
        q4_k_scales(b, &sc, &mn);
        for (int64_t j = 0; j < nt; j++) {
            int64_t ib = vec[j] * (a->k / 32) + 8 * c;
            scx[j] = _mm256_mul_ps(sc, _mm256_loadu_ps(a->d + ib));
            mins[j] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(a->xf + ib), mins[j]);
        }
        for (int r = 0; r < 4; r++) { /* 32-byte run r: sub-blocks 2r (low), 2r + 1 (high) */
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * r));
            __m256i lo = _mm256_and_si256(v, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, bit_to_16(qh, 2 * r));
                hi = _mm256_or_si256(hi, bit_to_16(qh, 2 * r + 1));
            }
            for (int64_t j = 0; j < nt; j++) {
                const int8_t *x = a->q + vec[j] * a->k + 256 * c + 64 * r;
                __m256i s0 = udot32(lo, x), s1 = udot32(hi, x + 32);
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), lane(scx[j], 2 * r), acc[j]);
                acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), lane(scx[j], 2 * r + 1), acc1[j]);
            }
        }
    }
    for (int64_t j = 0; j < nt; j++)
        out[j] = hsum8(_mm256_add_ps(acc[j], acc1[j])) - hsum8(mins[j]);
}

static void rowdot_q4_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_q4_k_body(row, cols / 256, a, vec, 1, out, 0);
    else
        rowdot_q4_k_body(row, cols / 256, a, vec, nt, out, 0);
}

static void rowdot_q5_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_q4_k_body(row, cols / 256, a, vec, 1, out, 1);
    else
        rowdot_q4_k_body(row, cols / 256, a, vec, nt, out, 1);
}

/* IQ4_XS: IQ4_NL's levels in 256-value super-blocks with 8 6-bit sub-block scales; two
 * sub-blocks' codes per load, the scales times the activation's 8 in one multiply */
static inline __attribute__((always_inline)) void rowdot_iq4_xs_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out) {
    __m256 acc[2][VEC_TILE], scx[VEC_TILE];
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(a->tab + IQ4_VALUES)));
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + 136 * c, *sl = b + 4, *qs = b + 8;
        int sh = b[2] | b[3] << 8;
        float ls[8];
        for (int i = 0; i < 8; i++) /* 6-bit scale: 4 bits from sl, 2 from sh, less 32 */
            ls[i] = (float)((((sl[i / 2] >> (4 * (i % 2))) & 15) | ((sh >> (2 * i)) & 3) << 4)
                            - 32);
        __m256 sc = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_loadu_ps(ls));
        for (int64_t j = 0; j < nt; j++)
            scx[j] = _mm256_mul_ps(sc, _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c));
        for (int i = 0; i < 8; i += 2) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 16 * i));
            __m256i lo = _mm256_and_si256(v, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            __m256i w0 = _mm256_shuffle_epi8(kv, _mm256_permute2x128_si256(lo, hi, 0x20));
            __m256i w1 = _mm256_shuffle_epi8(kv, _mm256_permute2x128_si256(lo, hi, 0x31));
            __m256i aw0 = _mm256_sign_epi8(w0, w0), aw1 = _mm256_sign_epi8(w1, w1);
            for (int64_t j = 0; j < nt; j++) {
                const int8_t *x = a->q + vec[j] * a->k + 256 * c + 32 * i;
                __m256i s0 = dot32(aw0, w0, x), s1 = dot32(aw1, w1, x + 32);
                acc[0][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), lane(scx[j], i), acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), lane(scx[j], i + 1), acc[1][j]);
            }
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

static void rowdot_iq4_xs(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                          const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_iq4_xs_body(row, cols / 256, a, vec, 1, out);
    else
        rowdot_iq4_xs_body(row, cols / 256, a, vec, nt, out);
}

#include "fused_k16_avx2.h"

static rowdot_fn fused_rowdot(int qtype, int split) {
    switch (qtype) {
    case T_Q4_0: return split ? rowdot_q4_0_split : rowdot_q4_0;
    case T_Q8_0: return rowdot_q8_0;
    case T_IQ4_NL: return rowdot_iq4_nl;
    case T_IQ4_XS: return rowdot_iq4_xs;
    case T_Q4_K: return rowdot_q4_k;
    case T_Q5_K: return rowdot_q5_k;
    case T_Q6_K: return rowdot_q6_k;
    case T_Q2_K: return rowdot_q2_k;
    case T_Q3_K: return rowdot_q3_k;
    default: return NULL;
    }
}
