/* Eight rows interleaved: a layout of the common weight types (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)
 * for the dense products, made once when a weight is prepared (CpuExperts.interleave in
 * kernels/cpu/experts.py), and its AVX2 dots. Included by experts.c after fused_avx2.h.
 * llama.cpp's CPU backend repacks Q4_0 and Q4_K into interleaved groups for the same reason;
 * this layout and its dots are Strata's own.
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
 * Group g (rows 8g .. 8g + 7) is its blocks back to back; block b holds
 *   X8_Q4 (32 values, 160 B): d[8] fp16 | m[8] fp16 | codes 128 B      value = d q + m
 *          (Q4_1 as stored; Q4_0's value d (q - 8) with m = -8 d, exact in fp16)
 *   X8_Q8 (32 values, 272 B): d[8] fp16 | codes 256 B (int8)           value = d q
 *   X8_Q4K (256 values, 1184 B): d[8] | dmin[8] fp16 | sc[8 sub-blocks][8 rows] |
 *          mn[8][8] (the 6-bit scales and minimums, one byte each) | codes 8 x 128 B
 *          value = d sc q - dmin mn, per sub-block of 32 values
 *   X8_Q6K (256 values, 1680 B): d[8] fp16 | sc[16][8] int8 (per 16 values) | per sub-block
 *          of 32 values: its low 4 bits as 128 B of 4-bit codes, then its high 2 bits as
 *          two 32-byte vectors (below)    value = d sc (q - 32), q in 0..63
 * A Q6_K sub-block's high bits: vector h (h = 0, 1) serves chunks 2h and 2h + 1; its byte
 * 4r + k holds, two bits each from the lowest, the high bits of the values that chunk 2h's
 * low nibble, chunk 2h's high nibble, chunk 2h + 1's low and its high nibble hold there.
 * The codes of 32 values are 32-byte chunks whose bytes 4r .. 4r + 3 belong to row r: a 4-bit
 * chunk c holds values 8c + k (low nibbles) and 8c + 4 + k (high nibbles) of each row, k < 4;
 * an 8-bit chunk c values 4c + k. Block dots are exact integers (an 8-bit code is offset by
 * 128 to be unsigned for dpbusd, and 128 times the activation block's sum taken off); each
 * group's 8 float sums run over the blocks in order, one thread per group: the bits depend on
 * neither the thread count nor the other activations of the call.
 */

#define X8_FLAG (1 << 10) /* or'ed into a GGUF type code: the matrix is in this layout */

enum { X8_Q4 = 1, X8_Q8 = 2, X8_Q4K = 3, X8_Q6K = 4 };
static const int X8_VALUES[5] = {0, 32, 32, 256, 256}; /* a block's values per row */
static const int X8_BLOCK[5] = {0, 160, 272, 1184, 1680}; /* a group's block, bytes */

/* the layout kind a GGUF type is interleaved into, else 0 */
static int x8_kind(int qtype) {
    switch (qtype) {
    case T_Q4_0: case T_Q4_1: return X8_Q4;
    case T_Q8_0: return X8_Q8;
    case T_Q4_K: return X8_Q4K;
    case T_Q6_K: return X8_Q6K;
    default: return 0;
    }
}

/* fp16 bits of -8 times the fp16 h, or -1 where that is not an exact normal fp16 */
static int x8_minus8(uint16_t h) {
    int exp = (h >> 10) & 0x1F;
    if (exp == 0) return (h & 0x3FF) ? -1 : 0x8000; /* a zero scale: -0 */
    if (exp + 3 >= 31) return -1;
    return (int)((h ^ 0x8000) + (3 << 10));
}

/* 32 values' 4-bit codes of row r into the 128-byte chunks at o (see above); code(v) is
 * value v's, from the GGUF block's bytes qs: low nibbles first (Q4_0/Q4_1: values 0-15 low,
 * 16-31 high), or one nibble half of a Q4_K run (shift 0 or 4) */
