/* Quantized CPU expert kernels: MoE experts and dense matmuls straight from GGUF blocks.
 *
 * Plain C11 + OpenMP, no Python: built and loaded by kernels/cpu/build.py, called through
 * ctypes (which releases the GIL) by kernels/cpu/experts.py.
 *
 * Activations are quantized once per vector to int8 in blocks of 32 (float scale d per block,
 * as llama.cpp's Q8_0, plus the block's sums for the types with a minimum or an offset).
 * A weight row is dotted with every activation that uses it, so a weight byte is read once
 * per call however many tokens share it. Per 32 values: an integer dot, then one float
 * multiply-add by the weight's (sub-)block scale times the activation's block scale. With
 * AVX2 every quantized type has a whole-row dot that decodes blocks in registers
 * (fused_avx2.h, fused_k16_avx2.h); without it (or built with native=False) rows are decoded
 * 256 values at a time to int8 (decode.h) and dotted in plain C (chunk_dot).
 *
 * One strata_moe call does a layer's items in four parallel phases: quantize the tokens;
 * gate/up rows (tasks of ROWS_PER_TASK rows of one expert, handed out `guided`: each thread
 * first takes a long contiguous run, which the prefetchers follow, then smaller ones to even
 * out the end; 1.4x dynamic,1 on 2 threads here);
 * silu(gate) * up, quantized; down rows; then the weighted sums into out, in item order.
 *
 * Every output value is computed by one thread in a fixed order, and a MoE layer's outputs are
 * summed in item order: results do not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>

#include "decode.h"
#ifdef __AVX2__
#include "decode_avx2.h"
#include "quantize_avx2.h"
#endif

#define ROWS_PER_TASK 16
/* rows ahead that rows_dot prefetches, into every cache level (prefetcht0): +10-20% on an AMD
 * EPYC VM. The non-temporal hint (prefetchnta) it took first stalled an Intel Xeon VM's loads:
 * a single-token product read 3.7 GB/s on one thread with it, 6.0 with prefetcht0 */
#define PREFETCH_ROWS 4
#define VEC_TILE 16 /* activations dotted per decoded chunk */

typedef struct { /* n int8 vectors of k values (k % 32 == 0) and their float originals */
    int64_t k;
    int8_t *q;
    float *d;    /* [n, k / 32] */
    int16_t *s;  /* [n, k / 16] */
    float *xf;   /* [n, k / 32]: d * (sum of the block's q), the block's sum as rounded */
    float *x16;  /* [n, k / 16]: the same per 16 values */
    const float *f;
    int64_t fstride;
    const uint8_t *tab; /* the lookup tables (kernels/formats/iq_tables.py; offsets in decode*.h) */
} acts_t;

typedef void (*rowdot_fn)(const uint8_t *row, const uint8_t *aux, int64_t cols,
                          const acts_t *a, const int64_t *vec, int64_t nt, float *acc);

#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#include "fused_avx2.h"
#endif

typedef struct {
    const uint8_t *base;
    int64_t rows, cols, row_bytes;
    int qtype, split, has_min, is_float;
    int x8; /* interleaved (interleave.h): its layout kind, else 0 */
    decode_fn dec;
    rowdot_fn fused; /* the whole-row dot (with AVX2: fused_avx2.h), else NULL: decode + dot */
} mat_t;

