/* A stack of dense transformer layers (llama's: RMSNorm, GQA attention with RoPE, SwiGLU) in
 * one call: the cpu engine's whole forward but for the embedding and the head
 * (kernels/cpu_dense.py launches it; stratad/engine/forward.py is the torch definition).
 * Included by experts.c after its row dots.
 *
 * Why one call: a token's step is some 300 small pieces of work (30 layers of 7 products,
 * norms, RoPE, attention), each 5-100 us here. As torch ops and ctypes calls, the Python
 * around them and a thread-team wake-up per product cost more than the products (SmolLM2 on
 * 2 cores: 36 ms a token, of which the products ~13). Here one OpenMP team runs every layer;
 * its threads meet at spin barriers between phases (short: both threads are busy in this call,
 * and a passive OpenMP barrier's futex wake-up costs tens of us on a VM) and sleep passively
 * once the call returns, so an idle daemon burns nothing.
 *
 * Phases of a layer, each split over the team: norm + quantize x; q|k|v rows (one task list
 * over the three matrices, sharing x's int8 copy); bias + RoPE, k and v into the cache;
 * attention per (token, head); o rows; residual, norm, quantize; gate|up rows; silu * up,
 * quantized; down rows; residual. Many tokens (a prompt) go through every phase together, so a
 * weight row is read once for up to VEC_TILE of them. A token's attention is the same loop
 * over its keys whatever the other tokens of the call: results do not depend on how a prompt
 * is chunked, nor on the thread count (every value is computed by one thread in one order).
 */
#include <sched.h>
#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __SSE2__
#include <immintrin.h>
#endif

typedef struct {                /* one layer, as kernels/cpu_dense.py's _Layer mirrors it */
    const float *attn_norm;     /* [H] */
    const float *ffn_norm;      /* [H] */
    const float *bias[3];       /* q [Hq D], k [Hkv D], v [Hkv D], or NULL */
    const uint8_t *w[7];        /* q, k, v, o, gate, up, down: GGUF blocks */
    int32_t qtype[7];
} dense_layer_t;

typedef struct {                /* the shapes, as kernels/cpu_dense.py's _Dims mirrors it */
    int64_t hidden, n_heads, n_kv_heads, head_dim, ffn;
    int32_t rope_interleaved;
    float eps;
} dense_dims_t;

/* A sense-reversing barrier: a thread that arrives early spins a while (the partner is
 * working in this same call), then sleeps on a futex until the last one wakes it. Yielding
 * instead handed the core to a busy neighbour process for its whole slice (decode steps of
 * 13-66 ms where one thread took 11), and pure spinning burned the slice the preempted
 * partner needed (100-300 ms). */
typedef struct {
    _Atomic int count, sense, sleepers;
    int n;
} spin_barrier_t;

/* pauses, some 37 us here: longer phases than a decode step's; 10,000 (370 us) made two
 * threads' steps 137 ms beside one busy process (the spinner keeps the core its partner and
 * the neighbour share), 1,000 25 ms */
#define SPINS_BEFORE_SLEEP 1000
#define MAX_HEAD_DIM 512

#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only for _GNU_SOURCE */
static void sleep_while(_Atomic int *addr, int value) {
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void wake_all(_Atomic int *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
static void sleep_while(_Atomic int *addr, int value) { (void)addr, (void)value, sched_yield(); }
static void wake_all(_Atomic int *addr) { (void)addr; }
#endif

static void spin_barrier(spin_barrier_t *b, int *local) {
    int s = !*local;
    *local = s;
    if (atomic_fetch_add(&b->count, 1) == b->n - 1) {
        atomic_store(&b->count, 0);
        atomic_store(&b->sense, s);
        /* seq_cst both sides: either a sleeper is counted here or it sees the new sense */
        if (atomic_load(&b->sleepers)) wake_all(&b->sense);
        return;
    }
    for (int i = 0; i < SPINS_BEFORE_SLEEP; i++) {
        if (atomic_load_explicit(&b->sense, memory_order_acquire) == s) return;
#ifdef __SSE2__
        _mm_pause();
#endif
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->sense) != s) sleep_while(&b->sense, !s);
    atomic_fetch_sub(&b->sleepers, 1);
}

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

/* q [D] . k [D] with k in halves */
static inline float dot_f16(const float *q, const uint16_t *k, int64_t d) {
    float r = 0.0f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) {
        __m256 kv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i)));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv, acc);
    }
    r = hsum8(acc);
#endif
    for (; i < d; i++) r += q[i] * half_at(k + i);
    return r;
}

