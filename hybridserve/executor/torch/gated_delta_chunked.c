/* The chunked gated delta rule on AVX-512, float32: layers/gated_delta.py's
 * `gated_delta_rule_chunked` (the WY / UT-transform form; its docstring has the equations) with
 * each value head's work on a chunk done in one pass, its operands in L1/L2.
 *
 * In torch the chunk terms are batched over a span and the chunks then run one small batched
 * product after another: each product is a library call on a few hundred KiB, and the operands
 * cross memory between them (the head-major copies of q and k, the transposed output): 210-260
 * ms for 4,096 tokens at Qwen3-Next's layer shape on the Intel Xeon host, 2 threads. Here the
 * chunks run a few at a time, their heads on the OpenMP threads: a work item is a key head (its
 * q.k and k.k formed once a chunk, then each of its value heads) or, with fewer key heads than
 * threads, part of one. Per value head and chunk: the decays and the UT transform (forward
 * substitution), the state read by q and k in one product, the written values u, the outputs
 * straight into the token-major `out`, and the state advanced in place. A static schedule gives
 * a thread the same heads in every chunk, so their states stay in its cache, and a chunk's rows
 * of v and of the output are touched together. The products run through one register-blocked
 * kernel (up to 6 rows x 64 columns of accumulators) that can start from a scaled copy of
 * another matrix, so that the state's decay and the outputs' e^{c_t} q_t S0 cost no pass of
 * their own. 70-76 ms for the same 4,096 tokens at 16-token chunks (recurrent_prefill.py).
 *
 * Decays follow recurrence.py: exp(x) for a log decay x >= LOG_DECAY_FLOOR, exactly 0 below
 * it, and a transform entry whose decay is 0 is 0.
 *
 * Compiled and loaded at run time with the other kernels by cpu_kernels.py. Without AVX-512
 * the entry point does nothing and returns 0 (the caller takes its torch form); it also returns
 * 0 for shapes it does not take (value head size not a multiple of 16, chunk over MAX_CHUNK). */
#include <string.h>

#include "chunk_gemm.h"

#if defined(__AVX512F__)

typedef struct {
    float *qk;     /* [2C, Dk]: q then k of the chunk's len tokens (rows 0..len, len..2 len) */
    float *kt;     /* [Dk, C16]: k transposed, columns past len zero */
    float *gram;   /* [2C, C16]: q.k then k.k, rows as qk's */
    float *decay;  /* [C, C16] e^{c_t - c_s}, s <= t, else 0 */
    float *tr;     /* [C, C16] the transform T diag(beta) */
    float *attn;   /* [C, C16] (q_t.k_s) e^{c_t - c_s} */
    float *read;   /* [2C, Dv] the state read by q then k */
    float *u;      /* [C, Dv] the written values */
    float *ks;     /* [C, Dk] k scaled by a decay to a snapshot or the chunk's end */
    float cum[MAX_CHUNK], din[MAX_CHUNK];
} Scratch;

/* The scratch buffers, in the order of their sizes in scratch_init. */
#define SLOTS(w)                                                                                 \
        &(w)->qk, &(w)->kt, &(w)->gram, &(w)->decay, &(w)->tr, &(w)->attn, &(w)->read, &(w)->u, \
        &(w)->ks
#define SCRATCH_SLOTS 9

static int scratch_init(Scratch *w, int64_t dk, int64_t dv, int c16) {
    const size_t sizes[SCRATCH_SLOTS] = {
        (size_t)2 * MAX_CHUNK * dk, (size_t)dk * c16,       (size_t)2 * MAX_CHUNK * c16,
        (size_t)MAX_CHUNK * c16,    (size_t)MAX_CHUNK * c16, (size_t)MAX_CHUNK * c16,
        (size_t)2 * MAX_CHUNK * dv, (size_t)MAX_CHUNK * dv,  (size_t)MAX_CHUNK * dk};
    float **slots[SCRATCH_SLOTS] = {SLOTS(w)};
    return scratch_alloc(slots, sizes, SCRATCH_SLOTS);
}

static void scratch_free(Scratch *w) {
    float **slots[SCRATCH_SLOTS] = {SLOTS(w)};
    scratch_release(slots, SCRATCH_SLOTS);
}

/* ks [j, Dk] = k_s e^{c_end - c_s} for s < j (k from the qk scratch's k rows). */
static void scaled_keys(float *ks, const float *keys, const float *cum, float end, int j,
                        int64_t dk) {
    for (int s = 0; s < j; s++) {
        const float d = decay_exp(end - cum[s]);
        scale_row(ks + s * dk, keys + s * dk, d, (int)dk);
    }
}

/* One value head's part of a chunk of len tokens; the key head's q, k, k^T and grams are in w.
 * Advances `state` [Dk, Dv] and writes the chunk's outputs (row stride v_stride) and the
 * snapshots inside the chunk. */
