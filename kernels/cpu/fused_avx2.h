/* AVX2 row dots for the hottest types (Q4_0 plain and split, Q8_0, Q4_K, Q6_K), included by
 * experts.c when __AVX2__: a block is decoded into a register and dotted at once with every
 * activation that uses the row, with no trip through the decode buffer. Measured on a 2-core
 * EPYC VM (bench/cpu_experts.py), the decode-then-dot path ran these 2-4x slower.
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
    __m256 acc[2][VEC_TILE];
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    int64_t b = 0;
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

static inline __attribute__((always_inline)) void rowdot_q4_k_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out) {
    __m256 acc[VEC_TILE], acc1[VEC_TILE]; /* two fma chains */
    float mins[VEC_TILE];
    for (int64_t j = 0; j < nt; j++) acc[j] = acc1[j] = _mm256_setzero_ps(), mins[j] = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + 144 * c, *qs = b + 16;
        float fs[16], fm[16];
        k4_header(b, fs, fm); /* fs, fm per 16 values; equal in pairs */
        for (int r = 0; r < 4; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * r));
            __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            for (int64_t j = 0; j < nt; j++) {
                int64_t ib = vec[j] * (a->k / 32) + 8 * c + 2 * r; /* sub-block 2r's x block */
                const int8_t *x = a->q + vec[j] * a->k + 256 * c + 64 * r;
                __m256i s0 = udot32(lo, x), s1 = udot32(hi, x + 32);
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0),
                                         _mm256_set1_ps(fs[4 * r] * a->d[ib]), acc[j]);
                acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1),
                                          _mm256_set1_ps(fs[4 * r + 2] * a->d[ib + 1]), acc1[j]);
                const int16_t *xs = a->s + 2 * ib;
                mins[j] += fm[4 * r] * a->d[ib] * (float)(xs[0] + xs[1]) +
                           fm[4 * r + 2] * a->d[ib + 1] * (float)(xs[2] + xs[3]);
            }
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[j], acc1[j])) - mins[j];
}

static void rowdot_q4_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_q4_k_body(row, cols / 256, a, vec, 1, out);
    else
        rowdot_q4_k_body(row, cols / 256, a, vec, nt, out);
}

static inline __attribute__((always_inline)) void rowdot_q6_k_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out) {
    __m256 acc[2][VEC_TILE]; /* two fma chains, by k's parity */
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    const __m256i off = _mm256_set1_epi8(32);
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + 210 * c;
        float d = f16(b + 208);
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
                __m256i w = _mm256_sub_epi8(_mm256_or_si256(lo[k], _mm256_slli_epi16(hi, 4)), off);
                __m256i aw = _mm256_sign_epi8(w, w);
                int s = 8 * h + 2 * k; /* the 16-value sub-blocks s, s + 1 */
                float d0 = d * (float)(int8_t)b[192 + s], d1 = d * (float)(int8_t)b[193 + s];
                for (int64_t j = 0; j < nt; j++) {
                    int64_t ib = vec[j] * (a->k / 32) + 8 * c + 4 * h + k;
                    __m256i p = dot32(aw, w, a->q + vec[j] * a->k + 256 * c + 128 * h + 32 * k);
                    float xd = a->d[ib];
                    __m256 sc = _mm256_set_m128(_mm_set1_ps(d1 * xd), _mm_set1_ps(d0 * xd));
                    acc[k & 1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[k & 1][j]);
                }
            }
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

static void rowdot_q6_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_q6_k_body(row, cols / 256, a, vec, 1, out);
    else
        rowdot_q6_k_body(row, cols / 256, a, vec, nt, out);
}

static rowdot_fn fused_rowdot(int qtype, int split) {
    switch (qtype) {
    case T_Q4_0: return split ? rowdot_q4_0_split : rowdot_q4_0;
    case T_Q8_0: return rowdot_q8_0;
    case T_Q4_K: return rowdot_q4_k;
    case T_Q6_K: return rowdot_q6_k;
    default: return NULL;
    }
}
