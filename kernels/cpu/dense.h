/* A stack of dense transformer layers (llama's: RMSNorm, GQA attention with RoPE, SwiGLU) in
 * one call: the cpu engine's whole forward but for the embedding and the head
 * (kernels/cpu/dense.py launches it; stratad/engine/forward.py is the torch definition).
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
 * attention per (token, KV head: its query heads together); o rows; residual, norm,
 * quantize; gate|up rows; silu * up, quantized; down rows; residual. Many tokens (a prompt) go through every phase together, so a
 * weight row is read once for up to VEC_TILE of them. A token's attention is the same loop
 * over its keys whatever the other tokens of the call: results do not depend on how a prompt
 * is chunked, nor on the thread count (every value is computed by one thread in one order),
 * nor on which other sequences' tokens share the call (a batch: attn_layer.h).
 */

typedef struct {                /* one layer, as kernels/cpu/dense.py's _Layer mirrors it */
    const float *attn_norm;     /* [H] */
    const float *ffn_norm;      /* [H] */
    const float *bias[3];       /* q [Hq D], k [Hkv D], v [Hkv D], or NULL */
    const uint8_t *w[7];        /* q, k, v, o, gate, up, down: GGUF blocks */
    int32_t qtype[7];
} dense_layer_t;

typedef struct {                /* the shapes, as kernels/cpu/dense.py's _Dims mirrors it */
    int64_t hidden, n_heads, n_kv_heads, head_dim, ffn;
    int32_t rope_interleaved;
    float eps;
    int32_t kv_format;          /* KV_HALF, KV_INT8 or KV_Q4 (attn_layer.h) */
} dense_dims_t;

/* x [T, H] (the residual stream, updated in place) through n_layers layers; token t at
 * position pos[t] of sequence seq[t], whose layer l keys and values are rows of
 * k_cache[seq[t] n_layers + l], v_cache[...] ([rows, Hkv, D] halves, or int8 with float scales
 * k_scale[...], v_scale[...] [rows, Hkv], or 4-bit codes with their pairs, as dm->kv_format
 * says: attn_layer.h): position p at row
 * tables[seq[t]][p / block[seq[t]]] block[seq[t]] + p % block[seq[t]] (attn_layer.h); cos/sin
 * [T, D / 2] at each token's position. Returns 0 or an error as strata_matmul. */
int strata_dense_layers(float *x, int64_t T, const int64_t *pos, const int32_t *seq,
                        const dense_layer_t *layers, int64_t n_layers, const dense_dims_t *dm,
                        void *const *k_cache, void *const *v_cache,
                        void *const *k_scale, void *const *v_scale,
                        const int32_t *const *tables, const int64_t *block, const float *cos_t,
                        const float *sin_t, int threads, const uint8_t *tab) {
    const int64_t H = dm->hidden, F = dm->ffn;
    attn_step_t s = {.dm = {H, dm->n_heads, dm->n_kv_heads, dm->head_dim, dm->rope_interleaved,
                            dm->eps, dm->kv_format},
                     .T = T, .L = n_layers, .pos = pos, .seq = seq, .x = x, .k_cache = k_cache,
                     .v_cache = v_cache, .k_scale = k_scale, .v_scale = v_scale,
                     .tables = tables, .block = block, .cos_t = cos_t,
                     .sin_t = sin_t, .tab = tab};
    attn_weights_t aw[n_layers > 0 ? n_layers : 1];
    mat_t mats[7];
    int err = 0;
    for (int64_t l = 0; l < n_layers && !err; l++) {
        const dense_layer_t *ly = &layers[l];
        aw[l] = (attn_weights_t){ly->attn_norm, {ly->bias[0], ly->bias[1], ly->bias[2]}, NULL,
                                 NULL, {ly->w[0], ly->w[1], ly->w[2], ly->w[3]},
                                 {ly->qtype[0], ly->qtype[1], ly->qtype[2], ly->qtype[3]}};
        err = attn_mats(mats, &aw[l], &s.dm);
        const int64_t shape[3][2] = {{F, H}, {F, H}, {H, F}};
        for (int i = 0; i < 3 && !err; i++)
            err = mat_init(&mats[4 + i], NULL, ly->qtype[4 + i], 0, shape[i][0], shape[i][1]);
    }
    if (err || dm->head_dim > MAX_HEAD_DIM) return err ? err : -2;
    if (threads < 1) threads = 1;
    float *gu = malloc(sizeof(float) * (size_t)(T * 2 * F));
    float **outs = malloc(sizeof(float *) * (size_t)(3 * T));
    acts_t ga;
    int bad = acts_alloc(&ga, T, F, gu, 2 * F, tab);
    if ((err = attn_alloc(&s, threads)) || bad || !gu || !outs) {
        err = err ? err : -3;
        goto done;
    }
    for (int64_t t = 0; t < T; t++) {
        outs[t] = gu + t * 2 * F, outs[T + t] = gu + t * 2 * F + F, outs[2 * T + t] = s.tmp + t * H;
    }
    float **const gu_outs[2] = {outs, outs + T}, **const down_outs[1] = {outs + 2 * T};
#pragma omp parallel num_threads(threads)
    {
        int sense = 0, me = team_join(&s.bar);
        for (int64_t l = 0; l < n_layers; l++) {
            const dense_layer_t *ly = &layers[l];
            mat_t m[7];
            attn_mats(m, &aw[l], &s.dm);
            for (int i = 4; i < 7; i++)
                mat_init(&m[i], ly->w[i], ly->qtype[i], 0, mats[i].rows, mats[i].cols);
            attn_phases(&s, &aw[l], m, l, &sense, me);
            ffn_input(&s, ly->ffn_norm);
            spin_barrier(&s.bar, &sense);
            rows_tasks(&m[4], 2, &s.xa, s.vec, gu_outs, T, tab);
            spin_barrier(&s.bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++) {
                float *g = gu + t * 2 * F; /* silu(gate) * up overwrites gate */
                for (int64_t f = 0; f < F; f++) g[f] = silu(g[f]) * g[F + f];
                quantize_act(&ga, t, g);
            }
            spin_barrier(&s.bar, &sense);
            rows_tasks(&m[6], 1, &ga, s.vec, down_outs, T, tab);
            spin_barrier(&s.bar, &sense);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < T; t++)
                for (int64_t e = 0; e < H; e++) x[t * H + e] += s.tmp[t * H + e];
            spin_barrier(&s.bar, &sense);
        }
    }
done:
    attn_free(&s), acts_free(&ga), free(gu), free(outs);
    return err;
}
