/* The parts of a transformer layer that are not weight products: RMSNorm, RoPE, halves for
 * the cache, and one head's attention over its cached keys as llama.cpp computes it.
 * Included by experts.c (through attn_layer.h). */

#define MAX_HEAD_DIM 512

/* y = x / rms(x) * w over n values */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* rotate one head v [D] by cos/sin [D / 2]: pairs (2i, 2i + 1), or halves (i, i + D / 2) */
static void rope(float *v, const float *c, const float *s, int64_t d, int interleaved) {
    for (int64_t i = 0; i < d / 2; i++) {
        int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + d / 2;
        float a = v[ia], b = v[ib];
        v[ia] = a * c[i] - b * s[i];
        v[ib] = a * s[i] + b * c[i];
    }
}

#ifdef __AVX2__
/* e^x for x <= 0 (softmax's shifted scores), 8 at a time: Cephes' expf polynomial (within
 * 2 ulp of expf); below -87 the result is ~1e-38, as good as 0 beside the largest's 1 */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* the largest of x[0 .. n - 1] (-inf for none), eight lanes at a time: one chain of scalar
 * compares cost 4 cycles a key, a fifth of a long attention's time; a maximum is exact in any
 * order, so the bits are those of the scalar loop */
static float max_of(const float *x, int64_t n) {
    float mx = -INFINITY;
    int64_t s = 0;
#ifdef __AVX2__
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(x);
        for (s = 8; s + 8 <= n; s += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + s));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    }
#endif
    for (; s < n; s++) mx = x[s] > mx ? x[s] : mx; /* fmaxf: a libm call */
    return mx;
}

/* scores[s] = e^(scores[s] - mx) for s < n; their sum */
static float softmax_exp(float *scores, int64_t n, float mx) {
    int64_t s = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
    for (; s + 8 <= n; s += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), m));
        _mm256_storeu_ps(scores + s, p);
        acc = _mm256_add_ps(acc, p);
    }
    sum = hsum8(acc);
#endif
    for (; s < n; s++) sum += scores[s] = expf(scores[s] - mx);
    return sum;
}

/* float -> IEEE half, rounded to nearest even */
static inline uint16_t to_f16(float f) {
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x, sign, a;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000 ? 0x200 : 0));
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half */
    if (a < 0x38800000) { /* a half subnormal: units of 2^-24 */
        float af;
        memcpy(&af, &a, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(af * 16777216.0f));
    }
    return (uint16_t)(sign | (a + 0xc8000fff + ((a >> 13) & 1)) >> 13); /* rebias, round */
#endif
}

static inline float half_at(const uint16_t *h) { return f16((const uint8_t *)h); }