int strata_block(int qtype, int *values, int *bytes) {
    static const int geo[][3] = {
        {T_F32, 1, 4}, {T_F16, 1, 2}, {T_BF16, 1, 2}, {T_Q4_0, 32, 18}, {T_Q4_1, 32, 20},
        {T_Q5_0, 32, 22}, {T_Q5_1, 32, 24}, {T_Q8_0, 32, 34}, {T_IQ4_NL, 32, 18},
        {T_MXFP4, 32, 17}, {T_Q2_K, 256, 84}, {T_Q3_K, 256, 110}, {T_Q4_K, 256, 144},
        {T_Q5_K, 256, 176}, {T_Q6_K, 256, 210}, {T_IQ4_XS, 256, 136}, {T_IQ3_S, 256, 110},
        {T_IQ3_XXS, 256, 98}, {T_IQ2_XXS, 256, 66}, {T_IQ2_XS, 256, 74}, {T_IQ2_S, 256, 82},
        {T_IQ1_S, 256, 50},
    };
    for (size_t i = 0; i < sizeof geo / sizeof geo[0]; i++)
        if (geo[i][0] == qtype) {
            *values = geo[i][1];
            *bytes = geo[i][2];
            return 0;
        }
    return -1;
}

#define X8_TILE 4 /* activations per interleaved group dot: its accumulators in registers */
#include "interleave.h"

static decode_fn decoder(int qtype, int split) {
    switch (qtype) {
    case T_Q4_0: return split ? dec_q4_0_split : dec_q4_0;
    case T_Q4_1: return dec_q4_1;
    case T_IQ4_NL: return dec_iq4_nl;
    case T_MXFP4: return split ? dec_mxfp4_split : dec_mxfp4;
    case T_IQ4_XS: return dec_iq4_xs;
    case T_Q4_K: return dec_q4_k;
    case T_Q5_K: return dec_q5_k;
    case T_Q6_K: return split ? dec_q6_k_split : dec_q6_k;
    case T_Q5_0: return dec_q5_0;
    case T_Q5_1: return dec_q5_1;
    case T_Q2_K: return dec_q2_k;
    case T_Q3_K: return dec_q3_k;
    case T_IQ3_S: return dec_iq3_s;
    case T_Q8_0: return dec_q8_0;
    default: return decoder_iq_low(qtype);
    }
}

static int mat_init(mat_t *m, const uint8_t *base, int qtype, int split, int64_t rows,
                    int64_t cols) {
    int bv, bb;
    if (qtype & X8_FLAG) { /* rows interleaved in eights (interleave.h) */
        int kind = x8_kind(qtype & ~X8_FLAG);
        if (!kind || !strata_interleaved_dots()) return -1;
        if (cols % X8_VALUES[kind] || rows % 8) return -2;
        *m = (mat_t){.base = base, .rows = rows, .cols = cols, .qtype = qtype, .has_min = 1,
                     .x8 = kind, .row_bytes = cols / X8_VALUES[kind] * X8_BLOCK[kind] / 8};
        return 0;
    }
    if (strata_block(qtype, &bv, &bb)) return -1;
    if (cols % 32 || cols % bv) return -2; /* activations are rounded per 32 values */
    m->base = base, m->rows = rows, m->cols = cols, m->row_bytes = cols / bv * bb;
    /* split: bit 0 Q4_0 in its split layout, bit 1 Q6_K in its, bit 2 MXFP4 in its
     * (kernels.experts.moe) */
    m->qtype = qtype, m->x8 = 0;
    m->split = ((split & 1) && qtype == T_Q4_0) || ((split & 2) && qtype == T_Q6_K) ||
               ((split & 4) && qtype == T_MXFP4);
    m->is_float = qtype == T_F32 || qtype == T_F16 || qtype == T_BF16;
    m->has_min = qtype == T_Q4_1 || qtype == T_Q5_1 || qtype == T_Q2_K || qtype == T_Q4_K ||
                 qtype == T_Q5_K;
    m->dec = decoder(qtype, m->split);
#ifdef __AVX2__
    m->fused = fused_rowdot(qtype, m->split);
#else
    m->fused = NULL;
#endif
    return 0;
}