/* out [D] = softmax(q . k_s / sqrt(D)) v over keys s < n, as llama.cpp computes it with its
 * half-precision cache: k and v in halves (rows `stride` apart), q and the probabilities
 * rounded to halves for the products, sums in float */
static void attend(const float *q, const uint16_t *k, const uint16_t *v, int64_t n,
                   int64_t stride, int64_t d, float *scores, float *out) {
    float qh[MAX_HEAD_DIM], scale = 1.0f / sqrtf((float)d), mx = -INFINITY;
    for (int64_t i = 0; i < d; i++) qh[i] = half_at((uint16_t[]){to_f16(q[i])});
    for (int64_t s = 0; s < n; s++) {
        scores[s] = dot_f16(qh, k + s * stride, d) * scale;
        mx = fmaxf(mx, scores[s]);
    }
    float inv = 1.0f / softmax_exp(scores, n, mx);
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t s = 0; s < n; s++) {
        const uint16_t *vs = v + s * stride;
        float p = half_at((uint16_t[]){to_f16(scores[s] * inv)});
        int64_t i = 0;
#ifdef __AVX2__
        for (__m256 pv = _mm256_set1_ps(p); i + 8 <= d; i += 8) {
            __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vs + i)));
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, vv, _mm256_loadu_ps(out + i)));
        }
#endif
        for (; i < d; i++) out[i] += p * half_at(vs + i);
    }
}

/* row tasks of several matrices in one list: task i is rows [r0, r0 + ROWS_PER_TASK) of
 * matrix mi, outs[mi] its outputs per token */