#ifdef __AVX2__
/* hsum8 of a[0..7] at once, one per lane of the result, each sum in hsum8's order
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the same bits as a key at a time */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 z[4]; /* z[j]: halves l_i + l_(i+4) of key j (low) and key j + 4 (high) */
    for (int j = 0; j < 4; j++)
        z[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20),
                             _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    /* w0 + w2 and w1 + w3 of keys (0, 1) and (2, 3), each half */
    __m256 c01 = _mm256_add_ps(_mm256_unpacklo_ps(z[0], z[1]), _mm256_unpackhi_ps(z[0], z[1]));
    __m256 c23 = _mm256_add_ps(_mm256_unpacklo_ps(z[2], z[3]), _mm256_unpackhi_ps(z[2], z[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(c01, c23, _MM_SHUFFLE(3, 2, 3, 2)));
}
#endif

/* The queries that read one KV head's cache rows are attended together: the heads of a GQA
 * group, and the tokens of one sequence in a call (a verify window, a prompt chunk), each
 * with its own count of keys. Each key and value row is converted from halves once, into a
 * small float tile in L1, and every query of the task reads the tile; one token at a time
 * converted (and fetched) the same rows once per token (30 of SmolLM2's layers, 9 tokens at
 * 1,400 keys with small FFNs: 20.6 -> 16.8 ms, bench/results/2026-12-07-cpu-ab.md). */
#define ATTEND_GROUP_MAX 16 /* queries of one task */
#define V_TILE 32 /* value rows converted at once */
#ifndef KV_AHEAD
#define KV_AHEAD 16 /* key and value rows prefetched ahead */
#endif

/* One KV head's keys (or values) in a layer's cache: halves, or int8 with a float scale per
 * row (`kernels/formats/kv_int8.py`'s layout: q [rows, Hkv, D], scales [rows, Hkv]); element i
 * of cache row r is at r stride + i, its scale at r sstride. Or 4-bit codes with a half
 * (scale, minimum) pair per 32 values (`kernels/formats/kv_q4.py`: c4 [rows, Hkv, D / 2], the
 * byte of element i at r stride + i / 2, its low nibble for even i; pairs [rows, Hkv, D / 32,
 * 2] at r sstride + i / 32 2). A value is read as the float it stands for: the half, q times
 * its scale (dequantize_kv's one multiply), or code times scale plus minimum (dequantize_kv4). */
typedef struct {
    const uint16_t *h;  /* halves, or NULL */
    const int8_t *q;    /* int8, or NULL */
    const float *sc;    /* with q: the row's scale */
    const uint8_t *c4;  /* 4-bit codes, or NULL */
    const uint16_t *dm; /* with c4: the groups' (scale, minimum) halves */
    int64_t stride, sstride;
} kv_view_t;

/* An attention task's g <= ATTEND_GROUP_MAX queries of one KV head: query j [d] at q[j], its
 * output [d] at out[j], attending keys s < n[j] (its position + 1) */
typedef struct {
    const float *q[ATTEND_GROUP_MAX];
    float *out[ATTEND_GROUP_MAX];
    int64_t n[ATTEND_GROUP_MAX];
    int64_t g;
} queries_t;

/* `quant` in the helpers below is the view's format (0 halves, 1 int8: c->q set, 2 4-bit:
 * c->c4 set), passed as a constant by each of attend_as's copies so that no branch on it is
 * left in the loops (a test of c->q per eight values cost a 1,000-key attention 60% more time
 * on the 2-core VM) */
#ifdef __AVX2__
static inline __attribute__((always_inline)) __m256 kv_load8(const kv_view_t *c, int64_t row,
                                                             int64_t i, const int quant) {
    if (quant == 2) { /* eight codes of one group (i a multiple of 8): 4 bytes, nibbles in turn */
        int32_t w;
        memcpy(&w, c->c4 + row * c->stride + i / 2, 4);
        const __m128i b = _mm_cvtsi32_si128(w), m = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
        const uint16_t *pair = c->dm + row * c->sstride + i / 32 * 2;
        return _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(half_at(pair))),
                             _mm256_set1_ps(half_at(pair + 1)));
    }
    if (quant) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(c->q + row * c->stride + i));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                             _mm256_set1_ps(c->sc[row * c->sstride]));
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->h + row * c->stride + i)));
}
#endif

#ifdef __AVX2__
/* n values of cache row `row` from column col (multiples of 8; of 32 for 4-bit) as floats
 * into dst: kv_load8's values, a 4-bit group of 32 at once (its 16 bytes in one load, its
 * scale and minimum converted once) */
static inline __attribute__((always_inline)) void kv_floats(const kv_view_t *c, int64_t row,
                                                            int64_t col, int64_t n, float *dst,
                                                            const int quant) {
    if (quant == 2) {
        const __m128i m = _mm_set1_epi8(15);
        for (int64_t i = 0; i < n; i += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(c->c4 + row * c->stride +
                                                                 (col + i) / 2));
            const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
            const __m128i x[2] = {_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)};
            const uint16_t *pair = c->dm + row * c->sstride + (col + i) / 32 * 2;
            const __m256 sc = _mm256_set1_ps(half_at(pair)), mn = _mm256_set1_ps(half_at(pair + 1));
            for (int h = 0; h < 4; h++) {
                const __m128i eight = h & 1 ? _mm_srli_si128(x[h / 2], 8) : x[h / 2];
                const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
                _mm256_storeu_ps(dst + i + 8 * h, _mm256_add_ps(_mm256_mul_ps(v, sc), mn));
            }
        }
        return;
    }
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, kv_load8(c, row, col + i, quant));
}
#endif

static inline __attribute__((always_inline)) float kv_load1(const kv_view_t *c, int64_t row,
                                                            int64_t i, const int quant) {
    if (quant == 2) {
        const uint8_t b = c->c4[row * c->stride + i / 2];
        const uint16_t *pair = c->dm + row * c->sstride + i / 32 * 2;
        return (float)(i & 1 ? b >> 4 : b & 15) * half_at(pair) + half_at(pair + 1);
    }
    return quant ? (float)c->q[row * c->stride + i] * c->sc[row * c->sstride]
                 : half_at(c->h + row * c->stride + i);
}

/* q [d] . key `row`: eight lanes of multiply-adds and their sum, then the rest in turn */
static inline __attribute__((always_inline)) float kv_dot(const float *q, const kv_view_t *c,
                                                          int64_t row, int64_t d,
                                                          const int quant) {
    float r = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv_load8(c, row, i, quant), acc);
    r = hsum8(acc);
#endif
    for (; i < d; i++) r += q[i] * kv_load1(c, row, i, quant);
    return r;
}