/* activation v of a = x [a->k] rounded to int8 per block of 32 */
static void quantize_act(const acts_t *a, int64_t v, const float *x) {
    int64_t k = a->k;
    int8_t *q = a->q + v * k;
    float *d = a->d + v * (k / 32), *xf = a->xf + v * (k / 32), *x16 = a->x16 + v * (k / 16);
    int16_t *s = a->s + v * (k / 16);
    for (int64_t b = 0; b < k / 32; b++, x += 32, q += 32) {
        int s0 = 0, s1 = 0;
#ifdef __AVX2__
        float scale = quantize32_avx2(x, q, &s0, &s1);
#else
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
        float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        for (int i = 0; i < 32; i++) q[i] = (int8_t)roundf(x[i] * inv);
        for (int i = 0; i < 16; i++) s0 += q[i], s1 += q[i + 16];
#endif
        d[b] = scale;
        xf[b] = scale * (float)(s0 + s1);
        x16[2 * b] = scale * (float)s0;
        x16[2 * b + 1] = scale * (float)s1;
        s[2 * b] = (int16_t)s0;
        s[2 * b + 1] = (int16_t)s1;
    }
}

/* sum over n32 blocks of (fs q - fm) . (xd xq): the chunk's dot with one activation */
static inline float chunk_dot(const int8_t *q, const float *fs, const float *fm, int has_min,
                              const int8_t *xq, const float *xd, const int16_t *xs, int n32) {
    float r = 0.0f;
    for (int j = 0; j < n32; j++) {
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 16; i++) s0 += q[32 * j + i] * xq[32 * j + i];
        for (int i = 16; i < 32; i++) s1 += q[32 * j + i] * xq[32 * j + i];
        r += xd[j] * (fs[2 * j] * (float)s0 + fs[2 * j + 1] * (float)s1);
    }
    if (has_min)
        for (int j = 0; j < n32; j++)
            r -= xd[j] * (fm[2 * j] * (float)xs[2 * j] + fm[2 * j + 1] * (float)xs[2 * j + 1]);
    return r;
}

static inline float float_dot(const float *w, const float *x, int n) {
    float r = 0.0f;
    int i = 0;
#ifdef __AVX2__ /* gcc keeps a float sum in order (no -ffast-math): vectorized by hand */
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    }
    r = hsum8(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; i++) r += w[i] * x[i];
    return r;
}

/* outs[j][r] = row r of m . activation vec[j], for r in [r0, r1) and j < nv */
static void rows_dot(const mat_t *m, int64_t r0, int64_t r1, const acts_t *a,
                     const int64_t *vec, float *const *outs, int64_t nv, const uint8_t *tab) {
    int8_t q[256] __attribute__((aligned(32)));
    float fs[16], fm[16], wf[256];
    int64_t nb = m->cols / 32, nchunks = (m->cols + 255) / 256;
#ifdef __AVX2__
    if (m->x8) { /* strata_interleaved_dots: only with AVX2 */
        rows_dot_x8(m, r0, r1, a, vec, outs, nv);
        return;
    }
#endif
    for (int64_t v0 = 0; v0 < nv; v0 += VEC_TILE) {
        int64_t nt = nv - v0 < VEC_TILE ? nv - v0 : VEC_TILE;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = m->base + r * m->row_bytes, *aux = NULL, *bulk = row;
            int64_t bulk_bytes = m->row_bytes; /* the row's largest run, prefetched ahead */
            if (m->split && m->qtype == T_Q4_0) { /* scales, then nibbles */
                row = m->base + r * nb * 2;
                aux = bulk = m->base + m->rows * nb * 2 + r * nb * 16;
                bulk_bytes = nb * 16;
            } else if (m->split && m->qtype == T_MXFP4) { /* codes, then exponents */
                aux = bulk = m->base + r * nb * 16;
                row = m->base + m->rows * nb * 16 + r * nb;
                bulk_bytes = nb * 16;
            } else if (m->split) { /* Q6_K: 208-byte block bodies, then every block's d */
                int64_t nsb = m->cols / 256;
                row = bulk = m->base + r * nsb * 208;
                aux = m->base + m->rows * nsb * 208 + r * nsb * 2;
                bulk_bytes = nsb * 208;
            }
            float acc[VEC_TILE] = {0};
            if (r + PREFETCH_ROWS < m->rows) { /* ahead of the hardware prefetcher */
                const uint8_t *next = bulk + PREFETCH_ROWS * bulk_bytes;
                for (int64_t off = 0; off < bulk_bytes; off += 64)
                    __builtin_prefetch(next + off, 0, 3);
            }
            if (m->fused) {
                m->fused(row, aux, m->cols, a, vec + v0, nt, acc);
                for (int64_t j = 0; j < nt; j++) outs[v0 + j][r] = acc[j];
                continue;
            }
            for (int64_t c = 0; c < nchunks; c++) {
                int n32 = nb - 8 * c < 8 ? (int)(nb - 8 * c) : 8;
                if (m->is_float) {
                    dec_float(m->qtype, row, c, 32 * n32, wf);
                    for (int64_t j = 0; j < nt; j++)
                        acc[j] += float_dot(wf, a->f + vec[v0 + j] * a->fstride + 256 * c,
                                            32 * n32);
                    continue;
                }
                m->dec(row, aux, c, n32, tab, q, fs, fm);
                for (int64_t j = 0; j < nt; j++) {
                    int64_t v = vec[v0 + j];
                    acc[j] += chunk_dot(q, fs, fm, m->has_min, a->q + v * a->k + 256 * c,
                                        a->d + v * (a->k / 32) + 8 * c,
                                        a->s + v * (a->k / 16) + 16 * c, n32);
                }
            }
            for (int64_t j = 0; j < nt; j++) outs[v0 + j][r] = acc[j];
        }
    }
}

