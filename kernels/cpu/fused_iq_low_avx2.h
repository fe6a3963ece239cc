/* AVX2 row dots for the low-bit i-quants (included by fused_avx2.h; layouts in
 * decode_iq_low.h). Per 32-value group: its grid points' magnitudes in one register, its
 * signs as +1/-1 bytes in another, applied to the activation (_mm256_sign_epi8) before the
 * unsigned-by-signed byte dot (dot_u8s8: VNNI, or maddubs then madd, into 8 int32 lanes),
 * dotted with every activation that uses the row.
 *
 * Lookup-bound, so as llama.cpp's AVX2 dots: per super-block, vector code turns the packed
 * fields into what the groups read with plain scalar loads (grid_prep: 16-bit grid indices,
 * and 8-bit sign bytes whose 8th bit, the parity of a 7-bit sign index, comes from a nibble
 * shuffle); per group, the grid rows are 8-byte loads packed by _mm256_set_epi64x (IQ3_XXS's
 * 4-byte rows by _mm256_setr_epi32) and the sign bytes expand to +1/-1 as bit_bytes does.
 * The first version packed rows and signs through a stack array, whose 32-byte reload of
 * 8-, 4- or 1-byte stores misses store-to-load forwarding, and extracted every field with
 * scalar shifts: 1.45-1.8x slower (bench/results/2026-12-04-cpu-iq-low.md).
 *
 * The integer lanes and the float scaling are the first version's, so the results are too,
 * bit for bit. Scales: IQ3_XXS, IQ2_XXS and IQ1_S have one per group, the 8 of a super-block
 * times the activation's 8 block scales in one multiply; IQ2_XS and IQ2_S have one per 16
 * values, applied to the dot's two halves (lanes 0-3: values 0-15) by one multiply before
 * the activation's scale. IQ1_S's values 8 g +- 1 (decode_iq_low.h) come from a 3-entry
 * shuffle table per delta sign, indexed by the grid's g + 1.
 */

enum { G_IQ3_XXS, G_IQ2_XXS, G_IQ1_S, G_IQ2_XS, G_IQ2_S }; /* per 16 from G_IQ2_XS on */
static const int GRID_BYTES[5] = {98, 66, 50, 74, 82};

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t ld32u(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* row i of a grid of 8-byte (4-byte) rows: a size_t index, so that the address is one scaled
 * index (an int one costs a shift and a sign extension per lookup: 4-8% here) */
static inline uint64_t row8(const uint8_t *g, size_t i) { return ld64(g + 8 * i); }
static inline int row4(const uint8_t *g, size_t i) { return (int)ld32u(g + 4 * i); }

/* four 8-byte rows, a in the low bytes: vmovq/vpinsrq/vinserti128, no trip through memory */
static inline __m256i rows4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_set_epi64x((long long)d, (long long)c, (long long)b, (long long)a);
}

/* one bit per value -> +1/-1 bytes (32 bits of `p`) */
static inline __m256i sign_bytes(const uint8_t *p) {
    return _mm256_or_si256(bit_bytes(p), _mm256_set1_epi8(1));
}

/* 8-bit sign bytes from 7-bit sign indices (one per byte, top bit clear): the 8th bit makes
 * the count of minus signs even (KSIGNS), the parity of the two nibbles' parities */
static inline __m256i even_signs(__m256i s7) {
    const __m256i par = _mm256_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128,
                                         0, -128, -128, 0, 0, -128, -128, 0, -128, 0, 0, -128,
                                         -128, 0, 0, -128, 0, -128, -128, 0);
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(s7, m4), hi = _mm256_and_si256(_mm256_srli_epi16(s7, 4), m4);
    __m256i odd = _mm256_xor_si256(_mm256_shuffle_epi8(par, lo), _mm256_shuffle_epi8(par, hi));
    return _mm256_or_si256(s7, odd);
}

/* IQ3_XXS / IQ2_XXS: a super-block's 8 u32 (4 x 7-bit sign index each) -> sg[32], byte 4 i + l
 * the signs of group i's 8 values 8 l .. 8 l + 7 */
static inline void xxs_signs(__m256i aux, uint8_t *sg) {
    const __m256i m7 = _mm256_set1_epi32(0x7f);
    __m256i f = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(aux, m7),
                        _mm256_and_si256(_mm256_slli_epi32(aux, 1), _mm256_slli_epi32(m7, 8))),
        _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(aux, 2), _mm256_slli_epi32(m7, 16)),
                        _mm256_and_si256(_mm256_slli_epi32(aux, 3), _mm256_slli_epi32(m7, 24))));
    _mm256_store_si256((__m256i *)sg, even_signs(f));
}