/* the cache row of key j (in blocks of `block` through `table`) */
static inline int64_t kv_row(const int32_t *table, int64_t block, int64_t j) {
    return (int64_t)table[j / block] * block + j % block;
}

/* columns c .. c + n - 1 of key j's row (and its scale) on their way to the caches: a head's
 * rows are a slice of each cache row, a stride the hardware prefetcher follows poorly (a
 * 2,000-key attention 1.6x faster), and a block's last rows are followed by another block's
 * first; `rb`: the cache row of key b0, the first of the block at hand (nb keys) */
static inline __attribute__((always_inline)) void kv_prefetch(
    const kv_view_t *c, const int32_t *table, int64_t block, int64_t j, int64_t col, int64_t n,
    int64_t b0, int64_t nb, int64_t rb, const int quant) {
    const int64_t row = j < b0 + nb ? rb + (j - b0) : kv_row(table, block, j);
    if (quant == 2) {
        for (int64_t i = 0; i < n / 2; i += 64)
            __builtin_prefetch(c->c4 + row * c->stride + col / 2 + i, 0, 3);
        __builtin_prefetch(c->dm + row * c->sstride + col / 16, 0, 3);
    } else if (quant) {
        for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(c->q + row * c->stride + col + i, 0, 3);
        __builtin_prefetch(c->sc + row * c->sstride, 0, 3);
    } else {
        for (int64_t i = 0; i < n; i += 32) __builtin_prefetch(c->h + row * c->stride + col + i, 0, 3);
    }
}

/* For the queries qs of one KV head: out_j [D] = softmax(q_j . k_s / sqrt(D)) v over keys
 * s < n_j, as llama.cpp computes it with its half-precision cache: k and v as the cache holds
 * them (halves, or int8 times their row's scale), q and the probabilities rounded to halves
 * for the products, sums in float; scores [g, max n_j]. Key s is row table[s / block] block +
 * s % block of k and v: a paged cache's blocks, or one block of all keys (a contiguous cache,
 * table {0}). With AVX2, eight keys' scores at once (eight independent sums, where one key's
 * dot was a chain of dependent multiply-adds and a horizontal sum), each key row converted to
 * floats once, into a tile in L1, for every query; and the output 64 columns at a time in
 * registers across a tile of value rows. Each query's operations are the same in the same
 * order whatever the other queries of the task are (a query whose keys end inside a group of
 * eight takes that group's scores from the eight-wide sums, the same bits as one key's dot),
 * so the same bits alone or together (the int8 activations downstream turn any rounding change
 * into a visible one). A block holds a multiple of eight keys (or is the only one), so the
 * groups of eight are those of one contiguous cache, and the keys are visited in the order of
 * their positions whatever blocks hold them: a paged cache gives the same bits. No row at or
 * past the largest n_j is read. */
