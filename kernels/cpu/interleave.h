/* Eight rows interleaved: a layout of the 32-value block types (Q4_0, Q4_1, Q8_0) for the dense
 * products, made once when a weight is prepared (kernels/cpu/interleave.py), and its AVX2 dots.
 * Included by experts.c after fused_avx2.h. llama.cpp's CPU backend repacks Q4_0 into
 * interleaved groups for the same reason; this layout and its dots are Strata's own.
 *
 * Why: a GGUF row's blocks follow one another, so a row's dot gathers its blocks' scales with
 * scalar loads, widens 16 bytes of nibbles into a 32-byte register per block and reduces 8
 * lanes to one float at the row's end: some 13 instructions per 32 values, which left a
 * single token's products at 15-19 GB/s on a host that reads 50 (compute-bound). Here the 8
 * rows of a group share each block index, and one dot-product instruction (VNNI's dpbusd:
 * four byte products per 32-bit lane) multiplies 4 values of all 8 rows by the same 4
 * activation bytes, broadcast from memory: about 4.5 instructions per 32 values, and a group's
 * 8 results land in one register, stored at once as 8 outputs.
 *
 * Group g (rows 8g .. 8g + 7) is its nb = cols / 32 blocks back to back; block b holds
 *   X8_Q4 (160 B): d[8] fp16 | m[8] fp16 | codes 128 B    value = d q + m, q in 0..15
 *                  (Q4_1 as stored; Q4_0's value d (q - 8) with m = -8 d, exact in fp16)
 *   X8_Q8 (272 B): d[8] fp16 | codes 256 B (int8)         value = d q
 * The codes are 32-byte chunks whose bytes 4r .. 4r + 3 belong to row r: a Q4 chunk c holds
 * values 8c + k (low nibbles) and 8c + 4 + k (high nibbles) of each row, k < 4; a Q8 chunk c
 * values 4c + k. Block dots are exact integers (a Q8 code is offset by 128 to be unsigned
 * for dpbusd, and 128 times the activation block's sum taken off); each group's 8 float sums
 * run over the blocks in order, one thread per group: the bits depend on neither the thread
 * count nor the other activations of the call.
 */

enum { X8_Q4 = 1, X8_Q8 = 2 };
static const int X8_BLOCK[3] = {0, 160, 272};

/* the layout kind a GGUF type is interleaved into, else 0 */
static int x8_kind(int qtype) {
    return qtype == T_Q4_0 || qtype == T_Q4_1 ? X8_Q4 : qtype == T_Q8_0 ? X8_Q8 : 0;
}

/* fp16 bits of -8 times the fp16 h, or -1 where that is not an exact normal fp16 */
static int x8_minus8(uint16_t h) {
    int exp = (h >> 10) & 0x1F;
    if (exp == 0) return (h & 0x3FF) ? -1 : 0x8000; /* a zero scale: -0 */
    if (exp + 3 >= 31) return -1;
    return (int)((h ^ 0x8000) + (3 << 10));
}

/* The 4-bit code v (0..31 in a Q4_0/Q4_1 block) of a block's 16 code bytes */
static inline uint8_t q4_code(const uint8_t *qs, int v) {
    return v < 16 ? qs[v] & 15 : qs[v - 16] >> 4;
}

/* dst (rows / 8 groups of the layout) from src's GGUF rows [rows, cols] of qtype. Returns 0,
 * -1 (the type has no interleaved layout), -2 (rows not a multiple of 8 or cols of 32), -4 (a
 * Q4_0 scale whose -8 d is no normal fp16: left in its own layout). */
int strata_interleave(const uint8_t *src, int qtype, int64_t rows, int64_t cols, uint8_t *dst) {
    int kind = x8_kind(qtype), bv, bb;
    if (!kind || strata_block(qtype, &bv, &bb)) return -1;
    if (rows % 8 || cols % 32) return -2;
    const int64_t nb = cols / 32, row_bytes = nb * bb;
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = dst + (g * nb + b) * X8_BLOCK[kind];
            for (int r = 0; r < 8; r++) {
                const uint8_t *p = src + (8 * g + r) * row_bytes + b * bb;
                memcpy(o + 2 * r, p, 2);
                if (kind == X8_Q8) {
                    for (int c = 0; c < 8; c++) memcpy(o + 16 + 32 * c + 4 * r, p + 2 + 4 * c, 4);
                    continue;
                }
                const uint8_t *qs = p + (qtype == T_Q4_1 ? 4 : 2);
                if (qtype == T_Q4_1) {
                    memcpy(o + 16 + 2 * r, p + 2, 2);
                } else {
                    int m = x8_minus8((uint16_t)(p[0] | p[1] << 8));
                    if (m < 0) return -4;
                    o[16 + 2 * r] = (uint8_t)(m & 0xFF), o[17 + 2 * r] = (uint8_t)(m >> 8);
                }
                for (int c = 0; c < 4; c++)
                    for (int k = 0; k < 4; k++)
                        o[32 + 32 * c + 4 * r + k] =
                            (uint8_t)(q4_code(qs, 8 * c + k) | q4_code(qs, 8 * c + 4 + k) << 4);
            }
        }
    return 0;
}

#ifdef __AVX2__
/* acc + 8 int32 lanes of 4 byte products each, u unsigned and x signed: dpbusd where the
 * CPU has it; else maddubs + madd, whose int16 pair sums cannot saturate for u < 128 */
