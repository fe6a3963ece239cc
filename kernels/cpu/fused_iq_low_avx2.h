/* AVX2 row dots for the low-bit i-quants (included by fused_avx2.h; layouts in
 * decode_iq_low.h). Per 32-value group: its grid points' magnitudes in one register, its
 * signs as +1/-1 bytes in another, applied to the activation (_mm256_sign_epi8) before the
 * unsigned-by-signed byte dot (maddubs, then madd into 8 int32 lanes), dotted with every
 * activation that uses the row.
 *
 * Lookup-bound, so the lookups are built straight into registers as llama.cpp's AVX2 dots
 * do: grid rows as 8-byte scalar loads packed by _mm256_set_epi64x (IQ3_XXS's 4-byte rows
 * paired in a scalar register first), and a 7-bit sign index as one 8-byte row of the
 * tables' KSIGNS64 (its 8 signs as +1/-1 bytes). The first version packed the same values
 * through a stack array, whose 32-byte reload of 8- or 4-byte stores misses store-to-load
 * forwarding (figures: bench/results/2026-12-04-cpu-iq-low.md).
 *
 * The integer lanes and the float scaling are the first version's, so the results are too,
 * bit for bit. Scales: IQ3_XXS, IQ2_XXS and IQ1_S have one per group, the 8 of a super-block
 * times the activation's 8 block scales in one multiply (grid_group_dot, as IQ3_S); IQ2_XS
 * and IQ2_S have one per 16 values, applied to the dot's two halves (lanes 0-3: values 0-15)
 * by one multiply before the activation's scale. IQ1_S's values 8 g +- 1 (decode_iq_low.h)
 * come from a 3-entry shuffle table per delta sign, indexed by the grid's g + 1.
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

/* four 8-byte rows, a in the low bytes: vmovq/vpinsrq/vinserti128, no trip through memory */
static inline __m256i rows4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_set_epi64x((long long)d, (long long)c, (long long)b, (long long)a);
}

/* the +1/-1 sign bytes of the 7-bit sign index s */
static inline uint64_t sign_row(const uint8_t *ks64, unsigned s) { return ld64(ks64 + 8 * s); }

/* group i of super-block b: the magnitudes u (or IQ1_S's |8 g +- 1|) and the signs s */
static inline __attribute__((always_inline)) void grid_codes(
    int kind, const uint8_t *b, int i, const uint8_t *tab, const __m256i *lut1, __m256i *u,
    __m256i *s) {
    const uint8_t *ks = tab + KSIGNS64;
    if (kind == G_IQ3_XXS) { /* 8 rows of 4: paired into 8-byte words */
        const uint8_t *g = tab + IQ3_XXS_GRID;
        uint64_t q = ld64(b + 2 + 8 * i), w[4];
        uint32_t aux = (uint32_t)ld32u(b + 66 + 4 * i);
        for (int l = 0; l < 4; l++)
            w[l] = ld32u(g + 4 * ((q >> 16 * l) & 255)) |
                   ld32u(g + 4 * ((q >> (16 * l + 8)) & 255)) << 32;
        *u = rows4(w[0], w[1], w[2], w[3]);
        *s = rows4(sign_row(ks, aux & 127), sign_row(ks, (aux >> 7) & 127),
                   sign_row(ks, (aux >> 14) & 127), sign_row(ks, (aux >> 21) & 127));
    } else if (kind == G_IQ2_XXS) { /* 4 index bytes, then the u32 of signs and scale */
        const uint8_t *g = tab + IQ2_XXS_GRID;
        uint64_t q = ld64(b + 2 + 8 * i);
        uint32_t aux = (uint32_t)(q >> 32);
        *u = rows4(ld64(g + 8 * (q & 255)), ld64(g + 8 * ((q >> 8) & 255)),
                   ld64(g + 8 * ((q >> 16) & 255)), ld64(g + 8 * ((q >> 24) & 255)));
        *s = rows4(sign_row(ks, aux & 127), sign_row(ks, (aux >> 7) & 127),
                   sign_row(ks, (aux >> 14) & 127), sign_row(ks, (aux >> 21) & 127));
    } else if (kind == G_IQ2_XS) { /* 4 u16: 9-bit index, 7-bit sign index */
        const uint8_t *g = tab + IQ2_XS_GRID;
        uint64_t q = ld64(b + 2 + 8 * i);
        *u = rows4(ld64(g + 8 * (q & 511)), ld64(g + 8 * ((q >> 16) & 511)),
                   ld64(g + 8 * ((q >> 32) & 511)), ld64(g + 8 * ((q >> 48) & 511)));
        *s = rows4(sign_row(ks, (q >> 9) & 127), sign_row(ks, (q >> 25) & 127),
                   sign_row(ks, (q >> 41) & 127), sign_row(ks, (q >> 57) & 127));
    } else if (kind == G_IQ2_S) { /* 4 index bytes, 2 more bits each from qh; raw sign bits */
        const uint8_t *g = tab + IQ2_S_GRID;
        uint32_t q = (uint32_t)ld32u(b + 2 + 4 * i), h = b[66 + i];
        *u = rows4(ld64(g + 8 * ((q & 255) | (h & 3) << 8)),
                   ld64(g + 8 * (((q >> 8) & 255) | (h & 12) << 6)),
                   ld64(g + 8 * (((q >> 16) & 255) | (h & 48) << 4)),
                   ld64(g + 8 * ((q >> 24) | (h & 192) << 2)));
        *s = _mm256_or_si256(bit_bytes(b + 34 + 4 * i), _mm256_set1_epi8(1));
    } else { /* G_IQ1_S: 4 index bytes, 3 more bits each and the delta's sign from qh */
        const uint8_t *g = tab + IQ1_S_GRID;
        uint32_t q = (uint32_t)ld32u(b + 2 + 4 * i);
        unsigned h = le16(b + 34 + 2 * i);
        __m256i gv = rows4(ld64(g + 8 * ((q & 255) | (h & 7) << 8)),
                           ld64(g + 8 * (((q >> 8) & 255) | (h & 0x38) << 5)),
                           ld64(g + 8 * (((q >> 16) & 255) | (h & 0x1c0) << 2)),
                           ld64(g + 8 * ((q >> 24) | (h & 0xe00) >> 1)));
        __m256i v = _mm256_shuffle_epi8(lut1[h >> 15], _mm256_add_epi8(gv, _mm256_set1_epi8(1)));
        *u = _mm256_abs_epi8(v);
        *s = v; /* never 0: sign_epi8 by v is the sign by v's sign */
    }
}