static int acts_alloc(acts_t *a, int64_t n, int64_t k, const float *f, int64_t fstride,
                      const uint8_t *tab) {
    a->k = k, a->f = f, a->fstride = fstride, a->tab = tab;
    a->q = malloc((size_t)(n * k) + 32);
    a->d = malloc(sizeof(float) * (size_t)(n * k / 32 + 1));
    a->s = malloc(sizeof(int16_t) * (size_t)(n * k / 16 + 1));
    a->xf = malloc(sizeof(float) * (size_t)(n * k / 32 + 1));
    a->x16 = malloc(sizeof(float) * (size_t)(n * k / 16 + 1));
    return a->q && a->d && a->s && a->xf && a->x16 ? 0 : -3;
}

static void acts_free(acts_t *a) {
    free(a->q), free(a->d), free(a->s), free(a->xf), free(a->x16);
}

/* out [T, rows] = x [T, cols] @ W^T. Returns 0, or -1 (type), -2 (shape), -3 (memory). */
int strata_matmul(const float *x, int64_t T, const uint8_t *w, int qtype, int split,
                  int64_t rows, int64_t cols, float *out, int threads, const uint8_t *tab) {
    mat_t m;
    int err = mat_init(&m, w, qtype, split, rows, cols);
    if (err) return err;
    acts_t a;
    int64_t *vec = malloc(sizeof(int64_t) * (size_t)T);
    float **outs = malloc(sizeof(float *) * (size_t)T);
    if (acts_alloc(&a, T, cols, x, cols, tab) || !vec || !outs) err = -3;
    int64_t tasks = (rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel num_threads(threads) if (!err)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            vec[t] = t, outs[t] = out + t * rows;
            if (!m.is_float) quantize_act(&a, t, x + t * cols);
        }
#pragma omp for schedule(guided)
        for (int64_t i = 0; i < tasks; i++) {
            int64_t r0 = i * ROWS_PER_TASK;
            int64_t r1 = r0 + ROWS_PER_TASK < rows ? r0 + ROWS_PER_TASK : rows;
            rows_dot(&m, r0, r1, &a, vec, outs, T, tab);
        }
    }
    acts_free(&a), free(vec), free(outs);
    return err;
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* gpt-oss's clamped SwiGLU: the gate clamped from above and the up from both sides at limit,
 * then g sigmoid(alpha g) (u + 1) */