/* Per super-block, in vectors, what the groups then read with scalar loads: the sign bytes
 * sg[32] (IQ3_XXS, IQ2_XXS, IQ2_XS) and the grid indices idx[32] (IQ2_XS, IQ2_S, IQ1_S) */
static inline __attribute__((always_inline)) void grid_prep(int kind, const uint8_t *b,
                                                            uint8_t *sg, uint16_t *idx) {
    if (kind == G_IQ3_XXS) {
        xxs_signs(_mm256_loadu_si256((const __m256i *)(b + 66)), sg);
    } else if (kind == G_IQ2_XXS) { /* the u32 at 4 + 8 i: odd dwords of the 64 bytes */
        __m256 lo = _mm256_loadu_ps((const float *)(b + 2));
        __m256 hi = _mm256_loadu_ps((const float *)(b + 34));
        __m256i aux = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0xdd)); /* 0 1 4 5 2 3 6 7 */
        xxs_signs(_mm256_permute4x64_epi64(aux, 0xd8), sg);
    } else if (kind == G_IQ2_XS) { /* u16: 9-bit index, 7-bit sign index */
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(b + 2));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(b + 34));
        const __m256i m9 = _mm256_set1_epi16(511);
        _mm256_store_si256((__m256i *)idx, _mm256_and_si256(v0, m9));
        _mm256_store_si256((__m256i *)(idx + 16), _mm256_and_si256(v1, m9));
        __m256i s = _mm256_packus_epi16(_mm256_srli_epi16(v0, 9), _mm256_srli_epi16(v1, 9));
        _mm256_store_si256((__m256i *)sg, even_signs(_mm256_permute4x64_epi64(s, 0xd8)));
    } else if (kind == G_IQ2_S) { /* index bits 8-9: 2 bits of qh[i / 4] per index */
        const __m256i mul = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4,
                                              256, 64, 16, 4);
        const __m128i rep = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        __m128i qh = _mm_loadl_epi64((const __m128i *)(b + 66));
        for (int half = 0; half < 2; half++) {
            __m256i h = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_srli_epi64(qh, 32 * half), rep));
            __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * half)));
            h = _mm256_and_si256(_mm256_mullo_epi16(h, mul), _mm256_set1_epi16(0x300));
            _mm256_store_si256((__m256i *)(idx + 16 * half), _mm256_or_si256(q, h));
        }
    } else if (kind == G_IQ1_S) { /* index bits 8-10: bits 3 l .. 3 l + 2 of group i's u16 */
        const __m256i mul = _mm256_setr_epi16(256, 32, 4, 0, 256, 32, 4, 0, 256, 32, 4, 0, 256,
                                              32, 4, 0);
        const __m256i rep = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5,
                                             4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);
        for (int half = 0; half < 2; half++) { /* groups 4 half .. 4 half + 3 */
            __m128i h8 = _mm_loadl_epi64((const __m128i *)(b + 34 + 8 * half));
            __m256i h = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(h8), rep);
            __m256i t = _mm256_blend_epi16(_mm256_mullo_epi16(h, mul),
                                           _mm256_mulhi_epu16(h, _mm256_set1_epi16(-32768)), 0x88);
            __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * half)));
            t = _mm256_and_si256(t, _mm256_set1_epi16(0x700));
            _mm256_store_si256((__m256i *)(idx + 16 * half), _mm256_or_si256(q, t));
        }
    }
}

