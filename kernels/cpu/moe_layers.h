/* A stack of MoE transformer layers (Qwen3-MoE's: RMSNorm, GQA attention with per-head q/k
 * RMSNorm and RoPE, a softmax top-k router over routed SwiGLU experts) in one call
 * (kernels/cpu/moe_stack.py launches it; stratad/engine/forward.py is the torch definition).
 * Included by experts.c after attn_layer.h.
 *
 * Why one call: as torch ops, a decode step of the a3b (48 layers) was some 700 pieces of
 * work, a ctypes call and a team wake-up per product plus the norms, RoPE and attention in
 * torch, which cost about as much as reading the weights (attention 113 ms a step for 1 GB,
 * at 14.8 GB/s the read alone takes 65). Here one OpenMP team runs every layer, as dense.h.
 *
 * Phases of a layer's MoE half, after attn_layer.h's attention and the residual: norm +
 * quantize; router rows; one thread routes every token (softmax, top k, renormalized) and
 * groups the items (token, expert) by expert; gate|up rows of each expert in use, a weight row
 * read once for all its tokens; silu * up, quantized; down rows; each token's weighted sum in
 * top-k order into the residual, as strata_moe_parts and the torch forward sum it.
 */

typedef struct {                /* one layer, as kernels/cpu/moe_stack.py's _Layer mirrors it */
    const float *attn_norm;     /* [H] */
    const float *ffn_norm;      /* [H] */
    const float *bias[3];       /* q, k, v biases or NULL */
    const float *q_norm;        /* [D] per head, or NULL */
    const float *k_norm;        /* [D] per head, or NULL */
    const uint8_t *w[8];        /* q, k, v, o, router, then the expert stacks gate, up, down */
    int32_t qtype[8];
    /* [3 E] or NULL: expert e's gate, up and down at 3e, 3e + 1, 3e + 2 wherever they are (the
     * expert store's RAM copy or the file's mapping), in place of the stacks' rows */
    const uint8_t *const *experts;
    /* [3 E] or NULL: the type codes of those parts (a GGUF type, or one with X8_FLAG: an
     * expert store's RAM copy interleaved in eights), else the stacks' qtype[5..7] */
    const int32_t *codes;
} moe_layer_t;

typedef struct {                /* the shapes, as kernels/cpu/moe_stack.py's _Dims mirrors it */
    int64_t hidden, n_heads, n_kv_heads, head_dim, n_experts, top_k, ffn;
    int32_t rope_interleaved, norm_topk;
    float eps;
    int32_t kv_format;          /* KV_HALF, KV_INT8 or KV_Q4 (attn_layer.h) */
} moe_dims_t;

typedef struct { /* a call's routing state, shared by the team */
    int64_t E, K, F, n, ng;     /* experts, per token, expert ffn; items T K; groups in use */
    float *logits;              /* [T, E] */
    float *w;                   /* [n]: item i = t K + j's weight */
    int32_t *ids;               /* [n]: its expert (the caller's [T, K] of this layer) */
    int64_t *order, *gstart;    /* items grouped by expert: order[gstart[g] .. gstart[g+1]) */
    int64_t *gexp, *cur;        /* [E]: group g's expert; a count per expert */
    int64_t *tok;               /* [n]: the token of order[k] */
    float **outs;               /* [3 n]: gate, up, down outputs of order[k]; [T] router's */
    float *gu, *dn;             /* [n, 2F] gate | up (silu * up over gate), [n, H] down */
    acts_t ha;                  /* silu * up as int8 */
} route_t;

/* softmax over r->E logits of token t, top K (largest first, the lower expert on a tie),
 * renormalized to sum 1 if norm: items t K .. t K + K - 1. A NaN probability (a NaN hidden
 * state, e.g. from a cache row never written) counts as 0, so every item names an expert:
 * an id of -1 would index before the groups' arrays. */
