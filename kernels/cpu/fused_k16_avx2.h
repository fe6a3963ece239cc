/* AVX2 row dots for the types with a scale per 16 values (Q6_K, Q2_K, Q3_K), included by
 * fused_avx2.h (which has dot32, udot32 and the row-dot conventions). The 16 scales of a
 * super-block are two float vectors; times the activation's 8 block scales (each taken
 * twice) they give the per-16 products, and each 32 values take their pair with one
 * permute. */

/* Q6_K: 16 scales (one per 16 values) times the activation's block scales, two multiplies
 * per super-block; each 32 values then take their pair of products with one permute */
static inline __attribute__((always_inline)) void rowdot_q6_k_body(
    const uint8_t *row, const uint8_t *ds, int64_t stride, int64_t nsb, const acts_t *a,
    const int64_t *vec, int64_t nt, float *out) { /* ds: the blocks' d (split), else NULL */
    __m256 acc[2][VEC_TILE], p[VEC_TILE][2];
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    const __m256i off = _mm256_set1_epi8(32);
    const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + stride * c;
        __m256 d = _mm256_set1_ps(f16(ds ? ds + 2 * c : b + 208));
        __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        __m128i sc_hi = _mm_srli_si128(sc, 8);
        __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc_hi)));
        for (int64_t j = 0; j < nt; j++) { /* p[j][i / 4] lane 2 (i % 4) + half: block i */
            __m256 xd = _mm256_loadu_ps(a->d + vec[j] * (a->k / 32) + 8 * c);
            p[j][0] = _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(xd, pairs_lo));
            p[j][1] = _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(xd, pairs_hi));
        }
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
                /* block 4h + k: lanes 0-3 take scale 2k, 4-7 scale 2k + 1 of p[.][h] */
                __m256i idx = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                                2 * k + 1, 2 * k + 1);
                for (int64_t j = 0; j < nt; j++) {
                    __m256i s = dot32(aw, w, a->q + vec[j] * a->k + 256 * c + 128 * h + 32 * k);
                    __m256 sc8 = _mm256_permutevar8x32_ps(p[j][h], idx);
                    acc[k & 1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc8, acc[k & 1][j]);
                }
            }
        }
    }
    for (int64_t j = 0; j < nt; j++) out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j]));
}

static void rowdot_q6_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_q6_k_body(row, NULL, 210, cols / 256, a, vec, 1, out);
    else
        rowdot_q6_k_body(row, NULL, 210, cols / 256, a, vec, nt, out);
}

/* split Q6_K: row at the row's 208-byte block bodies, aux at its blocks' d */
static void rowdot_q6_k_split(const uint8_t *row, const uint8_t *aux, int64_t cols,
                              const acts_t *a, const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_q6_k_body(row, aux, 208, cols / 256, a, vec, 1, out);
    else
        rowdot_q6_k_body(row, aux, 208, cols / 256, a, vec, nt, out);
}

/* Q2_K (kind 0) and Q3_K (kind 1): a scale per 16 values. Codes stay unsigned (Q2_K 0..3,
 * Q3_K 0..7 with the high bit) and what comes off (Q2_K's minimums, Q3_K's 4) goes through
 * the activation's 16-value sums, two fmas per super-block. As Q6_K, each 32 values take
 * their pair of (weight scale x activation scale) products with one permute. */
static inline __attribute__((always_inline)) void rowdot_k16_body(
    const uint8_t *row, int64_t nsb, const acts_t *a, const int64_t *vec, int64_t nt,
    float *out, int kind) {
    __m256 acc[2][VEC_TILE], offs[VEC_TILE], p[VEC_TILE][2];
    for (int64_t j = 0; j < nt; j++) acc[0][j] = acc[1][j] = offs[j] = _mm256_setzero_ps();
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const int bytes = kind == 0 ? 84 : 110;
    for (int64_t c = 0; c < nsb; c++) {
        const uint8_t *b = row + bytes * c;
        __m256 s0, s1, o0, o1; /* value = s q - o, s and o per 16 values (0-7, 8-15) */
        const __m128i m4 = _mm_set1_epi8(15);
        if (kind == 0) { /* a byte per 16 values: scale (low nibble), minimum (high) */
            __m128i sc = _mm_loadu_si128((const __m128i *)b);
            __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
            __m256 d = _mm256_set1_ps(f16(b + 80)), dmin = _mm256_set1_ps(f16(b + 82));
            s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
            s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
            o0 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
            __m128i hi8 = _mm_srli_si128(hi, 8);
            o1 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi8)));
        } else { /* 6-bit scales: low nibbles of bytes 0-7 then their high nibbles; 2-bit
                  * field s / 4 of byte 8 + s % 4 on top; less 32 */
            __m128i lo8 = _mm_loadl_epi64((const __m128i *)(b + 96));
            __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(lo8, m4),
                                            _mm_and_si128(_mm_srli_epi16(lo8, 4), m4));
            uint32_t u = le32(b + 104), m = 0x03030303;
            __m128i hi = _mm_setr_epi32((int)(u & m), (int)((u >> 2) & m), (int)((u >> 4) & m),
                                        (int)((u >> 6) & m));
            __m128i sc = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
            __m256 d = _mm256_set1_ps(f16(b + 108)), four = _mm256_set1_ps(4.0f);
            s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
            o0 = _mm256_mul_ps(four, s0), o1 = _mm256_mul_ps(four, s1);
        }
        for (int64_t j = 0; j < nt; j++) {
            int64_t v = vec[j];
            __m256 xd = _mm256_loadu_ps(a->d + v * (a->k / 32) + 8 * c);
            const float *x16 = a->x16 + v * (a->k / 16) + 16 * c;
            p[j][0] = _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(xd, pairs_lo));
            p[j][1] = _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(xd, pairs_hi));
            offs[j] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(x16), offs[j]);
            offs[j] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(x16 + 8), offs[j]);
        }
        const __m256i hm = kind ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *qs = b + (kind == 0 ? 16 : 32) + 32 * h;
            __m256i qv = _mm256_loadu_si256((const __m256i *)qs);
            for (int k = 0; k < 4; k++) { /* 2-bit field k of byte l: value 128 h + 32 k + l */
                __m256i w = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * k), m2);
                if (kind) {
                    __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + k), one);
                    w = _mm256_or_si256(w, _mm256_slli_epi16(hb, 2));
                }
                __m256i idx = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1,
                                                2 * k + 1, 2 * k + 1);
                for (int64_t j = 0; j < nt; j++) {
                    __m256i sum = udot32(w, a->q + vec[j] * a->k + 256 * c + 128 * h + 32 * k);
                    __m256 sc8 = _mm256_permutevar8x32_ps(p[j][h], idx);
                    acc[k & 1][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc8, acc[k & 1][j]);
                }
            }
        }
    }
    for (int64_t j = 0; j < nt; j++)
        out[j] = hsum8(_mm256_add_ps(acc[0][j], acc[1][j])) - hsum8(offs[j]);
}

static void rowdot_q2_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_k16_body(row, cols / 256, a, vec, 1, out, 0);
    else
        rowdot_k16_body(row, cols / 256, a, vec, nt, out, 0);
}

static void rowdot_q3_k(const uint8_t *row, const uint8_t *aux, int64_t cols, const acts_t *a,
                        const int64_t *vec, int64_t nt, float *out) {
    if (nt == 1)
        rowdot_k16_body(row, cols / 256, a, vec, 1, out, 1);
    else
        rowdot_k16_body(row, cols / 256, a, vec, nt, out, 1);
}
