/* AVX2 row dots for the common types (Q4_0 and MXFP4 plain and split, Q8_0, IQ4_NL, Q4_1, Q5_0,
 * Q5_1, Q4_K, Q5_K, IQ4_XS, IQ3_S here; Q6_K, Q2_K, Q3_K in fused_k16_avx2.h; IQ3_XXS, IQ2_XXS
 * in fused_iq_low_avx2.h), included by experts.c when __AVX2__: a block is decoded into a
 * register and dotted at once with every activation that uses the row, with no trip through the
 * decode buffer, and the scales of 8 blocks are taken in one vector (times the activation's 8
 * in one multiply, then broadcast per block from memory: a load, where a permute took an ALU
 * slot, +5-17%). Measured on a 2-core EPYC VM (bench/cpu/cpu_experts.py): 1.4-2.6x the
 * decode-then-dot path per type.
 *
 * A row dot: acc[j] = row . activation vec[j] for j < nt (nt <= VEC_TILE). The activation
 * of vec[j] is a->q + vec[j] * k (int8), its block scales a->d, its 16-value sums a->s.
 */

/* 8 int32 lanes, each the sum of 4 products of unsigned bytes u and signed bytes xv: one VNNI
 * instruction where the CPU has one (AVX512-VNNI with VL, or AVX-VNNI: recent Intel and AMD
 * Zen 4 on), else maddubs then madd. The same integers either way: maddubs's int16 pair sums
 * cannot saturate here, the activations being within +-127 (quantize_act) and every weight
 * byte within 128 in magnitude (128 x 127 x 2 < 32767). */
static inline __m256i dot_u8s8(__m256i u, __m256i xv) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xv);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, xv);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1));
#endif
}

/* 8 int32 lanes of w . x for 32 int8 pairs; aw = |w|, so x takes w's sign */
static inline __m256i dot32(__m256i aw, __m256i w, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return dot_u8s8(aw, _mm256_sign_epi8(xv, w));
}

/* the same with unsigned weights u (0..127): no sign juggling */
static inline __m256i udot32(__m256i u, const int8_t *x) {
    return dot_u8s8(u, _mm256_loadu_si256((const __m256i *)x));
}

/* The 32-value block types, by kind: 0 Q4_0, 1 Q4_0 split, 2 Q8_0, 3 IQ4_NL, 4 Q4_1, 5 Q5_0,
 * 6 Q5_1, 7 MXFP4, 8 MXFP4 split. Value = d q + o per block, with codes q kept unsigned where
 * they are (maddubs takes them as they are) and the offset o (Q4_0 -8 d, Q5_0 -16 d, Q4_1/Q5_1
 * the stored m) applied through the activation's block sums: sum (d q + o) x = d sum q x + o
 * sum x. MXFP4's d is its exponent byte's 2^(e - 128) (e8m0_half), its q the levels of its
 * table. The split kinds' row holds the scales (exponents), aux the codes, 16 bytes a block. */
static const int BYTES_32[9] = {18, 2, 34, 18, 20, 22, 24, 17, 1};

static inline int signed_32(int kind) { return kind == 2 || kind == 3 || kind >= 7; }

/* the exponents of 8 MXFP4 blocks (the first at p, `stride` bytes apart) as e8m0_half does one */
static inline __m256 e8m0_half8(const uint8_t *p, int stride) {
    __m256i e = _mm256_setr_epi32(p[0], p[stride], p[2 * stride], p[3 * stride], p[4 * stride],
                                  p[5 * stride], p[6 * stride], p[7 * stride]);
    __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e); /* e < 2 */
    __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, small));
}

/* block b's 32 codes */
static inline __attribute__((always_inline)) __m256i codes_32(
    int kind, const uint8_t *row, const uint8_t *aux, int64_t b, __m256i kv) {
    const uint8_t *p = row + BYTES_32[kind] * b;
    switch (kind) {
    case 0: return nib32(p + 2);
    case 1: return nib32(aux + 16 * b);
    case 2: return _mm256_loadu_si256((const __m256i *)(p + 2));
    case 3: return _mm256_shuffle_epi8(kv, nib32(p + 2));
    case 4: return nib32(p + 4);
    case 5: return five32(p + 2, p + 6);
    case 6: return five32(p + 4, p + 8);
    case 7: return _mm256_shuffle_epi8(kv, nib32(p + 1));
    default: return _mm256_shuffle_epi8(kv, nib32(aux + 16 * b));
    }
}