static inline __attribute__((always_inline)) void attend_as(
    const queries_t *qs, const kv_view_t *k, const kv_view_t *v, const int32_t *table,
    int64_t block, int64_t d, float *scores, const int quant) {
    const int64_t g = qs->g;
    float qh[ATTEND_GROUP_MAX][MAX_HEAD_DIM], scale = 1.0f / sqrtf((float)d);
    int64_t n = 0; /* keys of the task: the most any query attends */
    for (int64_t h = 0; h < g; h++) {
        n = qs->n[h] > n ? qs->n[h] : n;
        for (int64_t i = 0; i < d; i++) qh[h][i] = half_at((uint16_t[]){to_f16(qs->q[h][i])});
    }
    for (int64_t b0 = 0; b0 < n; b0 += block) { /* keys b0 .. b0 + nb - 1: one block's rows */
        const int64_t nb = n - b0 < block ? n - b0 : block, rb = kv_row(table, block, b0);
        int64_t s = 0;
#ifdef __AVX2__
        float kf[8][MAX_HEAD_DIM] __attribute__((aligned(32)));
        for (; d % 8 == 0 && s + 8 <= nb; s += 8) {
            for (int64_t j = b0 + s + KV_AHEAD; j < b0 + s + KV_AHEAD + 8 && j < n; j++)
                kv_prefetch(k, table, block, j, 0, d, b0, nb, rb, quant);
            for (int j = 0; j < 8; j++) kv_floats(k, rb + s + j, 0, d, kf[j], quant);
            for (int64_t h = 0; h < g; h++) {
                if (qs->n[h] <= b0 + s) continue; /* the query's keys ended before */
                __m256 acc[8];
                for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
                for (int64_t i = 0; i < d; i += 8) {
                    __m256 qv = _mm256_loadu_ps(qh[h] + i);
                    for (int j = 0; j < 8; j++)
                        acc[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(kf[j] + i), acc[j]);
                }
                _mm256_storeu_ps(scores + h * n + b0 + s,
                                 _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
            }
        }
#endif
        for (; s < nb; s++)
            for (int64_t h = 0; h < g; h++)
                if (b0 + s < qs->n[h])
                    scores[h * n + b0 + s] = kv_dot(qh[h], k, rb + s, d, quant) * scale;
    }
    for (int64_t h = 0; h < g; h++) {
        const int64_t nh = qs->n[h];
        float *sc = scores + h * n, mx = max_of(sc, nh);
        float inv = 1.0f / softmax_exp(sc, nh, mx);
        int64_t s = 0;
#ifdef __AVX2__
        for (; s + 8 <= nh; s += 8) { /* the probabilities rounded to halves, eight at a time */
            __m256 pr = _mm256_mul_ps(_mm256_loadu_ps(sc + s), _mm256_set1_ps(inv));
            __m128i hv = _mm256_cvtps_ph(pr, _MM_FROUND_TO_NEAREST_INT);
            _mm256_storeu_ps(sc + s, _mm256_cvtph_ps(hv));
        }
#endif
        for (; s < nh; s++) sc[s] = half_at((uint16_t[]){to_f16(sc[s] * inv)});
    }
    for (int64_t c = 0; c < d; c += 64) {
#ifdef __AVX2__
        if (d - c >= 64) {
            float vf[V_TILE][64] __attribute__((aligned(32)));
            for (int64_t h = 0; h < g; h++)
                for (int i = 0; i < 64; i++) qs->out[h][c + i] = 0.0f;
            for (int64_t b0 = 0; b0 < n; b0 += block) {
                const int64_t nb = n - b0 < block ? n - b0 : block, rb = kv_row(table, block, b0);
                for (int64_t s0 = 0; s0 < nb; s0 += V_TILE) {
                    const int64_t nt = nb - s0 < V_TILE ? nb - s0 : V_TILE;
                    for (int64_t s = 0; s < nt; s++) {
                        if (b0 + s0 + s + KV_AHEAD < n)
                            kv_prefetch(v, table, block, b0 + s0 + s + KV_AHEAD, c, 64, b0, nb,
                                        rb, quant);
                        kv_floats(v, rb + s0 + s, c, 64, vf[s], quant);
                    }
                    for (int64_t h = 0; h < g; h++) {
                        const int64_t left = qs->n[h] - (b0 + s0), m = left < nt ? left : nt;
                        if (m <= 0) continue;
                        const float *p = scores + h * n + b0 + s0;
                        float *oh = qs->out[h] + c;
                        __m256 o[8];
                        for (int i = 0; i < 8; i++) o[i] = _mm256_loadu_ps(oh + 8 * i);
                        for (int64_t s = 0; s < m; s++) {
                            __m256 pv = _mm256_set1_ps(p[s]);
                            for (int i = 0; i < 8; i++)
                                o[i] = _mm256_fmadd_ps(pv, _mm256_load_ps(vf[s] + 8 * i), o[i]);
                        }
                        for (int i = 0; i < 8; i++) _mm256_storeu_ps(oh + 8 * i, o[i]);
                    }
                }
            }
            continue;
        }
#endif
        int64_t end = d - c < 64 ? d : c + 64;
        for (int64_t h = 0; h < g; h++) {
            float *oh = qs->out[h];
            const float *sc = scores + h * n;
            const int64_t nh = qs->n[h];
            for (int64_t i = c; i < end; i++) oh[i] = 0.0f;
            for (int64_t b0 = 0; b0 < nh; b0 += block) {
                const int64_t nb = nh - b0 < block ? nh - b0 : block;
                const int64_t rb = kv_row(table, block, b0);
                for (int64_t s = 0; s < nb; s++) {
                    float p = sc[b0 + s];
                    int64_t i = c;
#ifdef __AVX2__
                    for (__m256 pv = _mm256_set1_ps(p); i + 8 <= end; i += 8)
                        _mm256_storeu_ps(oh + i, _mm256_fmadd_ps(pv, kv_load8(v, rb + s, i, quant),
                                                                 _mm256_loadu_ps(oh + i)));
#endif
                    for (; i < end; i++) oh[i] += p * kv_load1(v, rb + s, i, quant);
                }
            }
        }
    }
}

/* attend_as for the views' format: halves, int8 where k->q is set, 4-bit where k->c4 is (k
 * and v alike) */
static void attend(const queries_t *qs, const kv_view_t *k, const kv_view_t *v,
                   const int32_t *table, int64_t block, int64_t d, float *scores) {
    if (k->c4)
        attend_as(qs, k, v, table, block, d, scores, 2);
    else if (k->q)
        attend_as(qs, k, v, table, block, d, scores, 1);
    else
        attend_as(qs, k, v, table, block, d, scores, 0);
}