static void value_head_chunk(const float *v, const float *g, const float *beta, float *state,
                             float *out, float *snaps, const int64_t *snap_pos,
                             int64_t num_snaps, int64_t *next_snap, int64_t start, int len,
                             int64_t hv, int64_t dk, int64_t dv, int64_t h, Scratch *w) {
    const int c16 = (int)((len + 15) / 16 * 16);
    const int64_t v_stride = hv * dv, state_size = dk * dv;
    const float *keys = w->qk + len * dk;
    float run = 0.0f;
    for (int t = 0; t < len; t++) {
        run += g[(start + t) * hv + h];
        w->cum[t] = run;
        w->din[t] = decay_exp(run);
    }
    /* Decays, the attention, and the UT transform
     * by forward substitution: T = (I + L)^-1 with L[t][s] = beta_t (k_t.k_s) e^{c_t - c_s}
     * for s < t; row t: T[t][s] = delta_ts - sum_{s <= r < t} L[t][r] T[r][s]. */
    for (int t = 0; t < len; t++) decay_row(w->decay + t * c16, w->cum, t, c16);
    for (int t = 0; t < len; t++) {
        const float *dec = w->decay + t * c16;
        const float bt = beta[(start + t) * hv + h];
        float *at = w->attn + t * c16, *tt = w->tr + t * c16;
        const float *qk_row = w->gram + t * c16, *kk_row = w->gram + (len + t) * c16;
        float lower[MAX_CHUNK];
        for (int s = 0; s < c16; s++) {
            at[s] = qk_row[s] * dec[s];
            tt[s] = 0.0f;
        }
        for (int s = 0; s < t; s++) lower[s] = bt * kk_row[s] * dec[s];
        tt[t] = 1.0f;
        for (int r = 0; r < t; r++) { /* row r of T is zero past column r */
            const float l = lower[r];
            if (l == 0.0f) continue;
            const float *tr_r = w->tr + r * c16;
            const __m512 lv = _mm512_set1_ps(l);
            for (int j = 0; j <= r; j += 16)
                _mm512_storeu_ps(tt + j, _mm512_fnmadd_ps(lv, _mm512_loadu_ps(tr_r + j),
                                                          _mm512_loadu_ps(tt + j)));
        }
    }
    /* Mask entries whose decay is zero, then scale column s by beta_s. */
    float betas[MAX_CHUNK];
    for (int s = 0; s < len; s++) betas[s] = beta[(start + s) * hv + h];
    for (int t = 0; t < len; t++) {
        float *tt = w->tr + t * c16;
        const float *dec = w->decay + t * c16;
        for (int s = 0; s <= t; s++) tt[s] = dec[s] == 0.0f ? 0.0f : tt[s] * betas[s];
    }
    /* The state read by q and k at once: [2 len, Dv]. */
    gemm(2 * len, (int)dv, (int)dk, w->qk, dk, 1, state, dv, w->read, dv);
    /* u = T diag(beta) (V - e^c (K S0)): the right side into read's k rows, in place. */
    for (int t = 0; t < len; t++) {
        float *r = w->read + (len + t) * dv;
        const float *vr = v + (start + t) * v_stride + h * dv;
        const __m512 d = _mm512_set1_ps(w->din[t]);
        for (int64_t j = 0; j < dv; j += 16)
            _mm512_storeu_ps(r + j, _mm512_fnmadd_ps(d, _mm512_loadu_ps(r + j),
                                                     _mm512_loadu_ps(vr + j)));
    }
    gemm(len, (int)dv, len, w->tr, c16, 1, w->read + len * dv, dv, w->u, dv);
    /* Outputs, e^{c_t} q_t S0 + attn u, straight into the token-major out. */
    gemm_init(len, (int)dv, len, w->attn, c16, 1, w->u, dv, out + start * v_stride + h * dv,
              v_stride, w->read, dv, w->din, 0.0f);
    /* Snapshots inside this chunk, from the state it started with:
     * e^{c_j} S0 + sum_{s < j} e^{c_j - c_s} k_s u_s^T. */
    while (*next_snap < num_snaps && snap_pos[*next_snap] < start + len) {
        const int j = (int)(snap_pos[*next_snap] - start);
        float *dst = snaps + (*next_snap * hv + h) * state_size;
        const float end = w->cum[j - 1];
        scaled_keys(w->ks, keys, w->cum, end, j, dk);
        gemm_init((int)dk, (int)dv, j, w->ks, 1, dk, w->u, dv, dst, dv, state, dv, NULL,
                  decay_exp(end));
        (*next_snap)++;
    }
    /* The state at the chunk's end, e^{c_C} S0 + sum_s e^{c_C - c_s} k_s u_s^T, in place. */
    const float end = w->cum[len - 1];
    scaled_keys(w->ks, keys, w->cum, end, len, dk);
    gemm_init((int)dk, (int)dv, len, w->ks, 1, dk, w->u, dv, state, dv, state, dv, NULL,
              decay_exp(end));
    while (*next_snap < num_snaps && snap_pos[*next_snap] == start + len) {
        memcpy(snaps + (*next_snap * hv + h) * state_size, state, state_size * sizeof(float));
        (*next_snap)++;
    }
}

