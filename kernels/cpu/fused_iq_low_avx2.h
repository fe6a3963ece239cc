/* AVX2 row dots for IQ3_XXS and IQ2_XXS (included by fused_avx2.h), the low-bit i-quants
 * whose 32-value groups each carry one word of 4 sign indices and a 4-bit scale
 * (decode_iq_low.h has the layouts). Per group: its grid points gathered into one register
 * (8 points of 4 values, or 4 of 8), its 4 sign indices looked up in KSIGNS as 32 bits made
 * byte masks, dotted with every activation that uses the row; the 8 groups' scales times the
 * activation's 8 block scales in one multiply, as rowdot_iq3_s. The other low-bit types take
 * the decode-then-dot path.
 */

/* kind 0: IQ3_XXS (98 bytes: d | qs 64 | 8 x u32), 1: IQ2_XXS (66: d | 8 x (qs 4 | u32)) */
static inline __attribute__((always_inline)) void rowdot_xxs_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out, int kind) {
    __m256 acc[2][VEC_TILE];
    float scx[VEC_TILE][8] __attribute__((aligned(32))); /* broadcast from memory: a load */
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    const uint8_t *ks = a->tab + KSIGNS;
    const uint8_t *grid = a->tab + (kind ? IQ2_XXS_GRID : IQ3_XXS_GRID);
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + (kind ? 66 : 98) * c;
        uint32_t aux[8];
        float ls[8];
        for (int i = 0; i < 8; i++) {
            aux[i] = le32(kind ? b + 6 + 8 * i : b + 66 + 4 * i);
            ls[i] = (0.5f + (float)(aux[i] >> 28)) * (kind ? 0.25f : 0.5f); /* exact */
        }
        __m256 d8 = _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_loadu_ps(ls));
        for (int64_t j = 0; j < nt; j++) {
            __m256 xd = _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c);
            _mm256_store_ps(scx[j], _mm256_mul_ps(d8, xd));
        }
        for (int i = 0; i < 8; i++) { /* group i: values 32i .. 32i + 31 */
            uint64_t g[4];
            if (kind) {
                for (int l = 0; l < 4; l++) memcpy(g + l, grid + 8 * b[2 + 8 * i + l], 8);
            } else {
                uint32_t *g4 = (uint32_t *)g;
                for (int k = 0; k < 8; k++) memcpy(g4 + k, grid + 4 * b[2 + 8 * i + k], 4);
            }
            uint8_t sb[4];
            for (int l = 0; l < 4; l++) sb[l] = ks[(aux[i] >> (7 * l)) & 127];
            __m256i w = _mm256_loadu_si256((const __m256i *)g);
            grid_group_dot(w, bit_bytes(sb), a, vec, nt, 256 * c + 32 * i, i, scx, acc);
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

static void rowdot_iq3_xxs(const uint8_t *row, const uint8_t *aux, int64_t cols,
                           const acts_t *a, const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_xxs_body(row, cols / 256, a, vec, 1, out, 0);
    else
        rowdot_xxs_body(row, cols / 256, a, vec, nt, out, 0);
}

static void rowdot_iq2_xxs(const uint8_t *row, const uint8_t *aux, int64_t cols,
                           const acts_t *a, const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_xxs_body(row, cols / 256, a, vec, 1, out, 1);
    else
        rowdot_xxs_body(row, cols / 256, a, vec, nt, out, 1);
}

static rowdot_fn fused_rowdot_iq_low(int qtype) {
    switch (qtype) {
    case T_IQ3_XXS: return rowdot_iq3_xxs;
    case T_IQ2_XXS: return rowdot_iq2_xxs;
    default: return NULL;
    }
}