/* group i of super-block b: the magnitudes u (or IQ1_S's |8 g +- 1|) and the signs s */
static inline __attribute__((always_inline)) void grid_codes(
    int kind, const uint8_t *b, int i, const uint8_t *tab, const __m256i *lut1,
    const uint8_t *sg, const uint16_t *idx, __m256i *u, __m256i *s) {
    if (kind == G_IQ3_XXS) { /* 8 rows of 4 */
        const uint8_t *g = tab + IQ3_XXS_GRID, *q = b + 2 + 8 * i;
        *u = _mm256_setr_epi32(row4(g, q[0]), row4(g, q[1]), row4(g, q[2]), row4(g, q[3]),
                               row4(g, q[4]), row4(g, q[5]), row4(g, q[6]), row4(g, q[7]));
        *s = sign_bytes(sg + 4 * i);
    } else if (kind == G_IQ2_XXS) { /* 4 index bytes, then the u32 of signs and scale */
        const uint8_t *g = tab + IQ2_XXS_GRID, *q = b + 2 + 8 * i;
        *u = rows4(row8(g, q[0]), row8(g, q[1]), row8(g, q[2]), row8(g, q[3]));
        *s = sign_bytes(sg + 4 * i);
    } else if (kind == G_IQ2_XS || kind == G_IQ2_S) {
        const uint8_t *g = tab + (kind == G_IQ2_XS ? IQ2_XS_GRID : IQ2_S_GRID);
        const uint16_t *q = idx + 4 * i;
        *u = rows4(row8(g, q[0]), row8(g, q[1]), row8(g, q[2]), row8(g, q[3]));
        *s = sign_bytes(kind == G_IQ2_XS ? sg + 4 * i : b + 34 + 4 * i);
    } else { /* G_IQ1_S: the delta's sign in the top bit of group i's u16 */
        const uint8_t *g = tab + IQ1_S_GRID;
        const uint16_t *q = idx + 4 * i;
        __m256i gv = rows4(row8(g, q[0]), row8(g, q[1]), row8(g, q[2]), row8(g, q[3]));
        __m256i v = _mm256_shuffle_epi8(lut1[b[35 + 2 * i] >> 7],
                                        _mm256_add_epi8(gv, _mm256_set1_epi8(1)));
        *u = _mm256_abs_epi8(v);
        *s = v; /* never 0: sign_epi8 by v is the sign by v's sign */
    }
}

/* the scales of super-block b without d, in vectors: per group (lo: 8) or per 16 values (lo:
 * 0-7, hi: 8-15); the same float operations, in the same order, as decode_iq_low.h's */
static inline __attribute__((always_inline)) void grid_scales(int kind, const uint8_t *b,
                                                              __m256 *lo, __m256 *hi) {
    if (kind == G_IQ1_S) { /* (2 s + 1) / 8, s bits 12-14 of each u16: exact */
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 34)));
        __m256i s = _mm256_and_si256(_mm256_srli_epi32(h, 12), _mm256_set1_epi32(7));
        __m256i odd = _mm256_add_epi32(_mm256_add_epi32(s, s), _mm256_set1_epi32(1));
        *lo = _mm256_mul_ps(_mm256_cvtepi32_ps(odd), _mm256_set1_ps(0.125f));
    } else if (kind <= G_IQ2_XXS) { /* (0.5 + s) / 2 or / 4, s the top 4 bits of the u32 */
        __m256i aux;
        if (kind == G_IQ3_XXS) {
            aux = _mm256_loadu_si256((const __m256i *)(b + 66));
        } else { /* the odd dwords of the 64 bytes at 2 */
            __m256 l = _mm256_loadu_ps((const float *)(b + 2));
            __m256 h = _mm256_loadu_ps((const float *)(b + 34));
            aux = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(l, h, 0xdd)),
                                           0xd8);
        }
        __m256 s = _mm256_cvtepi32_ps(_mm256_srli_epi32(aux, 28));
        *lo = _mm256_mul_ps(_mm256_add_ps(_mm256_set1_ps(0.5f), s),
                            _mm256_set1_ps(kind == G_IQ3_XXS ? 0.5f : 0.25f));
    } else { /* (0.5 + s) / 4, 16 nibbles: byte s / 2's low (s even) or high one */
        __m128i v = _mm_loadl_epi64((const __m128i *)(b + (kind == G_IQ2_XS ? 66 : 74)));
        const __m128i m4 = _mm_set1_epi8(15);
        __m128i n =
            _mm_unpacklo_epi8(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        __m256 s0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(n));
        __m256 s1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(n, 8)));
        *lo = _mm256_mul_ps(_mm256_add_ps(_mm256_set1_ps(0.5f), s0), _mm256_set1_ps(0.25f));
        *hi = _mm256_mul_ps(_mm256_add_ps(_mm256_set1_ps(0.5f), s1), _mm256_set1_ps(0.25f));
    }
}

/* 8 int32 lanes of the group's dot with x: signs onto x, then |w| . x */
static inline __m256i signed_dot32(__m256i u, __m256i s, const int8_t *x) {
    return dot_u8s8(u, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), s));
}