/* Value heads [h0, h1) of key head kh over one chunk of len tokens from `start`: the key
 * head's q, k and their products, then each value head's part. */
static void group_chunk(const float *q, const float *k, const float *v, const float *g,
                        const float *beta, float *state, float *out, float *snaps,
                        const int64_t *snap_pos, int64_t num_snaps, int64_t *next_snap,
                        int64_t start, int len, int64_t hk, int64_t hv,
                        int64_t dk, int64_t dv, int64_t kh, int64_t h0, int64_t h1, Scratch *w) {
    const int64_t qk_stride = hk * dk;
    const int c16 = (len + 15) / 16 * 16;
    const float *qc = q + start * qk_stride + kh * dk;
    const float *kc = k + start * qk_stride + kh * dk;
    for (int t = 0; t < len; t++) {
        memcpy(w->qk + t * dk, qc + t * qk_stride, dk * sizeof(float));
        memcpy(w->qk + (len + t) * dk, kc + t * qk_stride, dk * sizeof(float));
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = w->kt + i * c16;
        for (int t = 0; t < len; t++) row[t] = w->qk[(len + t) * dk + i];
        for (int t = len; t < c16; t++) row[t] = 0.0f;
    }
    /* q.k and k.k: [2 len, C16] */
    gemm(2 * len, c16, (int)dk, w->qk, dk, 1, w->kt, c16, w->gram, c16);
    for (int64_t h = h0; h < h1; h++)
        value_head_chunk(v, g, beta, state + h * dk * dv, out, snaps, snap_pos, num_snaps,
                         &next_snap[h], start, len, hv, dk, dv, h, w);
}

int gated_delta_chunked_built(void) { return 1; }

/* q, k [L, Hk, Dk]; v [L, Hv, Dv]; g, beta [L, Hv]; state [Hv, Dk, Dv], advanced in place; out
 * [L, Hv, Dv]; snaps [num_snaps, Hv, Dk, Dv] get the states after snap_pos[i] tokens (ascending,
 * 1..L). Every tensor contiguous. Returns 1, or 0 (nothing written) for a shape it does not
 * take. */
int gated_delta_chunked_f32(const float *q, const float *k, const float *v, const float *g,
                            const float *beta, float *state, float *out, float *snaps,
                            const int64_t *snap_pos, int64_t num_snaps, int64_t length,
                            int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t chunk,
                            int threads) {
    if (dv % 16 || chunk < 1 || chunk > MAX_CHUNK || hk < 1 || hv % hk || length < 1) return 0;
    const int c16 = (int)((chunk + 15) / 16 * 16);
    const int64_t ratio = hv / hk, nthreads = threads > 0 ? threads : 1;
    const int64_t parts = scan_parts(hk, ratio, nthreads), items = hk * parts;
    int64_t *next_snap = calloc((size_t)hv, sizeof(int64_t)); /* per value head */
    if (!next_snap) return -1;
    int failed = 0;
    /* RUN_CHUNKS chunks at a time, their heads on the threads: a work item is a key head (its
     * products shared by its value heads) or, with fewer key heads than threads, part of one
     * (chunk_gemm.h's ScanItem). The static schedule gives a thread the same items every time,
     * so their states stay in its cache, and a chunk's rows of v and of the output are read
     * and written while they are near each other in memory. */
#pragma omp parallel num_threads((int)nthreads) reduction(| : failed)
    {
        Scratch w;
        const int ready = scratch_init(&w, dk, dv, c16);
        for (int64_t first = 0; first < length; first += RUN_CHUNKS * chunk) {
            const int64_t last = first + RUN_CHUNKS * chunk < length ? first + RUN_CHUNKS * chunk
                                                                   : length;
            /* Every thread meets each loop (a worksharing loop must be met by all or none);
             * one without its scratch computes nothing and the call fails as a whole. */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++) {
                const ScanItem it = scan_item(item, parts, ratio);
                for (int64_t start = first; start < last && ready && it.h0 < it.h1;
                     start += chunk) {
                    const int len = (int)(last - start < chunk ? last - start : chunk);
                    group_chunk(q, k, v, g, beta, state, out, snaps, snap_pos, num_snaps,
                                next_snap, start, len, hk, hv, dk, dv, it.group, it.h0, it.h1,
                                &w);
                }
                if (!ready) failed = 1;
            }
        }
        scratch_free(&w);
    }
    free(next_snap);
    return failed ? -1 : 1;
}

#else

int gated_delta_chunked_built(void) { return 0; }

int gated_delta_chunked_f32(const float *q, const float *k, const float *v, const float *g,
                            const float *beta, float *state, float *out, float *snaps,
                            const int64_t *snap_pos, int64_t num_snaps, int64_t length,
                            int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t chunk,
                            int threads) {
    (void)q; (void)k; (void)v; (void)g; (void)beta; (void)state; (void)out; (void)snaps;
    (void)snap_pos; (void)num_snaps; (void)length; (void)hk; (void)hv; (void)dk; (void)dv;
    (void)chunk; (void)threads;
    return 0;
}

#endif