/* the scales of super-block b without d: per group (ls[8]) or per 16 values (ls[16]) */
static inline __attribute__((always_inline)) void grid_scales(int kind, const uint8_t *b,
                                                              float *ls) {
    for (int i = 0; i < 8 && kind <= G_IQ1_S; i++) {
        if (kind == G_IQ1_S) {
            ls[i] = (float)(2 * ((le16(b + 34 + 2 * i) >> 12) & 7) + 1) * 0.125f; /* exact */
        } else {
            uint32_t aux = le32(kind == G_IQ3_XXS ? b + 66 + 4 * i : b + 6 + 8 * i);
            ls[i] = (0.5f + (float)(aux >> 28)) * (kind == G_IQ3_XXS ? 0.5f : 0.25f);
        }
    }
    for (int s = 0; s < 16 && kind > G_IQ1_S; s++)
        ls[s] = (0.5f + (float)nibble(b + (kind == G_IQ2_XS ? 66 : 74), s)) * 0.25f;
}

/* 8 int32 lanes of the group's dot with x: signs onto x, then |w| . x */
static inline __m256i signed_dot32(__m256i u, __m256i s, const int8_t *x) {
    __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), s);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void grid_rowdot_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out, int kind) {
    __m256 acc[2][VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    int per16 = kind > G_IQ1_S;
    /* IQ1_S: 8 g + delta for g + 1 = 0, 1, 2; [0]: delta +1, [1]: delta -1 */
    const __m256i lut1[2] = {_mm256_setr_epi8(-7, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              -7, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm256_setr_epi8(-9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              -9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)};
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + GRID_BYTES[kind] * c;
        float ls[16], d = f16(b);
        grid_scales(kind, b, ls);
        if (!per16) {
            __m256 d8 = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(ls));
            for (int64_t j = 0; j < nt; j++) {
                __m256 xd = _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c);
                _mm256_store_ps(scx[j], _mm256_mul_ps(d8, xd));
            }
        }
        for (int i = 0; i < 8; i += 2) { /* two groups: one fma chain each */
            __m256i u0, s0, u1, s1;
            grid_codes(kind, b, i, a->tab, lut1, &u0, &s0);
            grid_codes(kind, b, i + 1, a->tab, lut1, &u1, &s1);
            __m256 h0, h1; /* per16: the scales of values 0-15 (lanes 0-3) and 16-31 */
            if (per16) {
                h0 = _mm256_set_m128(_mm_set1_ps(d * ls[2 * i + 1]), _mm_set1_ps(d * ls[2 * i]));
                h1 = _mm256_set_m128(_mm_set1_ps(d * ls[2 * i + 3]), _mm_set1_ps(d * ls[2 * i + 2]));
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
