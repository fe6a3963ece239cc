/* AVX2 row dots for the low-bit i-quants (included by fused_avx2.h; layouts in
 * decode_iq_low.h). Per 32-value group: its grid points gathered into one register (8 points
 * of 4 values, or 4 of 8) as magnitudes, its signs as byte masks (KSIGNS bytes of the stored
 * 7-bit indices, or the stored bits), dotted with every activation that uses the row.
 * Scales: IQ3_XXS, IQ2_XXS and IQ1_S have one per group, the 8 of a super-block times the
 * activation's 8 block scales in one multiply (grid_group_dot, as IQ3_S); IQ2_XS and IQ2_S
 * have one per 16 values, applied to the dot's two halves (lanes 0-3: values 0-15) by one
 * multiply before the activation's scale. IQ1_S's values 8 g +- 1 (decode_iq_low.h) are
 * signed: their magnitudes and signs are split as the others'.
 */

enum { G_IQ3_XXS, G_IQ2_XXS, G_IQ1_S, G_IQ2_XS, G_IQ2_S }; /* per 16 from G_IQ2_XS on */
static const int GRID_BYTES[5] = {98, 66, 50, 74, 82};

/* 8 grid points of 8 values: 4 entries of `grid` (8 bytes each) */
static inline __m256i grid8x4(const uint8_t *grid, const int *index) {
    uint64_t g[4];
    for (int l = 0; l < 4; l++) memcpy(g + l, grid + 8 * index[l], 8);
    return _mm256_loadu_si256((const __m256i *)g);
}

/* group i of super-block b: the magnitudes w and the masks m (0xFF: negative) */
static inline __attribute__((always_inline)) void grid_codes(
    int kind, const uint8_t *b, int i, const uint8_t *tab, __m256i *w, __m256i *m) {
    const uint8_t *ks = tab + KSIGNS;
    uint8_t sb[4];
    int index[4];
    if (kind == G_IQ3_XXS) {
        uint32_t aux = le32(b + 66 + 4 * i), g[8];
        for (int k = 0; k < 8; k++) memcpy(g + k, tab + IQ3_XXS_GRID + 4 * b[2 + 8 * i + k], 4);
        for (int l = 0; l < 4; l++) sb[l] = ks[(aux >> (7 * l)) & 127];
        *w = _mm256_loadu_si256((const __m256i *)g);
    } else if (kind == G_IQ2_XXS) {
        const uint8_t *p = b + 2 + 8 * i;
        uint32_t aux = le32(p + 4);
        for (int l = 0; l < 4; l++) index[l] = p[l], sb[l] = ks[(aux >> (7 * l)) & 127];
        *w = grid8x4(tab + IQ2_XXS_GRID, index);
    } else if (kind == G_IQ2_XS) {
        for (int l = 0; l < 4; l++) {
            unsigned q = le16(b + 2 + 8 * i + 2 * l);
            index[l] = (int)(q & 511), sb[l] = ks[q >> 9];
        }
        *w = grid8x4(tab + IQ2_XS_GRID, index);
    } else if (kind == G_IQ2_S) {
        for (int l = 0; l < 4; l++) index[l] = b[2 + 4 * i + l] | ((b[66 + i] >> (2 * l)) & 3) << 8;
        memcpy(sb, b + 34 + 4 * i, 4);
        *w = grid8x4(tab + IQ2_S_GRID, index);
    } else { /* G_IQ1_S */
        unsigned h = le16(b + 34 + 2 * i);
        for (int l = 0; l < 4; l++) index[l] = b[2 + 4 * i + l] | ((h >> (3 * l)) & 7) << 8;
        __m256i g = grid8x4(tab + IQ1_S_GRID, index), g2 = _mm256_add_epi8(g, g);
        __m256i g8 = _mm256_add_epi8(_mm256_add_epi8(g2, g2), _mm256_add_epi8(g2, g2));
        __m256i v = _mm256_add_epi8(g8, _mm256_set1_epi8(h & 0x8000 ? -1 : 1));
        *w = _mm256_abs_epi8(v);
        *m = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
        return;
    }
    *m = bit_bytes(sb);
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

static inline __attribute__((always_inline)) void grid_rowdot_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out, int kind) {
    __m256 acc[2][VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    int per16 = kind > G_IQ1_S;
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
        for (int i = 0; i < 8; i++) {
            __m256i w, m;
            grid_codes(kind, b, i, a->tab, &w, &m);
            if (!per16) {
                grid_group_dot(w, m, a, vec, nt, 256 * c + 32 * i, i, scx, acc);
                continue;
            }
            __m256 half = /* the scales of values 0-15 (lanes 0-3) and 16-31 */
                _mm256_set_m128(_mm_set1_ps(d * ls[2 * i + 1]), _mm_set1_ps(d * ls[2 * i]));
            __m256i ws = _mm256_sub_epi8(_mm256_xor_si256(w, m), m); /* signed */
            for (int64_t j = 0; j < nt; j++) {
                __m256i s = dot32(w, ws, a->q + vec[j] * a->k + 256 * c + 32 * i);
                __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), half);
                __m256 xd = _mm256_broadcast_ss(a->d + vec[j] * (a->k / 32) + 8 * c + i);
                acc[i & 1][j] = _mm256_fmadd_ps(f, xd, acc[i & 1][j]);
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