static inline float clamped_swiglu(float g, float u, float alpha, float limit) {
    g = g < limit ? g : limit;
    u = u < -limit ? -limit : u > limit ? limit : u;
    return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
}

/* out[tokens[i]] += weights[i] * down_i(silu(gate_i x) * up_i x) for every item i, where item
 * i's expert's matrices start at gates[i], ups[i], downs[i] (a model's expert stacks). Items
 * with the same gate pointer read their weights once. gu_bias (or NULL): item i's gate and up
 * biases at gu_bias + i * 2 ffn (gate, then up), added to the products; down_bias (or NULL):
 * its down bias at down_bias + i * hidden, added before the weight; limit > 0: gpt-oss's
 * clamped SwiGLU (alpha, limit) in place of silu(gate) * up. Returns 0 or an error as
 * strata_matmul. */
int strata_moe_parts(const float *x, int64_t T, int64_t hidden, int64_t ffn,
                     const uint8_t *const *gates, const uint8_t *const *ups,
                     const uint8_t *const *downs, int64_t n, const int64_t *tokens,
                     const float *weights, const int32_t *qtypes, int split, float *out,
                     int threads, const uint8_t *tab, const float *gu_bias,
                     const float *down_bias, float alpha, float limit) {
    mat_t mg, mu, md;
    int err = mat_init(&mg, NULL, qtypes[0], split, ffn, hidden);
    if (!err) err = mat_init(&mu, NULL, qtypes[1], split, ffn, hidden);
    if (!err) err = mat_init(&md, NULL, qtypes[2], split, hidden, ffn);
    if (err || n == 0) return err;
    /* group the items by blob, in order of first appearance: order[gstart[g] .. gstart[g+1]) */
    size_t ni = sizeof(int64_t) * (size_t)n;
    int64_t *group = malloc(ni), *order = malloc(ni), *vec = malloc(ni), *first = malloc(ni);
    int64_t *gstart = calloc((size_t)n + 1, sizeof(int64_t)), ng = 0;
    float **outs = malloc(sizeof(float *) * 3 * (size_t)n);
    float *gu = malloc(sizeof(float) * (size_t)(n * 2 * ffn));
    float *dn = malloc(sizeof(float) * (size_t)(n * hidden));
    acts_t xa, ha;
    int bad = acts_alloc(&xa, T, hidden, x, hidden, tab);
    bad |= acts_alloc(&ha, n, ffn, gu, 2 * ffn, tab);
    if (bad || !group || !order || !gstart || !vec || !first || !outs || !gu || !dn) {
        err = -3;
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t g = 0;
        while (g < ng && gates[first[g]] != gates[i]) g++;
        if (g == ng) first[ng++] = i;
        group[i] = g;
        gstart[g + 1]++;
    }
    for (int64_t g = 0; g < ng; g++) gstart[g + 1] += gstart[g];
    for (int64_t g = 0, k = 0; g < ng; g++)
        for (int64_t i = 0; i < n; i++)
            if (group[i] == g) order[k++] = i;
    for (int64_t k = 0; k < n; k++) {
        int64_t i = order[k];
        vec[k] = tokens[i];
        outs[k] = gu + i * 2 * ffn;
        outs[n + k] = gu + i * 2 * ffn + ffn;
        outs[2 * n + k] = dn + i * hidden;
    }
    int64_t row_tasks = (ffn + ROWS_PER_TASK - 1) / ROWS_PER_TASK, up_tasks = ng * row_tasks;
    int64_t out_tasks = (hidden + ROWS_PER_TASK - 1) / ROWS_PER_TASK, down_tasks = ng * out_tasks;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            quantize_act(&xa, t, x + t * hidden);
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < up_tasks; task++) {
            /* consecutive tasks walk down one expert's rows: long runs for the prefetcher */
            int64_t g = task / row_tasks, r0 = task % row_tasks * ROWS_PER_TASK;
            int64_t r1 = r0 + ROWS_PER_TASK < ffn ? r0 + ROWS_PER_TASK : ffn, k = gstart[g];
            mat_t gm = mg, um = mu;
            gm.base = gates[first[g]], um.base = ups[first[g]];
            rows_dot(&gm, r0, r1, &xa, vec + k, outs + k, gstart[g + 1] - k, tab);
            rows_dot(&um, r0, r1, &xa, vec + k, outs + n + k, gstart[g + 1] - k, tab);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float *h = gu + i * 2 * ffn; /* h overwrites gate in place */
            if (gu_bias)
                for (int64_t f = 0; f < 2 * ffn; f++) h[f] += gu_bias[i * 2 * ffn + f];
            if (limit > 0.0f)
                for (int64_t f = 0; f < ffn; f++)
                    h[f] = clamped_swiglu(h[f], h[ffn + f], alpha, limit);
            else
                for (int64_t f = 0; f < ffn; f++) h[f] = silu(h[f]) * h[ffn + f];
            if (!md.is_float) quantize_act(&ha, i, h);
        }
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < down_tasks; task++) {
            int64_t g = task / out_tasks, r0 = task % out_tasks * ROWS_PER_TASK;
            int64_t r1 = r0 + ROWS_PER_TASK < hidden ? r0 + ROWS_PER_TASK : hidden;
            mat_t dm = md;
            dm.base = downs[first[g]];
            rows_dot(&dm, r0, r1, &ha, order + gstart[g], outs + 2 * n + gstart[g],
                     gstart[g + 1] - gstart[g], tab);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < out_tasks; task++) {
            int64_t r0 = task * ROWS_PER_TASK;
            int64_t r1 = r0 + ROWS_PER_TASK < hidden ? r0 + ROWS_PER_TASK : hidden;
            for (int64_t i = 0; i < n; i++) { /* fixed order: deterministic */
                const float *d = dn + i * hidden, *b = down_bias ? down_bias + i * hidden : NULL;
                for (int64_t r = r0; r < r1; r++)
                    out[tokens[i] * hidden + r] += weights[i] * (b ? d[r] + b[r] : d[r]);
            }
        }
    }