/* the offset o of a block with scale d (m: the stored fp16 at byte 2, for Q4_1/Q5_1) */
static inline float offset_32(int kind, float d, const uint8_t *p) {
    if (kind == 4 || kind == 6) return f16(p + 2);
    return kind <= 1 ? -8.0f * d : kind == 5 ? -16.0f * d : 0.0f;
}

static inline __m256i dot_32(int kind, __m256i w, const int8_t *x) {
    return signed_32(kind) ? dot32(_mm256_sign_epi8(w, w), w, x) : udot32(w, x);
}

/* one block (a row's last, past the groups of 8) */
static inline __attribute__((always_inline)) void block_32(
    const uint8_t *row, const uint8_t *aux, int64_t b, const acts_t *a, const int64_t *vec,
    int64_t nt, __m256 *acc, int kind, __m256i kv) {
    const uint8_t *p = row + BYTES_32[kind] * b;
    float dw = kind >= 7 ? e8m0_half(p[0]) : f16(p), o = offset_32(kind, dw, p);
    __m256i w = codes_32(kind, row, aux, b, kv);
    for (int64_t j = 0; j < nt; j++) {
        int64_t ib = vec[j] * (a->k / 32) + b;
        __m256i s = dot_32(kind, w, a->q + vec[j] * a->k + 32 * b);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * a->d[ib]), acc[j]);
        acc[j] = _mm256_add_ps(acc[j], _mm256_setr_ps(o * a->xf[ib], 0, 0, 0, 0, 0, 0, 0));
    }
}

/* 8 blocks at a time: their 8 scales (and offsets) in one vector (split Q4_0 keeps them
 * together; the GGUF blocks' are gathered), times the activation's 8 in one multiply; blocks
 * b + i and b + i + 1 add into two fma chains */
static inline __attribute__((always_inline)) void rowdot_32(
    const uint8_t *row, const uint8_t *aux, int64_t nb, const acts_t *a, const int64_t *vec,
    int64_t nt, float *out, int kind) {
    __m256 acc[2][VEC_TILE], corr[VEC_TILE];
    float sx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
    for (int64_t j = 0; j < nt; j++)
        acc[0][j] = acc[1][j] = corr[j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(a->tab + (kind >= 7 ? MXFP4_VALUES : IQ4_VALUES))));
    const int64_t stride = BYTES_32[kind];
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m128i h = _mm_setzero_si128(), hm = _mm_setzero_si128();
        const uint8_t *p = row + stride * b;
        if (kind == 1) {
            h = _mm_loadu_si128((const __m128i *)(row + 2 * b));
        } else if (kind < 7) {
#define H(i, at) (short)(p[stride * (i) + (at)] | p[stride * (i) + (at) + 1] << 8)
            h = _mm_setr_epi16(H(0, 0), H(1, 0), H(2, 0), H(3, 0), H(4, 0), H(5, 0), H(6, 0),
                               H(7, 0));
            if (kind == 4 || kind == 6)
                hm = _mm_setr_epi16(H(0, 2), H(1, 2), H(2, 2), H(3, 2), H(4, 2), H(5, 2), H(6, 2),
                                    H(7, 2));
#undef H
        }
        __m256 dw = kind >= 7 ? e8m0_half8(p, (int)stride) : _mm256_cvtph_ps(h);
        __m256 o = kind == 4 || kind == 6 ? _mm256_cvtph_ps(hm)
                                          : _mm256_mul_ps(dw, _mm256_set1_ps(kind == 5 ? -16.0f
                                                                                      : -8.0f));
        for (int64_t j = 0; j < nt; j++) {
            int64_t ib = vec[j] * (a->k / 32) + b;
            _mm256_store_ps(sx[j], _mm256_mul_ps(dw, _mm256_loadu_ps(a->d + ib)));
            if (!signed_32(kind))
                corr[j] = _mm256_fmadd_ps(o, _mm256_loadu_ps(a->xf + ib), corr[j]);
        }
        for (int i = 0; i < 8; i += 2) {
            __m256i w0, w1; /* blocks b + i, b + i + 1 */
            if (kind == 1) { /* two blocks' nibbles in one load */
                __m256i v = _mm256_loadu_si256((const __m256i *)(aux + 16 * (b + i)));
                __m256i lo = _mm256_and_si256(v, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
                w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
            } else {
                w0 = codes_32(kind, row, aux, b + i, kv);
                w1 = codes_32(kind, row, aux, b + i + 1, kv);
            }
            for (int64_t j = 0; j < nt; j++) {
                const int8_t *x = a->q + vec[j] * a->k + 32 * (b + i);
                __m256i s0 = dot_32(kind, w0, x), s1 = dot_32(kind, w1, x + 32);
                acc[0][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(&sx[j][i]),
                                            acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1),
                                            _mm256_broadcast_ss(&sx[j][i + 1]), acc[1][j]);
            }
        }
    }
    for (; b < nb; b++) block_32(row, aux, b, a, vec, nt, acc[b & 1], kind, kv);
    for (int64_t j = 0; j < nt; j++)
        out[j] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0][j], acc[1][j]), corr[j]));
}