static void x8_codes4(uint8_t *o, int r, const uint8_t *qs, int run) {
    for (int c = 0; c < 4; c++)
        for (int k = 0; k < 4; k++) {
            int v0 = 8 * c + k, v1 = 8 * c + 4 + k, lo, hi;
            if (run < 0) { /* a 32-value block */
                lo = v0 < 16 ? qs[v0] & 15 : qs[v0 - 16] >> 4;
                hi = v1 < 16 ? qs[v1] & 15 : qs[v1 - 16] >> 4;
            } else { /* a Q4_K sub-block: nibbles `run` (0: low, 4: high) of 32 bytes */
                lo = (qs[v0] >> run) & 15, hi = (qs[v1] >> run) & 15;
            }
            o[32 * c + 4 * r + k] = (uint8_t)(lo | hi << 4);
        }
}

/* a Q6_K block's 256 codes (0..63), as dec_q6_k reads them */
static void q6_codes(const uint8_t *b, uint8_t *q) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++)
                q[128 * h + 32 * k + l] = (uint8_t)(((ql[32 * (k & 1) + l] >> (4 * (k >> 1))) & 15) |
                                                    ((qh[l] >> (2 * k)) & 3) << 4);
    }
}

/* row r's 32 six-bit codes q of a sub-block into its 192 bytes at o (see above) */
static void x8_codes6(uint8_t *o, int r, const uint8_t *q) {
    uint8_t lo[16];
    for (int v = 0; v < 16; v++) lo[v] = q[v] & 15, lo[v] |= (uint8_t)((q[v + 16] & 15) << 4);
    x8_codes4(o, r, lo, -1); /* low 4 bits: values v < 16 low nibbles, 16 + v high */
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) {
            const int c = 2 * h, at[4] = {8 * c + k, 8 * c + 4 + k, 8 * c + 8 + k, 8 * c + 12 + k};
            uint8_t bits = 0;
            for (int f = 0; f < 4; f++) bits |= (uint8_t)((q[at[f]] >> 4) << (2 * f));
            o[128 + 32 * h + 4 * r + k] = bits;
        }
}

/* row r's block p (GGUF) into the group block o; 0, or -4 (a Q4_0 scale: see below) */
static int x8_row(uint8_t *o, int r, const uint8_t *p, int qtype) {
    switch (qtype) {
    case T_Q8_0:
        memcpy(o + 2 * r, p, 2);
        for (int c = 0; c < 8; c++) memcpy(o + 16 + 32 * c + 4 * r, p + 2 + 4 * c, 4);
        return 0;
    case T_Q4_1:
        memcpy(o + 2 * r, p, 2), memcpy(o + 16 + 2 * r, p + 2, 2);
        x8_codes4(o + 32, r, p + 4, -1);
        return 0;
    case T_Q4_0: {
        int m = x8_minus8((uint16_t)(p[0] | p[1] << 8));
        if (m < 0) return -4;
        memcpy(o + 2 * r, p, 2);
        o[16 + 2 * r] = (uint8_t)(m & 0xFF), o[17 + 2 * r] = (uint8_t)(m >> 8);
        x8_codes4(o + 32, r, p + 2, -1);
        return 0;
    }
    case T_Q6_K: {
        uint8_t q[256];
        q6_codes(p, q);
        memcpy(o + 2 * r, p + 208, 2);
        for (int s = 0; s < 16; s++) o[16 + 8 * s + r] = p[192 + s];
        for (int s = 0; s < 8; s++) x8_codes6(o + 144 + 192 * s, r, q + 32 * s);
        return 0;
    }
    default: /* T_Q4_K */
        memcpy(o + 2 * r, p, 2), memcpy(o + 16 + 2 * r, p + 2, 2);
        for (int s = 0; s < 8; s++) {
            int sc, mn;
            scale_min_k4(p + 4, s, &sc, &mn);
            o[32 + 8 * s + r] = (uint8_t)sc, o[96 + 8 * s + r] = (uint8_t)mn;
            x8_codes4(o + 160 + 128 * s, r, p + 16 + 32 * (s / 2), 4 * (s % 2));
        }
        return 0;
    }
}

