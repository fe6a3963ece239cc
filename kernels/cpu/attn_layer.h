/* A layer's attention half inside a layers call's team (dense.h, moe_layers.h): norm and
 * quantize x; q|k|v rows (one task list over the three matrices, sharing x's int8 copy);
 * bias, per-head q/k RMSNorm (Qwen3's), RoPE, k and v into the half cache; attention per
 * (token, head); o rows into the step's tmp. Included by experts.c after its row dots.
 *
 * Every phase is split over the team, whose threads meet at spin barriers between phases
 * (team.h); a token's attention is the same loop over its keys whatever the other tokens of
 * the call, so results depend neither on how a prompt is chunked nor on the thread count.
 *
 * A call's tokens may belong to several sequences (the engine's batch: each running request's
 * next tokens): token t sits at position pos[t] of sequence seq[t], whose layer-l keys and
 * values are rows of k_cache[seq[t] L + l], v_cache[seq[t] L + l] ([rows, Hkv, D] halves, or
 * int8 with a float scale per row and KV head in k_scale[...], v_scale[...] [rows, Hkv], or
 * (dm.kv_format KV_Q4) 4-bit codes [rows, Hkv, D / 2] with a half (scale, minimum) pair per 32
 * values in k_scale[...], v_scale[...] [rows, Hkv, D / 32, 2]: kernels/formats/kv_q4.py).
 * Position p of sequence q is row tables[q][p / block[q]] block[q] + p % block[q]: a paged
 * cache's blocks (a pool shared by the call's sequences, each its own blocks), or a contiguous
 * cache as one block {0} at least as long as the sequence. The products read each weight row
 * once for every token of the call; only attention looks at a token's own sequence.
 */
#include "team.h"
#include "attend.h"

enum { KV_HALF, KV_INT8, KV_Q4 }; /* how the caches hold keys and values */

typedef struct { /* the attention's shapes */
    int64_t hidden, n_heads, n_kv_heads, head_dim;
    int32_t rope_interleaved;
    float eps;
    int32_t kv_format; /* KV_HALF, KV_INT8 or KV_Q4 */
} attn_dims_t;

typedef struct { /* one layer's attention weights */
    const float *norm;        /* [H] */
    const float *bias[3];     /* q [Hq D], k [Hkv D], v [Hkv D], or NULL */
    const float *q_norm;      /* [D] per head, or NULL */
    const float *k_norm;      /* [D] per head, or NULL */
    const uint8_t *w[4];      /* q, k, v, o: GGUF blocks */
    int32_t qtype[4];
} attn_weights_t;

typedef struct { /* queries q0 .. q1 - 1 of KV head kv of the tokens ta, ta + 1, .. of one
                  * sequence: query j is head kv g + j % g of token ta + j / g */
    int64_t ta, q0, q1, kv;
} attn_task_t;

typedef struct { /* a call's state, shared by the team */
    attn_dims_t dm;
    int64_t T, L;             /* tokens, layers */
    const int64_t *pos;       /* [T] each token's position in its sequence */
    const int32_t *seq;       /* [T] its sequence: its caches are [seq L .. seq L + L) */
    int64_t span;             /* the most keys a token attends: max pos + 1 */
    float *x;                 /* [T, H] the residual stream */
    float *h, *tmp;           /* [T, H]: x normed; the o product */
    float *qkv, *att;         /* [T, Hq D + 2 Hkv D], [T, Hq D] */
    float *scores;            /* [threads, ATTEND_GROUP_MAX span] */
    attn_task_t *tasks;       /* the attention's tasks (attn_tasks) */
    int64_t n_tasks;
    acts_t xa, aa;            /* int8 copies of h and att */
    int64_t *vec;             /* [T]: 0 .. T - 1 */
    float **outs;             /* [4 T]: each token's q, k, v, o outputs */
    void *const *k_cache, *const *v_cache; /* halves, int8 or 4-bit codes (dm.kv_format) */
    void *const *k_scale, *const *v_scale; /* int8's scales or 4-bit's pairs, or NULL */
    const int32_t *const *tables; /* [sequences]: each one's block ids */
    const int64_t *block;     /* [sequences]: its block size (positions a block holds) */
    const float *cos_t, *sin_t;
    const uint8_t *tab;
    spin_barrier_t bar;
} attn_step_t;