static inline __m256i dpbusd_acc(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* the 4 activation bytes at x in every lane */
static inline __m256i bcast4(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}

/* one block's 8 exact integer dots (a lane per row) with the activation's 32 values x */
static inline __attribute__((always_inline)) __m256i x8_block_q4(const __m256i *w,
                                                                 const int8_t *x) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256(); /* two chains */
    for (int c = 0; c < 4; c++) {
        lo = dpbusd_acc(lo, w[2 * c], bcast4(x + 8 * c));
        hi = dpbusd_acc(hi, w[2 * c + 1], bcast4(x + 8 * c + 4));
    }
    return _mm256_add_epi32(lo, hi);
}

static inline __attribute__((always_inline)) __m256i x8_block_q8(const uint8_t *codes,
                                                                 const int8_t *x, int sum) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    const __m256i flip = _mm256_set1_epi8((char)0x80); /* q + 128: unsigned */
    for (int c = 0; c < 8; c += 2) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(codes + 32 * c + 32));
        lo = dpbusd_acc(lo, _mm256_xor_si256(w0, flip), bcast4(x + 4 * c));
        hi = dpbusd_acc(hi, _mm256_xor_si256(w1, flip), bcast4(x + 4 * c + 4));
    }
    return _mm256_sub_epi32(_mm256_add_epi32(lo, hi), _mm256_set1_epi32(128 * sum));
#else
    (void)sum; /* |q| and x with q's sign: maddubs takes them as unsigned times signed */
    for (int c = 0; c < 8; c += 2) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(codes + 32 * c + 32));
        lo = dpbusd_acc(lo, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(bcast4(x + 4 * c), w0));
        hi = dpbusd_acc(hi, _mm256_sign_epi8(w1, w1),
                        _mm256_sign_epi8(bcast4(x + 4 * c + 4), w1));
    }
    return _mm256_add_epi32(lo, hi);
#endif
}

/* outs[j][r .. r + 7] = group g's rows . activation vec[j], j < nt (a constant per copy:
 * the accumulators stay in registers) */
static inline __attribute__((always_inline)) void x8_group(
    const uint8_t *g, int64_t nb, const acts_t *a, const int64_t *vec, int nt,
    float *const *outs, int64_t r, int kind) {
    __m256 acc[X8_TILE], corr[X8_TILE];
    for (int j = 0; j < nt; j++) acc[j] = corr[j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const int64_t k = a->k;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * X8_BLOCK[kind];
        __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m256 m8 = _mm256_setzero_ps();
        __m256i w[8];
        if (kind == X8_Q4) {
            m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * c));
                w[2 * c] = _mm256_and_si256(v, m4);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
        }
        for (int j = 0; j < nt; j++) {
            const int64_t ib = vec[j] * (k / 32) + b;
            const int8_t *x = a->q + vec[j] * k + 32 * b;
            __m256i s = kind == X8_Q4
                            ? x8_block_q4(w, x)
                            : x8_block_q8(p + 16, x, a->s[2 * ib] + a->s[2 * ib + 1]);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                     _mm256_mul_ps(d8, _mm256_set1_ps(a->d[ib])), acc[j]);
            if (kind == X8_Q4) corr[j] = _mm256_fmadd_ps(m8, _mm256_set1_ps(a->xf[ib]), corr[j]);
        }
    }
    for (int j = 0; j < nt; j++) _mm256_storeu_ps(outs[j] + r, _mm256_add_ps(acc[j], corr[j]));
}

#define X8_PREFETCH_GROUPS 1 /* groups ahead: a group is a few KiB, far ahead of one row */

/* outs[j][r] for rows r in [r0, r1) (multiples of 8) of m (interleaved), j < nv */
static void rows_dot_x8(const mat_t *m, int64_t r0, int64_t r1, const acts_t *a,
                        const int64_t *vec, float *const *outs, int64_t nv) {
    const int64_t nb = m->cols / 32, gbytes = nb * X8_BLOCK[m->x8], groups = m->rows / 8;
    for (int64_t g = r0 / 8; g < r1 / 8; g++) {
        const uint8_t *p = m->base + g * gbytes;
        if (g + X8_PREFETCH_GROUPS < groups)
            for (int64_t off = 0; off < gbytes; off += 64)
                __builtin_prefetch(p + X8_PREFETCH_GROUPS * gbytes + off, 0, 3);
        for (int64_t v0 = 0; v0 < nv; v0 += X8_TILE) {
            int64_t nt = nv - v0 < X8_TILE ? nv - v0 : X8_TILE;
#define X8_CASE(n, kind) x8_group(p, nb, a, vec + v0, n, outs + v0, 8 * g, kind)
            if (m->x8 == X8_Q4) {
                switch (nt) {
                case 1: X8_CASE(1, X8_Q4); break;
                case 2: X8_CASE(2, X8_Q4); break;
                case 3: X8_CASE(3, X8_Q4); break;
                default: X8_CASE(4, X8_Q4); break;
                }
            } else {
                switch (nt) {
                case 1: X8_CASE(1, X8_Q8); break;
                case 2: X8_CASE(2, X8_Q8); break;
                case 3: X8_CASE(3, X8_Q8); break;
                default: X8_CASE(4, X8_Q8); break;
                }
            }
#undef X8_CASE
        }
    }
}
#endif

/* 1 where this build has the interleaved dots (AVX2 with F16C), else 0: the layout is only
 * made where it is read */
int strata_interleaved_dots(void) {
#if defined(__AVX2__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}