/* The bytes of a [rows, cols] matrix of qtype in the layout; -1 (the type has none), -2 (rows
 * not a multiple of 8, or cols of the block) */
int64_t strata_interleaved_bytes(int qtype, int64_t rows, int64_t cols) {
    int kind = x8_kind(qtype);
    if (!kind) return -1;
    if (rows % 8 || cols % X8_VALUES[kind]) return -2;
    return rows / 8 * (cols / X8_VALUES[kind]) * X8_BLOCK[kind];
}

/* dst (strata_interleaved_bytes) from src's GGUF rows [rows, cols] of qtype, the groups
 * shared out over `threads`. Returns 0, -1 (the type has no interleaved layout), -2 (rows not
 * a multiple of 8, or cols of the block), -4 (a Q4_0 scale whose -8 d is no normal fp16: the
 * caller keeps the rows in their own layout). */
int strata_interleave(const uint8_t *src, int qtype, int64_t rows, int64_t cols, uint8_t *dst,
                      int threads) {
    const int64_t size = strata_interleaved_bytes(qtype, rows, cols);
    int kind = x8_kind(qtype), bv, bb, bad = 0;
    if (size < 0 || strata_block(qtype, &bv, &bb)) return size < 0 ? (int)size : -1;
    const int64_t nb = cols / bv, row_bytes = nb * bb;
#pragma omp parallel for schedule(static) num_threads(threads < 1 ? 1 : threads) reduction(| : bad)
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t b = 0; b < nb; b++)
            for (int r = 0; r < 8; r++) {
                uint8_t *o = dst + (g * nb + b) * X8_BLOCK[kind];
                bad |= x8_row(o, r, src + (8 * g + r) * row_bytes + b * bb, qtype) != 0;
            }
    return bad ? -4 : 0;
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

/* 32 values of a group's 8 rows in 4-bit codes (the 128 bytes at codes, unpacked once for
 * all nt activations), the rows' scales sc and offsets mn (value = sc q + mn), activation
 * block b32 of each vec[j]: acc[j] += the integer dots times sc times the activation's scale,
 * corr[j] += mn times the activation's block sum */
static inline __attribute__((always_inline)) void x8_sub4(
    const uint8_t *codes, __m256 sc, __m256 mn, int64_t b32, const acts_t *a, const int64_t *vec,
    int nt, __m256 *acc, __m256 *corr) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i w[8];
    for (int c = 0; c < 4; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
        w[2 * c] = _mm256_and_si256(v, m4);
        w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    for (int j = 0; j < nt; j++) {
        const int64_t ib = vec[j] * (a->k / 32) + b32;
        __m256i s = x8_block_q4(w, a->q + vec[j] * a->k + 32 * b32);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(sc, _mm256_set1_ps(a->d[ib])),
                                 acc[j]);
        corr[j] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->xf[ib]), corr[j]);
    }
}

/* 32 values of a group's 8 rows in 6-bit codes (the 192 bytes at codes), the rows' int8
 * scales of its two halves at sc and sc + 8, for the activation blocks b32 of each vec[j]:
 * acc[j] += d times the exact integer sum over both halves of sc (q - 32) x, times the
 * activation's scale */