static void route_token(route_t *r, int64_t t, int norm) {
    float *p = r->logits + t * r->E, mx = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < r->E; e++) mx = fmaxf(mx, p[e]);
    for (int64_t e = 0; e < r->E; e++) sum += p[e] = expf(p[e] - mx);
    for (int64_t e = 0; e < r->E; e++) p[e] = p[e] / sum == p[e] / sum ? p[e] / sum : 0.0f;
    float kept = 0.0f;
    for (int64_t j = 0; j < r->K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < r->E; e++)
            if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
        r->ids[t * r->K + j] = (int32_t)best;
        kept += r->w[t * r->K + j] = p[best];
        p[best] = -1.0f; /* taken */
    }
    if (norm)
        for (int64_t j = 0; j < r->K; j++) r->w[t * r->K + j] /= kept;
}

/* the items in groups by expert (counting sort: items keep their order within a group) */
static void group_items(route_t *r, int64_t H) {
    const int64_t F = r->F;
    for (int64_t e = 0; e < r->E; e++) r->cur[e] = 0;
    for (int64_t i = 0; i < r->n; i++) r->cur[r->ids[i]]++;
    r->ng = 0;
    for (int64_t e = 0, at = 0; e < r->E; e++) {
        int64_t c = r->cur[e];
        r->cur[e] = at;
        if (c) r->gexp[r->ng] = e, r->gstart[r->ng++] = at;
        at += c;
    }
    r->gstart[r->ng] = r->n;
    for (int64_t i = 0; i < r->n; i++) {
        int64_t k = r->cur[r->ids[i]]++;
        r->order[k] = i, r->tok[k] = i / r->K;
        r->outs[k] = r->gu + i * 2 * F, r->outs[r->n + k] = r->gu + i * 2 * F + F;
        r->outs[2 * r->n + k] = r->dn + i * H;
    }
}

static int route_alloc(route_t *r, int64_t T, int64_t H, const uint8_t *tab) {
    const int64_t n = r->n, E = r->E;
    r->logits = malloc(sizeof(float) * (size_t)(T * E));
    r->w = malloc(sizeof(float) * (size_t)n);
    r->order = malloc(sizeof(int64_t) * (size_t)n), r->tok = malloc(sizeof(int64_t) * (size_t)n);
    r->gstart = malloc(sizeof(int64_t) * (size_t)(E + 1));
    r->gexp = malloc(sizeof(int64_t) * (size_t)E), r->cur = malloc(sizeof(int64_t) * (size_t)E);
    r->outs = malloc(sizeof(float *) * (size_t)(3 * n + T));
    r->gu = malloc(sizeof(float) * (size_t)(n * 2 * r->F));
    r->dn = malloc(sizeof(float) * (size_t)(n * H));
    int bad = acts_alloc(&r->ha, n, r->F, r->gu, 2 * r->F, tab);
    if (bad || !r->logits || !r->w || !r->order || !r->tok || !r->gstart || !r->gexp ||
        !r->cur || !r->outs || !r->gu || !r->dn)
        return -3;
    for (int64_t t = 0; t < T; t++) r->outs[3 * n + t] = r->logits + t * E;
    return 0;
}

static void route_free(route_t *r) {
    acts_free(&r->ha);
    free(r->logits), free(r->w), free(r->order), free(r->tok), free(r->gstart), free(r->gexp);
    free(r->cur), free(r->outs), free(r->gu), free(r->dn);
}

/* part p (0 gate, 1 up, 2 down) of expert e as a matrix like m: its own address xp[3e + p]
 * and, with xc, its own type code xc[3e + p] (checked before the call: mat_init cannot fail) */
static mat_t expert_mat(const mat_t *m, const uint8_t *const *xp, const int32_t *xc, int64_t e,
                        int p) {
    mat_t out = *m;
    if (xc) mat_init(&out, xp[3 * e + p], xc[3 * e + p], 0, m->rows, m->cols);
    out.base = xp[3 * e + p];
    return out;
}