/* row tasks of several matrices in one list: task i is rows [r0, r0 + ROWS_PER_TASK) of
 * matrix mi, outs[mi] its outputs per token. Handed out `guided`, as strata_moe's: each
 * thread first walks a long contiguous run, which the prefetchers follow (a3b decode 6.4 ->
 * 6.9-7.1 tok/s against `dynamic`'s interleaved 16-row tasks) */
static void rows_tasks(const mat_t *m, int nm, const acts_t *a, const int64_t *vec,
                       float **const *outs, int64_t T, const uint8_t *tab) {
    int64_t tasks[8] = {0}, total = 0;
    for (int i = 0; i < nm; i++)
        total += tasks[i] = (m[i].rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp for schedule(guided) nowait
    for (int64_t t = 0; t < total; t++) {
        int mi = 0;
        int64_t r = t;
        while (r >= tasks[mi]) r -= tasks[mi++];
        int64_t r0 = r * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK;
        if (r1 > m[mi].rows) r1 = m[mi].rows;
        rows_dot(&m[mi], r0, r1, a, vec, outs[mi], T, tab);
    }
}

/* the q, k, v, o matrices of shape dm; 0 or an error as mat_init */
static int attn_mats(mat_t *m, const attn_weights_t *w, const attn_dims_t *dm) {
    const int64_t H = dm->hidden, QD = dm->n_heads * dm->head_dim;
    const int64_t KD = dm->n_kv_heads * dm->head_dim;
    const int64_t shape[4][2] = {{QD, H}, {KD, H}, {KD, H}, {H, QD}};
    int err = 0;
    for (int i = 0; i < 4 && !err; i++)
        err = mat_init(&m[i], w->w[i], w->qtype[i], 0, shape[i][0], shape[i][1]);
    return err;
}

/* The attention's tasks: each run of consecutive tokens of one sequence has, per KV head, its
 * tokens' g query heads to attend, cut into as few parts as keep the team busy (a part
 * converts its KV rows once for all its queries), at most ATTEND_GROUP_MAX queries a part;
 * `tasks` NULL: only their count. A decode step of many sequences (a token each) has a task
 * per sequence and KV head; one sequence's verify window or prompt chunk, its tokens' heads
 * in parts of up to ATTEND_GROUP_MAX queries, each reading the rows once for all of them. */
static int64_t attn_tasks(const int32_t *seq, int64_t T, int64_t nkv, int64_t g, int threads,
                          attn_task_t *tasks) {
    int64_t runs = 0, n = 0;
    for (int64_t t = 0; t < T; t++) runs += t == 0 || seq[t] != seq[t - 1];
    if (runs == 0) return 0;
    const int64_t want = (2 * threads + runs * nkv - 1) / (runs * nkv); /* parts per run */
    for (int64_t ta = 0, tb; ta < T; ta = tb) {
        for (tb = ta + 1; tb < T && seq[tb] == seq[ta];) tb++;
        const int64_t q = (tb - ta) * g, least = (q + ATTEND_GROUP_MAX - 1) / ATTEND_GROUP_MAX;
        const int64_t parts = want < least ? least : want < q ? want : q;
        for (int64_t kv = 0; kv < nkv; kv++)
            for (int64_t part = 0; part < parts; part++, n++)
                if (tasks)
                    tasks[n] = (attn_task_t){ta, part * q / parts, (part + 1) * q / parts, kv};
    }
    return n;
}

/* allocate s's buffers for its T tokens on `threads` threads (x, pos, seq, the caches, their
 * block tables, the tables and dm set by the caller); 0, -2 for a negative position or an
 * empty block, or -3 */
static int attn_alloc(attn_step_t *s, int threads) {
    const int64_t T = s->T, H = s->dm.hidden, D = s->dm.head_dim;
    const int64_t QD = s->dm.n_heads * D, W = QD + 2 * s->dm.n_kv_heads * D;
    s->span = 1;
    for (int64_t t = 0; t < T; t++) {
        if (s->pos[t] < 0 || s->seq[t] < 0 || s->block[s->seq[t]] < 1) return -2;
        if (s->pos[t] + 1 > s->span) s->span = s->pos[t] + 1;
    }
#define FLOATS(n) malloc(sizeof(float) * (size_t)(n))
    s->h = FLOATS(T * H), s->tmp = FLOATS(T * H), s->qkv = FLOATS(T * W);
    s->att = FLOATS(T * QD), s->scores = FLOATS(threads * ATTEND_GROUP_MAX * s->span);
#undef FLOATS
    s->vec = malloc(sizeof(int64_t) * (size_t)T);
    const int64_t g = s->dm.n_heads / s->dm.n_kv_heads;
    s->n_tasks = attn_tasks(s->seq, T, s->dm.n_kv_heads, g, threads, NULL);
    s->tasks = malloc(sizeof(attn_task_t) * (size_t)s->n_tasks);
    s->outs = malloc(sizeof(float *) * (size_t)(4 * T));
    int bad = acts_alloc(&s->xa, T, H, s->h, H, s->tab);
    bad |= acts_alloc(&s->aa, T, QD, s->att, QD, s->tab);
    if (bad || !s->h || !s->tmp || !s->qkv || !s->att || !s->scores || !s->vec || !s->outs ||
        !s->tasks)
        return -3;
    attn_tasks(s->seq, T, s->dm.n_kv_heads, g, threads, s->tasks);
    for (int64_t t = 0; t < T; t++) {
        s->vec[t] = t;
        s->outs[t] = s->qkv + t * W, s->outs[T + t] = s->qkv + t * W + QD;
        s->outs[2 * T + t] = s->qkv + t * W + QD + s->dm.n_kv_heads * D;
        s->outs[3 * T + t] = s->tmp + t * H;
    }
    s->bar = (spin_barrier_t){0, 0, 0, threads};
    return 0;
}

static void attn_free(attn_step_t *s) {
    acts_free(&s->xa), acts_free(&s->aa);
    free(s->h), free(s->tmp), free(s->qkv), free(s->att), free(s->scores), free(s->vec);
    free(s->outs), free(s->tasks);
}

/* the cache row of position p of sequence q */
static inline int64_t cache_row(const attn_step_t *s, int32_t q, int64_t p) {
    const int64_t b = s->block[q];
    return (int64_t)s->tables[q][p / b] * b + p % b;
}

/* kv_q4.quantize_kv4 of one head's D values (D a multiple of 32): per group of 32, the
 * minimum and (max - minimum) / 15 rounded to halves, each value's code rint((x - minimum) /
 * scale) in 0..15 (0 where the scale is 0), two a byte (value 2j low, 2j + 1 high) */
static void quantize_q4(const float *v, int64_t D, uint8_t *codes, uint16_t *pairs) {
    for (int64_t g0 = 0; g0 < D; g0 += 32) {
        float lo = v[g0], hi = v[g0];
        for (int e = 1; e < 32; e++) {
            lo = v[g0 + e] < lo ? v[g0 + e] : lo;
            hi = v[g0 + e] > hi ? v[g0 + e] : hi;
        }
        const uint16_t lo16 = to_f16(lo), sc16 = to_f16((hi - half_at(&lo16)) / 15.0f);
        const float low = half_at(&lo16), sc = half_at(&sc16), safe = sc > 0.0f ? sc : 1.0f;
        pairs[g0 / 16] = sc16, pairs[g0 / 16 + 1] = lo16;
        for (int e = 0; e < 32; e += 2) {
            float r0 = nearbyintf((v[g0 + e] - low) / safe);
            float r1 = nearbyintf((v[g0 + e + 1] - low) / safe);
            r0 = r0 < 0.0f ? 0.0f : r0 > 15.0f ? 15.0f : r0;
            r1 = r1 < 0.0f ? 0.0f : r1 > 15.0f ? 15.0f : r1;
            codes[(g0 + e) / 2] = (uint8_t)((uint8_t)r0 | (uint8_t)r1 << 4);
        }
    }
}

/* bias, q/k norm, RoPE of head j (q heads, then k heads, then v heads) of token t; k and v
 * into layer l's cache */
static void head_prep(const attn_step_t *s, const attn_weights_t *w, int64_t l, int64_t t,
                      int64_t j) {
    const attn_dims_t *dm = &s->dm;
    const int64_t D = dm->head_dim, nh = dm->n_heads, nkv = dm->n_kv_heads;
    const int64_t W = (nh + 2 * nkv) * D;
    int which = j < nh ? 0 : j < nh + nkv ? 1 : 2;
    float *v = s->qkv + t * W + j * D;
    const float *b = w->bias[which];
    if (b) {
        int64_t off = j < nh ? j * D : (j - nh) % nkv * D;
        for (int64_t e = 0; e < D; e++) v[e] += b[off + e];
    }
    const float *hn = which == 0 ? w->q_norm : which == 1 ? w->k_norm : NULL;
    if (hn) rms_norm(v, hn, D, dm->eps, v);
    if (which < 2) rope(v, s->cos_t + t * D / 2, s->sin_t + t * D / 2, D, dm->rope_interleaved);
    if (which) {
        const int64_t c = s->seq[t] * s->L + l;
        const int64_t at = cache_row(s, s->seq[t], s->pos[t]) * nkv + (j - nh) % nkv;
        void *dst = (which == 1 ? s->k_cache : s->v_cache)[c];
        void *scales = s->k_scale ? (which == 1 ? s->k_scale : s->v_scale)[c] : NULL;
        if (dm->kv_format == KV_INT8) { /* kv_int8.quantize_kv: max |v| / 127, v / scale to even */
            float amax = 0.0f;
            for (int64_t e = 0; e < D; e++) amax = fabsf(v[e]) > amax ? fabsf(v[e]) : amax;
            float sc = amax / 127.0f, safe = sc > 0.0f ? sc : 1.0f;
            int8_t *q = (int8_t *)dst + at * D;
            for (int64_t e = 0; e < D; e++) {
                float r = nearbyintf(v[e] / safe);
                q[e] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
            ((float *)scales)[at] = sc;
        } else if (dm->kv_format == KV_Q4) {
            quantize_q4(v, D, (uint8_t *)dst + at * (D / 2), (uint16_t *)scales + at * (D / 16));
        } else {
            uint16_t *h = (uint16_t *)dst + at * D;
            for (int64_t e = 0; e < D; e++) h[e] = to_f16(v[e]);
        }
    }
}

/* layer l's attention of s->x into s->tmp (the o product, not yet added), by the thread
 * `me` of the team; every thread calls it, and it ends at a barrier */
static void attn_phases(attn_step_t *s, const attn_weights_t *w, const mat_t *m, int64_t l,
                        int *sense, int me) {
    const attn_dims_t *dm = &s->dm;
    const int64_t T = s->T, H = dm->hidden, D = dm->head_dim, nh = dm->n_heads;
    const int64_t nkv = dm->n_kv_heads, QD = nh * D, W = QD + 2 * nkv * D, S = s->span;
    float **const qkv_outs[3] = {s->outs, s->outs + T, s->outs + 2 * T};
    float **const o_outs[1] = {s->outs + 3 * T};
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < T; t++) {
        rms_norm(s->x + t * H, w->norm, H, dm->eps, s->h + t * H);
        quantize_act(&s->xa, t, s->h + t * H);
    }
    spin_barrier(&s->bar, sense);
    rows_tasks(m, 3, &s->xa, s->vec, qkv_outs, T, s->tab);
    spin_barrier(&s->bar, sense);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < T * (nh + 2 * nkv); i++)
        head_prep(s, w, l, i / (nh + 2 * nkv), i % (nh + 2 * nkv));
    spin_barrier(&s->bar, sense);
    const int64_t g = nh / nkv;
#pragma omp for schedule(dynamic) nowait
    for (int64_t i = 0; i < s->n_tasks; i++) {
        const attn_task_t *tk = &s->tasks[i];
        const int32_t q = s->seq[tk->ta];
        const int64_t c = q * s->L + l, kv = tk->kv;
        queries_t qs = {.g = tk->q1 - tk->q0};
        for (int64_t j = tk->q0; j < tk->q1; j++) {
            const int64_t t = tk->ta + j / g, h = kv * g + j % g;
            qs.q[j - tk->q0] = s->qkv + t * W + h * D;
            qs.out[j - tk->q0] = s->att + t * QD + h * D;
            qs.n[j - tk->q0] = s->pos[t] + 1;
        }
        kv_view_t kc = {.stride = nkv * D, .sstride = nkv}, vc = kc;
        if (dm->kv_format == KV_INT8) {
            kc.q = (const int8_t *)s->k_cache[c] + kv * D, kc.sc = (float *)s->k_scale[c] + kv;
            vc.q = (const int8_t *)s->v_cache[c] + kv * D, vc.sc = (float *)s->v_scale[c] + kv;
        } else if (dm->kv_format == KV_Q4) {
            kc.stride = vc.stride = nkv * D / 2, kc.sstride = vc.sstride = nkv * D / 16;
            kc.c4 = (const uint8_t *)s->k_cache[c] + kv * D / 2;
            vc.c4 = (const uint8_t *)s->v_cache[c] + kv * D / 2;
            kc.dm = (const uint16_t *)s->k_scale[c] + kv * D / 16;
            vc.dm = (const uint16_t *)s->v_scale[c] + kv * D / 16;
        } else {
            kc.h = (const uint16_t *)s->k_cache[c] + kv * D;
            vc.h = (const uint16_t *)s->v_cache[c] + kv * D;
        }
        attend(&qs, &kc, &vc, s->tables[q], s->block[q], D,
               s->scores + me * ATTEND_GROUP_MAX * S);
    }
    spin_barrier(&s->bar, sense);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < T; t++) quantize_act(&s->aa, t, s->att + t * QD);
    spin_barrier(&s->bar, sense);
    rows_tasks(&m[3], 1, &s->aa, s->vec, o_outs, T, s->tab);
    spin_barrier(&s->bar, sense);
}

/* after attn_phases: x += the o product in s->tmp, then x normed by `norm` into s->h and
 * quantized into s->xa, the input of the layer's second half; by every thread of the team,
 * without a barrier at the end */
static void ffn_input(attn_step_t *s, const float *norm) {
    const int64_t H = s->dm.hidden;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < s->T; t++) {
        for (int64_t e = 0; e < H; e++) s->x[t * H + e] += s->tmp[t * H + e];
        rms_norm(s->x + t * H, norm, H, s->dm.eps, s->h + t * H);
        quantize_act(&s->xa, t, s->h + t * H);
    }
}

/* the thread's number, and the barrier set to the team that came (maybe fewer than asked);
 * called by every thread at the start of the parallel region */
static int team_join(spin_barrier_t *bar) {
    int me = 0;
#ifdef _OPENMP
    me = omp_get_thread_num();
#pragma omp single
    bar->n = omp_get_num_threads();
#endif
    (void)bar;
    return me;
}