static inline __attribute__((always_inline)) void x8_sub6(
    const uint8_t *codes, const int8_t *sc, __m256 d8, int64_t b32, const acts_t *a,
    const int64_t *vec, int nt, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    __m256i w[8];
    for (int h = 0; h < 2; h++) {
        __m256i hb = _mm256_loadu_si256((const __m256i *)(codes + 128 + 32 * h));
        const __m256i high[4] = {_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 2), hb,
                                 _mm256_srli_epi16(hb, 2)};
        for (int c = 2 * h; c < 2 * h + 2; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * c));
            w[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4),
                                       _mm256_and_si256(high[2 * (c - 2 * h)], m2));
            w[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                           _mm256_and_si256(high[2 * (c - 2 * h) + 1], m2));
        }
    }
    const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc));
    const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8)));
    for (int j = 0; j < nt; j++) {
        const int64_t ib = vec[j] * (a->k / 32) + b32;
        const int8_t *x = a->q + vec[j] * a->k + 32 * b32;
        __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256(); /* values 0-15, 16-31 */
        for (int i = 0; i < 4; i++) {
            h0 = dpbusd_acc(h0, w[i], bcast4(x + 4 * i));
            h1 = dpbusd_acc(h1, w[4 + i], bcast4(x + 16 + 4 * i));
        }
        h0 = _mm256_sub_epi32(h0, _mm256_set1_epi32(32 * a->s[2 * ib]));
        h1 = _mm256_sub_epi32(h1, _mm256_set1_epi32(32 * a->s[2 * ib + 1]));
        __m256i sum = _mm256_add_epi32(_mm256_mullo_epi32(h0, s0), _mm256_mullo_epi32(h1, s1));
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                 _mm256_mul_ps(d8, _mm256_set1_ps(a->d[ib])), acc[j]);
    }
}

/* 8 unsigned bytes at p as floats */
static inline __m256 u8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 ph8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* outs[j][r .. r + 7] = group g's rows (nb blocks) . activation vec[j], j < nt (a constant
 * per copy: the accumulators stay in registers) */
static inline __attribute__((always_inline)) void x8_group(
    const uint8_t *g, int64_t nb, const acts_t *a, const int64_t *vec, int nt,
    float *const *outs, int64_t r, int kind) {
    __m256 acc[X8_TILE], corr[X8_TILE];
    for (int j = 0; j < nt; j++) acc[j] = corr[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = g + b * X8_BLOCK[kind];
        if (kind == X8_Q4) {
            x8_sub4(p + 32, ph8(p), ph8(p + 16), b, a, vec, nt, acc, corr);
        } else if (kind == X8_Q4K) { /* 8 sub-blocks, each its 6-bit scale and minimum */
            __m256 d8 = ph8(p), dm8 = _mm256_sub_ps(_mm256_setzero_ps(), ph8(p + 16));
            for (int s = 0; s < 8; s++)
                x8_sub4(p + 160 + 128 * s, _mm256_mul_ps(d8, u8x8_ps(p + 32 + 8 * s)),
                        _mm256_mul_ps(dm8, u8x8_ps(p + 96 + 8 * s)), 8 * b + s, a, vec, nt, acc,
                        corr);
        } else if (kind == X8_Q6K) {
            for (int s = 0; s < 8; s++)
                x8_sub6(p + 144 + 192 * s, (const int8_t *)p + 16 + 16 * s, ph8(p), 8 * b + s, a,
                        vec, nt, acc);
        } else {
            __m256 d8 = ph8(p);
            for (int j = 0; j < nt; j++) {
                const int64_t ib = vec[j] * (a->k / 32) + b;
                __m256i s = x8_block_q8(p + 16, a->q + vec[j] * a->k + 32 * b,
                                        a->s[2 * ib] + a->s[2 * ib + 1]);
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                         _mm256_mul_ps(d8, _mm256_set1_ps(a->d[ib])), acc[j]);
            }
        }
    }
    for (int j = 0; j < nt; j++) _mm256_storeu_ps(outs[j] + r, _mm256_add_ps(acc[j], corr[j]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Two groups at once in 512-bit registers (16 rows: group g's 8 in the low
 * half, g + 1's in the high): each activation's 4 bytes broadcast once for 16 rows, and its
 * scale and block sum applied to 16 rows by one multiply-add each, where the 256-bit dots
 * spent those per 8 rows: products of 64 tokens 1.24-1.53x faster on the 2-core VM (Sapphire
 * Rapids; SmolLM2's Q4_1 shapes and a Q4_0 one), 1 and 9 tokens within 0.94-1.18x
 * (bench/results/2026-12-07-cpu-ab.md); every layout (Q4_0/Q4_1, Q8_0, Q4_K, Q6_K). Each
 * lane's operations are those of x8_sub4, x8_sub6, x8_block_q8 and x8_group, in the same
 * order: the same bits. */
#define X16_DOTS 1

/* 16 halves: 8 at pa, 8 at pb, as floats */
static inline __m512 ph16(const uint8_t *pa, const uint8_t *pb) {
    __m256i h = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
        _mm_loadu_si128((const __m128i *)pb), 1);
    return _mm512_cvtph_ps(h);
}

/* x8_sub4 for the 32 values of two groups' blocks, codes at ca and cb */
static inline __attribute__((always_inline)) void x16_sub4(
    const uint8_t *ca, const uint8_t *cb, __m512 sc, __m512 mn, int64_t b32, const acts_t *a,
    const int64_t *vec, int nt, __m512 *acc, __m512 *corr) {
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i w[8];
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(ca + 32 * c))),
            _mm256_loadu_si256((const __m256i *)(cb + 32 * c)), 1);
        w[2 * c] = _mm512_and_si512(v, m4);
        w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    for (int j = 0; j < nt; j++) {
        const int64_t ib = vec[j] * (a->k / 32) + b32;
        const int8_t *x = a->q + vec[j] * a->k + 32 * b32;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512(); /* two chains */
        for (int c = 0; c < 4; c++) {
            int32_t v0, v1;
            memcpy(&v0, x + 8 * c, 4), memcpy(&v1, x + 8 * c + 4, 4);
            lo = _mm512_dpbusd_epi32(lo, w[2 * c], _mm512_set1_epi32(v0));
            hi = _mm512_dpbusd_epi32(hi, w[2 * c + 1], _mm512_set1_epi32(v1));
        }
        __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
        acc[j] = _mm512_fmadd_ps(s, _mm512_mul_ps(sc, _mm512_set1_ps(a->d[ib])), acc[j]);
        corr[j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->xf[ib]), corr[j]);
    }
}