static inline __attribute__((always_inline)) void grid_rowdot_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out, int kind) {
    __m256 acc[2][VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
    uint8_t sg[32] __attribute__((aligned(32)));
    float dl[16] __attribute__((aligned(32))); /* per16: d times the 16 scales */
    uint16_t idx[32] __attribute__((aligned(32)));
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    int per16 = kind > G_IQ1_S;
    /* IQ1_S: 8 g + delta for g + 1 = 0, 1, 2; [0]: delta +1, [1]: delta -1 */
    const __m256i lut1[2] = {_mm256_setr_epi8(-7, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              -7, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm256_setr_epi8(-9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              -9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)};
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + GRID_BYTES[kind] * c;
        float d = f16(b);
        __m256 ls, ls8 = _mm256_setzero_ps();
        grid_scales(kind, b, &ls, &ls8);
        grid_prep(kind, b, sg, idx);
        if (per16) {
            __m256 dv = _mm256_set1_ps(d);
            _mm256_store_ps(dl, _mm256_mul_ps(dv, ls));
            _mm256_store_ps(dl + 8, _mm256_mul_ps(dv, ls8));
        } else {
            __m256 d8 = _mm256_mul_ps(_mm256_set1_ps(d), ls);
            for (int64_t j = 0; j < nt; j++) {
                __m256 xd = _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c);
                _mm256_store_ps(scx[j], _mm256_mul_ps(d8, xd));
            }
        }
        for (int i = 0; i < 8; i += 2) { /* two groups: one fma chain each */
            __m256i u0, s0, u1, s1;
            grid_codes(kind, b, i, a->tab, lut1, sg, idx, &u0, &s0);
            grid_codes(kind, b, i + 1, a->tab, lut1, sg, idx, &u1, &s1);
            __m256 h0, h1; /* per16: the scales of values 0-15 (lanes 0-3) and 16-31 */
            if (per16) {
                h0 = _mm256_set_m128(_mm_broadcast_ss(dl + 2 * i + 1),
                                     _mm_broadcast_ss(dl + 2 * i));
                h1 = _mm256_set_m128(_mm_broadcast_ss(dl + 2 * i + 3),
                                     _mm_broadcast_ss(dl + 2 * i + 2));
            }
            for (int64_t j = 0; j < nt; j++) {
                const int8_t *x = a->q + vec[j] * a->k + 256 * c + 32 * i;
                const float *xd = a->d + vec[j] * (a->k / 32) + 8 * c + i;
                __m256 f0 = _mm256_cvtepi32_ps(signed_dot32(u0, s0, x));
                __m256 f1 = _mm256_cvtepi32_ps(signed_dot32(u1, s1, x + 32));
                if (per16) {
                    acc[0][j] = _mm256_fmadd_ps(_mm256_mul_ps(f0, h0), _mm256_broadcast_ss(xd),
                                                acc[0][j]);
                    acc[1][j] = _mm256_fmadd_ps(_mm256_mul_ps(f1, h1),
                                                _mm256_broadcast_ss(xd + 1), acc[1][j]);
                } else {
                    acc[0][j] = _mm256_fmadd_ps(f0, _mm256_broadcast_ss(&scx[j][i]), acc[0][j]);
                    acc[1][j] = _mm256_fmadd_ps(f1, _mm256_broadcast_ss(&scx[j][i + 1]),
                                                acc[1][j]);
                }
            }
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

/* one activation (a decode step's usual count) compiled apart from a tile of them */
#define GRID_ROWDOT(name, kind)                                                             \
    static void name(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a, \
                     const int64_t *vec, int64_t nt, float *out) {                          \
        (void)aux;                                                                          \
        if (nt == 1)                                                                        \
            grid_rowdot_body(row, cols / 256, a, vec, 1, out, kind);                        \
        else                                                                                \
            grid_rowdot_body(row, cols / 256, a, vec, nt, out, kind);                       \
    }
GRID_ROWDOT(rowdot_iq3_xxs, G_IQ3_XXS)
GRID_ROWDOT(rowdot_iq2_xxs, G_IQ2_XXS)
GRID_ROWDOT(rowdot_iq1_s, G_IQ1_S)
GRID_ROWDOT(rowdot_iq2_xs, G_IQ2_XS)
GRID_ROWDOT(rowdot_iq2_s, G_IQ2_S)

static rowdot_fn fused_rowdot_iq_low(int qtype) {
    switch (qtype) {
    case T_IQ3_XXS: return rowdot_iq3_xxs;
    case T_IQ2_XXS: return rowdot_iq2_xxs;
    case T_IQ1_S: return rowdot_iq1_s;
    case T_IQ2_XS: return rowdot_iq2_xs;
    case T_IQ2_S: return rowdot_iq2_s;
    default: return NULL;
    }
}