/* layer l's MoE half on s->x (normed into s->xa by the caller, which then met the team at a
 * barrier), by every thread of the team; m: router, gate, up, down (the stacks' first expert);
 * xp: the experts' own addresses (moe_layer_t.experts) or NULL, xc their type codes or NULL;
 * ends at a barrier */
static void moe_phases(attn_step_t *s, route_t *r, const mat_t *m, const uint8_t *const *xp,
                       const int32_t *xc, int norm_topk, int *sense) {
    const int64_t T = s->T, H = s->dm.hidden, F = r->F, n = r->n;
    const int64_t row_tasks = (F + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const int64_t out_tasks = (H + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    float **const router_outs[1] = {r->outs + 3 * n};
    rows_tasks(&m[0], 1, &s->xa, s->vec, router_outs, T, s->tab);
    spin_barrier(&s->bar, sense);
#pragma omp single nowait
    {
        for (int64_t t = 0; t < T; t++) route_token(r, t, norm_topk);
        group_items(r, H);
    }
    spin_barrier(&s->bar, sense);
#pragma omp for schedule(guided) nowait
    for (int64_t task = 0; task < r->ng * row_tasks; task++) {
        /* consecutive tasks walk down one expert's rows: long runs for the prefetcher */
        int64_t g = task / row_tasks, r0 = task % row_tasks * ROWS_PER_TASK;
        int64_t r1 = r0 + ROWS_PER_TASK < F ? r0 + ROWS_PER_TASK : F, k = r->gstart[g];
        mat_t gm = m[1], um = m[2];
        if (xp) {
            gm = expert_mat(&m[1], xp, xc, r->gexp[g], 0);
            um = expert_mat(&m[2], xp, xc, r->gexp[g], 1);
        } else {
            gm.base += r->gexp[g] * F * gm.row_bytes, um.base += r->gexp[g] * F * um.row_bytes;
        }
        rows_dot(&gm, r0, r1, &s->xa, r->tok + k, r->outs + k, r->gstart[g + 1] - k, s->tab);
        rows_dot(&um, r0, r1, &s->xa, r->tok + k, r->outs + n + k, r->gstart[g + 1] - k,
                 s->tab);
    }
    spin_barrier(&s->bar, sense);
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < n; i++) {
        float *h = r->gu + i * 2 * F; /* h overwrites gate in place */
        for (int64_t f = 0; f < F; f++) h[f] = silu(h[f]) * h[F + f];
        if (!m[3].is_float) quantize_act(&r->ha, i, h);
    }
    spin_barrier(&s->bar, sense);
#pragma omp for schedule(guided) nowait
    for (int64_t task = 0; task < r->ng * out_tasks; task++) {
        int64_t g = task / out_tasks, r0 = task % out_tasks * ROWS_PER_TASK;
        int64_t r1 = r0 + ROWS_PER_TASK < H ? r0 + ROWS_PER_TASK : H, k = r->gstart[g];
        mat_t dm = m[3];
        if (xp)
            dm = expert_mat(&m[3], xp, xc, r->gexp[g], 2);
        else
            dm.base += r->gexp[g] * H * dm.row_bytes;
        rows_dot(&dm, r0, r1, &r->ha, r->order + k, r->outs + 2 * n + k, r->gstart[g + 1] - k,
                 s->tab);
    }
    spin_barrier(&s->bar, sense);
#pragma omp for schedule(static) nowait
    for (int64_t task = 0; task < out_tasks; task++) {
        int64_t r0 = task * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < H ? r0 + ROWS_PER_TASK : H;
        for (int64_t t = 0; t < T; t++)
            for (int64_t e = r0; e < r1; e++) {
                float acc = 0.0f; /* the experts' sum, then the residual: the torch order */
                for (int64_t j = 0; j < r->K; j++)
                    acc += r->w[t * r->K + j] * r->dn[(t * r->K + j) * H + e];
                s->x[t * H + e] += acc;
            }
    }
    spin_barrier(&s->bar, sense);
}

/* x [T, H] (in place) through n_layers MoE layers; positions, sequences, caches, block tables
 * and tables as strata_dense_layers (a batch's tokens share the products: a routed expert's
 * rows are read once for every token of the call routed to it); ids [n_layers, T, K]: the experts each token
 * was routed to (the engine's routing counts). Returns 0 or an error as strata_matmul. */
int strata_moe_layers(float *x, int64_t T, const int64_t *pos, const int32_t *seq,
                      const moe_layer_t *layers, int64_t n_layers, const moe_dims_t *dm,
                      void *const *k_cache, void *const *v_cache,
                      void *const *k_scale, void *const *v_scale,
                      const int32_t *const *tables, const int64_t *block, const float *cos_t,
                      const float *sin_t, int32_t *ids, int threads, const uint8_t *tab) {
    const int64_t H = dm->hidden, E = dm->n_experts, F = dm->ffn, K = dm->top_k;
    attn_step_t s = {.dm = {H, dm->n_heads, dm->n_kv_heads, dm->head_dim, dm->rope_interleaved,
                            dm->eps, dm->kv_format},
                     .T = T, .L = n_layers, .pos = pos, .seq = seq, .x = x, .k_cache = k_cache,
                     .v_cache = v_cache, .k_scale = k_scale, .v_scale = v_scale,
                     .tables = tables, .block = block, .cos_t = cos_t,
                     .sin_t = sin_t, .tab = tab};
    route_t r = {E, K, F, T * K, 0};
    attn_weights_t aw[n_layers > 0 ? n_layers : 1];
    mat_t mats[8];
    int err = K < 1 || K > E ? -2 : 0;
    for (int64_t l = 0; l < n_layers && !err; l++) {
        const moe_layer_t *ly = &layers[l];
        aw[l] = (attn_weights_t){ly->attn_norm, {ly->bias[0], ly->bias[1], ly->bias[2]},
                                 ly->q_norm, ly->k_norm, {ly->w[0], ly->w[1], ly->w[2], ly->w[3]},
                                 {ly->qtype[0], ly->qtype[1], ly->qtype[2], ly->qtype[3]}};
        err = attn_mats(mats, &aw[l], &s.dm);
        const int64_t shape[4][2] = {{E, H}, {F, H}, {F, H}, {H, F}};
        for (int i = 0; i < 4 && !err; i++)
            err = mat_init(&mats[4 + i], NULL, ly->qtype[4 + i], 0, shape[i][0], shape[i][1]);
        for (int64_t j = 0; ly->experts && ly->codes && j < 3 * E && !err; j++) {
            mat_t probe; /* each expert's own part type, checked once here */
            err = mat_init(&probe, NULL, ly->codes[j], 0, shape[1 + j % 3][0], shape[1 + j % 3][1]);
        }
    }
    if (err || dm->head_dim > MAX_HEAD_DIM) return err ? err : -2;
    if (threads < 1) threads = 1;
    if ((err = attn_alloc(&s, threads)) || route_alloc(&r, T, H, tab)) {
        err = err ? err : -3;
        goto done;
    }
#pragma omp parallel num_threads(threads)
    {
        int sense = 0, me = team_join(&s.bar);
        for (int64_t l = 0; l < n_layers; l++) {
            const moe_layer_t *ly = &layers[l];
            mat_t m[8];
            attn_mats(m, &aw[l], &s.dm);
            for (int i = 4; i < 8; i++)
                mat_init(&m[i], ly->w[i], ly->qtype[i], 0, mats[i].rows, mats[i].cols);
            attn_phases(&s, &aw[l], m, l, &sense, me);
            ffn_input(&s, ly->ffn_norm);
            if (me == 0) r.ids = ids + l * T * K; /* read after the barrier */
            spin_barrier(&s.bar, &sense);
            moe_phases(&s, &r, &m[4], ly->experts, ly->experts ? ly->codes : NULL,
                       dm->norm_topk, &sense);
        }
    }
done:
    attn_free(&s), route_free(&r);
    return err;
}