/* two 32-byte vectors, at pa (low half) and pb (high) */
static inline __m512i join32(const uint8_t *pa, const uint8_t *pb) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)pa)),
                              _mm256_loadu_si256((const __m256i *)pb), 1);
}

/* x8_block_q8's dots for two groups' blocks (codes at ca and cb; x8_group's X8_Q8 case): the
 * codes offset to unsigned once for the nt activations */
static inline __attribute__((always_inline)) void x16_q8(
    const uint8_t *ca, const uint8_t *cb, __m512 d16, int64_t b, const acts_t *a,
    const int64_t *vec, int nt, __m512 *acc) {
    const __m512i flip = _mm512_set1_epi8((char)0x80); /* q + 128: unsigned */
    __m512i w[8];
    for (int c = 0; c < 8; c++) w[c] = _mm512_xor_si512(join32(ca + 32 * c, cb + 32 * c), flip);
    for (int j = 0; j < nt; j++) {
        const int64_t ib = vec[j] * (a->k / 32) + b;
        const int8_t *x = a->q + vec[j] * a->k + 32 * b;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
            int32_t v0, v1;
            memcpy(&v0, x + 4 * c, 4), memcpy(&v1, x + 4 * c + 4, 4);
            lo = _mm512_dpbusd_epi32(lo, w[c], _mm512_set1_epi32(v0));
            hi = _mm512_dpbusd_epi32(hi, w[c + 1], _mm512_set1_epi32(v1));
        }
        __m512i s = _mm512_sub_epi32(_mm512_add_epi32(lo, hi),
                                     _mm512_set1_epi32(128 * (a->s[2 * ib] + a->s[2 * ib + 1])));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s),
                                 _mm512_mul_ps(d16, _mm512_set1_ps(a->d[ib])), acc[j]);
    }
}