/* Many activations (a prompt's tokens, a busy expert's) go RD_TILE at a time, each tile's
 * count a constant: its accumulators stay in registers (16 at once spilled them to the
 * stack, 25 GMAC/s on 2 cores). The row is decoded again per tile from L1. An activation's
 * sums are the same operations in the same order whatever the tile: the same bits. */
#define RD_TILE 4
#define ROWDOT_32(name, kind)                                                                 \
    static void name(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,   \
                     const int64_t *vec, int64_t nt, float *out) {                            \
        int64_t j = 0;                                                                        \
        for (; j + RD_TILE <= nt; j += RD_TILE)                                               \
            rowdot_32(row, aux, cols / 32, a, vec + j, RD_TILE, out + j, kind);               \
        switch (nt - j) {                                                                     \
        case 3: rowdot_32(row, aux, cols / 32, a, vec + j, 3, out + j, kind); break;          \
        case 2: rowdot_32(row, aux, cols / 32, a, vec + j, 2, out + j, kind); break;          \
        case 1: rowdot_32(row, aux, cols / 32, a, vec + j, 1, out + j, kind); break;          \
        default: break;                                                                       \
        }                                                                                     \
    }
ROWDOT_32(rowdot_q4_0, 0)
ROWDOT_32(rowdot_q4_0_split, 1)
ROWDOT_32(rowdot_q8_0, 2)
ROWDOT_32(rowdot_iq4_nl, 3)
ROWDOT_32(rowdot_q4_1, 4)
ROWDOT_32(rowdot_q5_0, 5)
ROWDOT_32(rowdot_q5_1, 6)
ROWDOT_32(rowdot_mxfp4, 7)
ROWDOT_32(rowdot_mxfp4_split, 8)

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
    __m256 acc[VEC_TILE], acc1[VEC_TILE], mins[VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
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
            _mm256_store_ps(scx[j], _mm256_mul_ps(sc, _mm256_loadu_ps(a->d + ib)));
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
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0),
                                         _mm256_broadcast_ss(&scx[j][2 * r]), acc[j]);
                acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1),
                                          _mm256_broadcast_ss(&scx[j][2 * r + 1]), acc1[j]);
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
    __m256 acc[2][VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
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
        for (int64_t j = 0; j < nt; j++) {
            __m256 xd = _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c);
            _mm256_store_ps(scx[j], _mm256_mul_ps(sc, xd));
        }
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
                acc[0][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0),
                                            _mm256_broadcast_ss(&scx[j][i]), acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1),
                                            _mm256_broadcast_ss(&scx[j][i + 1]), acc[1][j]);
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

/* a grid type's group i of super-block c (32 values at `at` in the activations): codes w
 * (unsigned), m its sign bytes' masks; into acc[i & 1] times scx[j][i] (the group's scale
 * times the activation's) */
