/* Decoders of the low-bit i-quants (IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S), included by
 * decode.h, whose contract they follow: super-block c of a row to int8 q[256] and one float
 * factor per 16 values, value i = fs[i / 16] * q[i].
 *
 * Each stores indices into a lattice codebook (the grid: 4 or 8 small integers per point) and
 * sign bits; layouts as kernels/formats/quant_iq.py (bytes; d is the fp16 scale):
 *   IQ3_XXS (98): d | qs 64 (grid of 4) | 8 x u32 (4 x 7-bit sign index, 4-bit scale)
 *   IQ2_XXS (66): d | 8 x (4 grid indices (grid of 8) | u32 as IQ3_XXS's)
 *   IQ2_XS (74):  d | 32 x u16 (9-bit index, 7-bit sign index) | scales 8 (4-bit)
 *   IQ2_S (82):   d | qs 32 | signs 32 | qh 8 (2 more index bits) | scales 8 (4-bit)
 *   IQ1_S (50):   d | qs 32 | 8 x u16 (3 x 3 index bits, 3-bit scale, delta sign)
 * A 7-bit sign index becomes 8 sign bits through KSIGNS (the 8th makes the count of minus
 * signs even). The factors are computed in llama.cpp's order (d * (0.5 + s) * 0.25), so the
 * C kernels and the torch references scale the same integers by the same floats.
 */

/* the grids and ksigns in the tables buffer: kernels/formats/iq_tables.py's offsets, which
 * tests/test_cpu_iq_low.py reads back from here */
#define IQ3_XXS_GRID 2064
#define IQ2_XXS_GRID 3088
#define IQ2_XS_GRID 5136
#define IQ2_S_GRID 9232
#define IQ1_S_GRID 17424
#define KSIGNS 33808

enum { T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ2_S = 22 };

/* n grid values g[0..n) with sign bits s (bit k set: value k negative) */
static inline void signed_grid(int8_t *restrict q, const uint8_t *g, unsigned s, int n) {
    for (int k = 0; k < n; k++) q[k] = (int8_t)((s >> k) & 1 ? -g[k] : g[k]);
}

static inline unsigned le16(const uint8_t *p) { return (unsigned)(p[0] | p[1] << 8); }

static inline int nibble(const uint8_t *p, int i) { return (p[i / 2] >> (4 * (i % 2))) & 15; }

static void dec_iq3_xxs(DECODE_ARGS) {
    const uint8_t *b = row + c * 98, *qs = b + 2, *ks = tab + KSIGNS;
    float d = f16(b);
    for (int j = 0; j < 8; j++) { /* 32 values: 8 grid points of 4, 4 sign indices */
        uint32_t aux = le32(b + 66 + 4 * j);
        scale32(fs, j, d * (0.5f + (float)(aux >> 28)) * 0.5f);
        for (int l = 0; l < 4; l++) {
            unsigned s = ks[(aux >> (7 * l)) & 127];
            int8_t *o = q + 32 * j + 8 * l;
            signed_grid(o, tab + IQ3_XXS_GRID + 4 * qs[8 * j + 2 * l], s, 4);
            signed_grid(o + 4, tab + IQ3_XXS_GRID + 4 * qs[8 * j + 2 * l + 1], s >> 4, 4);
        }
    }
}

static void dec_iq2_xxs(DECODE_ARGS) {
    const uint8_t *b = row + c * 66, *ks = tab + KSIGNS;
    float d = f16(b);
    for (int j = 0; j < 8; j++) { /* 32 values: 4 grid points of 8 */
        const uint8_t *p = b + 2 + 8 * j;
        uint32_t aux = le32(p + 4);
        scale32(fs, j, d * (0.5f + (float)(aux >> 28)) * 0.25f);
        for (int l = 0; l < 4; l++)
            signed_grid(q + 32 * j + 8 * l, tab + IQ2_XXS_GRID + 8 * p[l],
                        ks[(aux >> (7 * l)) & 127], 8);
    }
}

static void dec_iq2_xs(DECODE_ARGS) {
    const uint8_t *b = row + c * 74, *ks = tab + KSIGNS;
    float d = f16(b);
    for (int s = 0; s < 16; s++) fs[s] = d * (0.5f + (float)nibble(b + 66, s)) * 0.25f;
    for (int m = 0; m < 32; m++) { /* 8 values per word */
        unsigned w = le16(b + 2 + 2 * m);
        signed_grid(q + 8 * m, tab + IQ2_XS_GRID + 8 * (w & 511), ks[w >> 9], 8);
    }
}

static void dec_iq2_s(DECODE_ARGS) {
    const uint8_t *b = row + c * 82, *qs = b + 2, *sg = b + 34, *qh = b + 66;
    float d = f16(b);
    for (int s = 0; s < 16; s++) fs[s] = d * (0.5f + (float)nibble(b + 74, s)) * 0.25f;
    for (int m = 0; m < 32; m++) {
        unsigned index = qs[m] | ((qh[m / 4] >> (2 * (m % 4))) & 3) << 8;
        signed_grid(q + 8 * m, tab + IQ2_S_GRID + 8 * index, sg[m], 8);
    }
}

/* value = dl (g + delta), g in {-1, 0, 1} and delta +-1/8: fs = dl / 8, q = 8 g +- 1 (exact) */
static void dec_iq1_s(DECODE_ARGS) {
    const uint8_t *b = row + c * 50, *qs = b + 2;
    const int8_t *grid = (const int8_t *)(tab + IQ1_S_GRID);
    float d = f16(b);
    for (int j = 0; j < 8; j++) {
        unsigned h = le16(b + 34 + 2 * j);
        scale32(fs, j, d * (float)(2 * ((h >> 12) & 7) + 1) * 0.125f);
        int delta = h & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; l++) {
            const int8_t *g = grid + 8 * (qs[4 * j + l] | ((h >> (3 * l)) & 7) << 8);
            for (int k = 0; k < 8; k++) q[32 * j + 8 * l + k] = (int8_t)(8 * g[k] + delta);
        }
    }
}

static decode_fn decoder_iq_low(int qtype) {
    switch (qtype) {
    case T_IQ3_XXS: return dec_iq3_xxs;
    case T_IQ2_XXS: return dec_iq2_xxs;
    case T_IQ2_XS: return dec_iq2_xs;
    case T_IQ2_S: return dec_iq2_s;
    case T_IQ1_S: return dec_iq1_s;
    default: return NULL;
    }
}