/* x8_sub6 for the 32 values of two groups' Q6_K sub-blocks (codes at ca and cb, the rows'
 * int8 scales of its two halves at sa, sa + 8 and sb, sb + 8) */
static inline __attribute__((always_inline)) void x16_sub6(
    const uint8_t *ca, const uint8_t *cb, const int8_t *sa, const int8_t *sb, __m512 d16,
    int64_t b32, const acts_t *a, const int64_t *vec, int nt, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(0x30);
    __m512i w[8];
    for (int h = 0; h < 2; h++) {
        __m512i hb = join32(ca + 128 + 32 * h, cb + 128 + 32 * h);
        const __m512i high[4] = {_mm512_slli_epi16(hb, 4), _mm512_slli_epi16(hb, 2), hb,
                                 _mm512_srli_epi16(hb, 2)};
        for (int c = 2 * h; c < 2 * h + 2; c++) {
            __m512i v = join32(ca + 32 * c, cb + 32 * c);
            w[2 * c] = _mm512_or_si512(_mm512_and_si512(v, m4),
                                       _mm512_and_si512(high[2 * (c - 2 * h)], m2));
            w[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
                                           _mm512_and_si512(high[2 * (c - 2 * h) + 1], m2));
        }
    }
    const __m512i s0 = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64((const __m128i *)sa), _mm_loadl_epi64((const __m128i *)sb)));
    const __m512i s1 = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
        _mm_loadl_epi64((const __m128i *)(sa + 8)), _mm_loadl_epi64((const __m128i *)(sb + 8))));
    for (int j = 0; j < nt; j++) {
        const int64_t ib = vec[j] * (a->k / 32) + b32;
        const int8_t *x = a->q + vec[j] * a->k + 32 * b32;
        __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512(); /* 0-15, 16-31 */
        for (int i = 0; i < 4; i++) {
            int32_t v0, v1;
            memcpy(&v0, x + 4 * i, 4), memcpy(&v1, x + 16 + 4 * i, 4);
            h0 = _mm512_dpbusd_epi32(h0, w[i], _mm512_set1_epi32(v0));
            h1 = _mm512_dpbusd_epi32(h1, w[4 + i], _mm512_set1_epi32(v1));
        }
        h0 = _mm512_sub_epi32(h0, _mm512_set1_epi32(32 * a->s[2 * ib]));
        h1 = _mm512_sub_epi32(h1, _mm512_set1_epi32(32 * a->s[2 * ib + 1]));
        __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(h0, s0), _mm512_mullo_epi32(h1, s1));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                 _mm512_mul_ps(d16, _mm512_set1_ps(a->d[ib])), acc[j]);
    }
}

/* 8 unsigned bytes at pa and 8 at pb as floats */
static inline __m512 u8x16_ps(const uint8_t *pa, const uint8_t *pb) {
    __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)pa),
                                   _mm_loadl_epi64((const __m128i *)pb));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