static inline __attribute__((always_inline)) void grid_group_dot(
    __m256i w, __m256i m, const acts_t *a, const int64_t *vec, int64_t nt, int64_t at, int i,
    float (*scx)[8], __m256 (*acc)[VEC_TILE]) {
    __m256i ws = _mm256_sub_epi8(_mm256_xor_si256(w, m), m); /* signed */
    for (int64_t j = 0; j < nt; j++) {
        __m256i s = dot32(w, ws, a->q + vec[j] * a->k + at);
        __m256 f = _mm256_cvtepi32_ps(s);
        acc[i & 1][j] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(&scx[j][i]), acc[i & 1][j]);
    }
}

/* grid row i (4 bytes) of IQ3_S's table */
static inline int grid_row4(const uint8_t *grid, size_t i) {
    uint32_t v;
    memcpy(&v, grid + 4 * i, 4);
    return (int)v;
}

/* IQ3_S: 4 grid values (1..15) per 9-bit index, gathered 8 indices (32 values) at a time
 * into a register (_mm256_setr_epi32: the rows went through a stack array first, whose 32-byte
 * reload of 4-byte stores missed store-to-load forwarding), the signs as byte masks; 8 4-bit
 * scales per super-block in one vector */
static inline __attribute__((always_inline)) void rowdot_iq3_s_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out) {
    __m256 acc[2][VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    const uint8_t *grid = a->tab + IQ3_S_GRID;
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + 110 * c, *qs = b + 2, *qh = b + 66, *sg = b + 74, *sc = b + 106;
        float ls[8];
        for (int i = 0; i < 8; i++) ls[i] = (float)(1 + 2 * ((sc[i / 2] >> (4 * (i % 2))) & 15));
        __m256 d8 = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_loadu_ps(ls));
        for (int64_t j = 0; j < nt; j++) {
            __m256 xd = _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c);
            _mm256_store_ps(scx[j], _mm256_mul_ps(d8, xd));
        }
        for (int i = 0; i < 8; i++) { /* indices 8i .. 8i + 7: values 32i .. 32i + 31 */
            const uint8_t *q = qs + 8 * i;
            const size_t h = qh[i];
#define IX(k) ((size_t)q[k] | (h >> (k) & 1) << 8)
            __m256i w = _mm256_setr_epi32(grid_row4(grid, IX(0)), grid_row4(grid, IX(1)),
                                          grid_row4(grid, IX(2)), grid_row4(grid, IX(3)),
                                          grid_row4(grid, IX(4)), grid_row4(grid, IX(5)),
                                          grid_row4(grid, IX(6)), grid_row4(grid, IX(7)));
#undef IX
            grid_group_dot(w, bit_bytes(sg + 4 * i), a, vec, nt, 256 * c + 32 * i, i, scx, acc);
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

static void rowdot_iq3_s(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                         const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_iq3_s_body(row, cols / 256, a, vec, 1, out);
    else
        rowdot_iq3_s_body(row, cols / 256, a, vec, nt, out);
}

#include "fused_k16_avx2.h"
#include "fused_iq_low_avx2.h"

static rowdot_fn fused_rowdot(int qtype, int split) {
    switch (qtype) {
    case T_Q4_0: return split ? rowdot_q4_0_split : rowdot_q4_0;
    case T_Q8_0: return rowdot_q8_0;
    case T_IQ4_NL: return rowdot_iq4_nl;
    case T_MXFP4: return split ? rowdot_mxfp4_split : rowdot_mxfp4;
    case T_Q4_1: return rowdot_q4_1;
    case T_Q5_0: return rowdot_q5_0;
    case T_Q5_1: return rowdot_q5_1;
    case T_IQ4_XS: return rowdot_iq4_xs;
    case T_IQ3_S: return rowdot_iq3_s;
    case T_Q4_K: return rowdot_q4_k;
    case T_Q5_K: return rowdot_q5_k;
    case T_Q6_K: return split ? rowdot_q6_k_split : rowdot_q6_k;
    case T_Q2_K: return rowdot_q2_k;
    case T_Q3_K: return rowdot_q3_k;
    default: return fused_rowdot_iq_low(qtype);
    }
}