done:
    acts_free(&xa), acts_free(&ha);
    free(group), free(order), free(gstart), free(vec), free(first), free(outs), free(gu), free(dn);
    return err;
}

/* strata_moe_parts where item i's expert is the blob blobs[i] = [gate | up (up_off) | down
 * (down_off)] (the expert store's) */
int strata_moe(const float *x, int64_t T, int64_t hidden, int64_t ffn,
               const uint8_t *const *blobs, int64_t n, const int64_t *tokens,
               const float *weights, const int32_t *qtypes, int64_t up_off, int64_t down_off,
               int split, float *out, int threads, const uint8_t *tab, const float *gu_bias,
               const float *down_bias, float alpha, float limit) {
    const uint8_t **parts = malloc(sizeof(uint8_t *) * 2 * (size_t)(n + 1));
    if (!parts) return -3;
    for (int64_t i = 0; i < n; i++) {
        parts[i] = blobs[i] + up_off;
        parts[n + i] = blobs[i] + down_off;
    }
    int err = strata_moe_parts(x, T, hidden, ffn, blobs, parts, parts + n, n, tokens, weights,
                               qtypes, split, out, threads, tab, gu_bias, down_bias, alpha, limit);
    free(parts);
    return err;
}

#include "attn_layer.h"
#include "dense.h"
#include "moe_layers.h"

/* A read-bandwidth probe: the sum of n / 8 64-bit words, threads-wide (STREAM-like). */
uint64_t strata_read(const uint64_t *p, int64_t n_words, int threads) {
    uint64_t total = 0;
#pragma omp parallel for reduction(+ : total) num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n_words; i++) total += p[i];
    return total;
}