/* x8_group for groups at ga and gb (rows r .. r + 15) */
static inline __attribute__((always_inline)) void x16_group(
    const uint8_t *ga, const uint8_t *gb, int64_t nb, const acts_t *a, const int64_t *vec,
    int nt, float *const *outs, int64_t r, int kind) {
    __m512 acc[X8_TILE], corr[X8_TILE];
    for (int j = 0; j < nt; j++) acc[j] = corr[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *pa = ga + b * X8_BLOCK[kind], *pb = gb + b * X8_BLOCK[kind];
        if (kind == X8_Q4) {
            x16_sub4(pa + 32, pb + 32, ph16(pa, pb), ph16(pa + 16, pb + 16), b, a, vec, nt, acc,
                     corr);
            continue;
        }
        __m512 d16 = ph16(pa, pb);
        if (kind == X8_Q8) {
            x16_q8(pa + 16, pb + 16, d16, b, a, vec, nt, acc);
            continue;
        }
        if (kind == X8_Q6K) {
            for (int s = 0; s < 8; s++)
                x16_sub6(pa + 144 + 192 * s, pb + 144 + 192 * s, (const int8_t *)pa + 16 + 16 * s,
                         (const int8_t *)pb + 16 + 16 * s, d16, 8 * b + s, a, vec, nt, acc);
            continue;
        } /* X8_Q4K: 8 sub-blocks, each its 6-bit scale and minimum (x8_group's) */
        __m512 dm16 = _mm512_sub_ps(_mm512_setzero_ps(), ph16(pa + 16, pb + 16));
        for (int s = 0; s < 8; s++)
            x16_sub4(pa + 160 + 128 * s, pb + 160 + 128 * s,
                     _mm512_mul_ps(d16, u8x16_ps(pa + 32 + 8 * s, pb + 32 + 8 * s)),
                     _mm512_mul_ps(dm16, u8x16_ps(pa + 96 + 8 * s, pb + 96 + 8 * s)), 8 * b + s,
                     a, vec, nt, acc, corr);
    }
    for (int j = 0; j < nt; j++) _mm512_storeu_ps(outs[j] + r, _mm512_add_ps(acc[j], corr[j]));
}
#else
#define X16_DOTS 0
#endif

/* No software prefetch: a group's blocks are one sequential run the hardware prefetcher
 * follows, and prefetching the whole next group (up to 34 KiB of a wide matrix, into L1) made
 * the products 1.1-1.6x slower on the 2-core VM (Q4_K [8192, 2048] 268 -> 165 us without). */
/* a copy of the group dot CALL(n, kind) per layout and tile size nt, each a constant (the
 * accumulators stay in registers) */
#define X8_TILES(CALL, kind)                                                                 \
    switch (nt) {                                                                            \
    case 1: CALL(1, kind); break;                                                            \
    case 2: CALL(2, kind); break;                                                            \
    case 3: CALL(3, kind); break;                                                            \
    default: CALL(4, kind); break;                                                           \
    }
#define X8_KINDS(CALL)                                                                       \
    switch (m->x8) {                                                                         \
    case X8_Q4: X8_TILES(CALL, X8_Q4); break;                                                \
    case X8_Q4K: X8_TILES(CALL, X8_Q4K); break;                                              \
    case X8_Q6K: X8_TILES(CALL, X8_Q6K); break;                                              \
    default: X8_TILES(CALL, X8_Q8); break;                                                   \
    }
/* outs[j][r] for rows r in [r0, r1) (multiples of 8) of m (interleaved), j < nv */
static void rows_dot_x8(const mat_t *m, int64_t r0, int64_t r1, const acts_t *a,
                        const int64_t *vec, float *const *outs, int64_t nv) {
    const int64_t nb = m->cols / X8_VALUES[m->x8], gbytes = nb * X8_BLOCK[m->x8];
#define X8_CASE(n, kind) x8_group(p, nb, a, vec + v0, n, outs + v0, 8 * g, kind)
#define X16_CASE(n, kind) x16_group(p, p + gbytes, nb, a, vec + v0, n, outs + v0, 8 * g, kind)
    for (int64_t g = r0 / 8; g < r1 / 8; g++) {
        const uint8_t *p = m->base + g * gbytes;
        const int two = X16_DOTS && g + 1 < r1 / 8; /* two groups at once */
        for (int64_t v0 = 0; v0 < nv; v0 += X8_TILE) {
            int64_t nt = nv - v0 < X8_TILE ? nv - v0 : X8_TILE;
#if X16_DOTS
            if (two) {
                X8_KINDS(X16_CASE)
                continue;
            }
#endif
            X8_KINDS(X8_CASE)
        }
        g += two;
    }
#undef X16_CASE
#undef X8_CASE
}
#undef X8_KINDS
#undef X8_TILES
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