static void rows_tasks(const mat_t *m, int nm, const acts_t *a, const int64_t *vec,
                       float **const *outs, int64_t T, const uint8_t *tab) {
    int64_t tasks[8] = {0}, total = 0;
    for (int i = 0; i < nm; i++)
        total += tasks[i] = (m[i].rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp for schedule(dynamic) nowait
    for (int64_t t = 0; t < total; t++) {
        int mi = 0;
        int64_t r = t;
        while (r >= tasks[mi]) r -= tasks[mi++];
        int64_t r0 = r * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK;
        if (r1 > m[mi].rows) r1 = m[mi].rows;
        rows_dot(&m[mi], r0, r1, a, vec, outs[mi], T, tab);
    }
}

/* x [T, H] (the residual stream, updated in place) through n_layers layers for the tokens at
 * positions start .. start + T - 1; k_cache[l], v_cache[l]: layer l's [>= start + T, Hkv, D]
 * halves;
 * cos/sin [T, D / 2]. Returns 0 or an error as strata_matmul. */
int strata_dense_layers(float *x, int64_t T, int64_t start, const dense_layer_t *layers,
                        int64_t n_layers, const dense_dims_t *dm, uint16_t *const *k_cache,
                        uint16_t *const *v_cache, const float *cos_t, const float *sin_t,
                        int threads, const uint8_t *tab) {
    const int64_t H = dm->hidden, D = dm->head_dim, F = dm->ffn, S = start + T;
    const int64_t QD = dm->n_heads * D, KD = dm->n_kv_heads * D, W = QD + 2 * KD;
    const int64_t rep = dm->n_heads / dm->n_kv_heads;
    mat_t mats[7];
    int err = 0;
    for (int64_t l = 0; l < n_layers && !err; l++) {
        const int64_t shape[7][2] = {{QD, H}, {KD, H}, {KD, H}, {H, QD}, {F, H}, {F, H}, {H, F}};
        for (int i = 0; i < 7 && !err; i++)
            err = mat_init(&mats[i], NULL, layers[l].qtype[i], 0, shape[i][0], shape[i][1]);
    }
    if (err || D > MAX_HEAD_DIM) return err ? err : -2;
    if (threads < 1) threads = 1;
#define FLOATS(n) malloc(sizeof(float) * (size_t)(n))
    float *h = FLOATS(T * H), *tmp = FLOATS(T * H), *qkv = FLOATS(T * W), *att = FLOATS(T * QD);
    float *gu = FLOATS(T * 2 * F), *scores = FLOATS(threads * S);
#undef FLOATS
    int64_t *vec = malloc(sizeof(int64_t) * (size_t)T);
    float **outs = malloc(sizeof(float *) * (size_t)(7 * T));
    acts_t xa, aa, ga;
    int bad = acts_alloc(&xa, T, H, h, H, tab) | acts_alloc(&aa, T, QD, att, QD, tab);
    bad |= acts_alloc(&ga, T, F, gu, 2 * F, tab);
    if (bad || !h || !tmp || !qkv || !att || !gu || !scores || !vec || !outs) {
        err = -3;
        goto done;
    }
    for (int64_t t = 0; t < T; t++) {
        vec[t] = t;
        outs[t] = qkv + t * W, outs[T + t] = qkv + t * W + QD;
        outs[2 * T + t] = qkv + t * W + QD + KD;
        outs[3 * T + t] = tmp + t * H, outs[6 * T + t] = tmp + t * H;
        outs[4 * T + t] = gu + t * 2 * F, outs[5 * T + t] = gu + t * 2 * F + F;
    }
    float **const qkv_outs[3] = {outs, outs + T, outs + 2 * T};
    float **const gu_outs[2] = {outs + 4 * T, outs + 5 * T};
    float **const o_outs[1] = {outs + 3 * T}, **const down_outs[1] = {outs + 6 * T};
    spin_barrier_t bar = {0, 0, 0, threads};
#pragma omp parallel num_threads(threads)
    {
        int sense = 0, me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        /* the team may be smaller than asked: the barrier counts the threads that came */
#ifdef _OPENMP
#pragma omp single
        bar.n = omp_get_num_threads();
#endif
        for (int64_t l = 0; l < n_layers; l++) {
            const dense_layer_t *ly = &layers[l];
            mat_t m[7];
            for (int i = 0; i < 7; i++)
                mat_init(&m[i], ly->w[i], ly->qtype[i], 0, mats[i].rows, mats[i].cols);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                rms_norm(x + t * H, ly->attn_norm, H, dm->eps, h + t * H);
                quantize_act(&xa, t, h + t * H);
            }
            spin_barrier(&bar, &sense);
            rows_tasks(m, 3, &xa, vec, qkv_outs, T, tab);
            spin_barrier(&bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < T * (dm->n_heads + 2 * dm->n_kv_heads); i++) {
                int64_t t = i / (dm->n_heads + 2 * dm->n_kv_heads);
                int64_t j = i % (dm->n_heads + 2 * dm->n_kv_heads); /* q heads, k heads, v heads */
                int which = j < dm->n_heads ? 0 : j < dm->n_heads + dm->n_kv_heads ? 1 : 2;
                float *v = qkv + t * W + j * D;
                const float *b = ly->bias[which];
                if (b) {
                    int64_t off = j < dm->n_heads ? j * D : (j - dm->n_heads) % dm->n_kv_heads * D;
                    for (int64_t e = 0; e < D; e++) v[e] += b[off + e];
                }
                if (which < 2)
                    rope(v, cos_t + t * D / 2, sin_t + t * D / 2, D, dm->rope_interleaved);
                if (which) {
                    int64_t kv = (j - dm->n_heads) % dm->n_kv_heads;
                    uint16_t *dst = (which == 1 ? k_cache : v_cache)[l];
                    dst += ((start + t) * dm->n_kv_heads + kv) * D;
                    for (int64_t e = 0; e < D; e++) dst[e] = to_f16(v[e]);
                }
            }
            spin_barrier(&bar, &sense);
#pragma omp for schedule(dynamic) nowait
            for (int64_t i = 0; i < T * dm->n_heads; i++) {
                int64_t t = i / dm->n_heads, hd = i % dm->n_heads, kv = hd / rep;
                attend(qkv + t * W + hd * D, k_cache[l] + kv * D, v_cache[l] + kv * D,
                       start + t + 1, KD, D, scores + me * S, att + t * QD + hd * D);
            }
            spin_barrier(&bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) quantize_act(&aa, t, att + t * QD);
            spin_barrier(&bar, &sense);
            rows_tasks(&m[3], 1, &aa, vec, o_outs, T, tab);
            spin_barrier(&bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                for (int64_t e = 0; e < H; e++) x[t * H + e] += tmp[t * H + e];
                rms_norm(x + t * H, ly->ffn_norm, H, dm->eps, h + t * H);
                quantize_act(&xa, t, h + t * H);
            }
            spin_barrier(&bar, &sense);
            rows_tasks(&m[4], 2, &xa, vec, gu_outs, T, tab);
            spin_barrier(&bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                float *g = gu + t * 2 * F; /* silu(gate) * up overwrites gate */
                for (int64_t f = 0; f < F; f++) g[f] = silu(g[f]) * g[F + f];
                quantize_act(&ga, t, g);
            }
            spin_barrier(&bar, &sense);
            rows_tasks(&m[6], 1, &ga, vec, down_outs, T, tab);
            spin_barrier(&bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++)
                for (int64_t e = 0; e < H; e++) x[t * H + e] += tmp[t * H + e];
            spin_barrier(&bar, &sense);
        }
    }
done:
    acts_free(&xa), acts_free(&aa), acts_free(&ga);
    free(h), free(tmp), free(qkv), free(att), free(gu), free(scores), free(vec), free(outs);
    return err;
}
