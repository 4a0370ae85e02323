/* Mamba2's chunked SSD scan on AVX-512, float32: layers/mamba2.py's `ssd_chunked` (its
 * docstring has the equations) with each head's work on a chunk done in one pass, its operands in
 * L1/L2.
 *
 * The chunks run a few at a time (RUN_CHUNKS), their heads on the OpenMP threads: a work item
 * is a group (its C.B formed once a chunk, then each of its heads) or, with fewer groups than
 * threads, part of one (chunk_gemm.h's ScanItem). Per head and chunk: the decays, the within-chunk weights (C_t.B_r) e^{s_t - s_r}, dt x,
 * the state read by C in one product, the outputs straight into the token-major `out` (the
 * product that forms them starts from e^{s_t} C_t S0), and the state advanced in place. The
 * scan keeps each head's state transposed, [N, P], so that both products with it have rows of
 * P floats; it is transposed in at the start and back at the end (and for each snapshot). A
 * static schedule gives a thread the same heads in every chunk, so their states stay in its
 * cache. The products run through chunk_gemm.h's kernel.
 *
 * Compiled and loaded at run time with the other kernels by cpu_kernels.py. Without AVX-512
 * the entry point does nothing and returns 0 (the caller takes its torch form); it also returns
 * 0 for shapes it does not take (head size not a multiple of 16, chunk over MAX_CHUNK).
 */
#include <string.h>

#include "chunk_gemm.h"

#if defined(__AVX512F__)

typedef struct {
    float *cc;     /* [C, N] C of the chunk's tokens (the group's) */
    float *bc;     /* [C, N] B of the chunk's tokens */
    float *bt;     /* [N, C16] B transposed, columns past len zero */
    float *scores; /* [C, C16] C_t.B_r */
    float *weight; /* [C, C16] (C_t.B_r) e^{s_t - s_r}, r <= t */
    float *xdt;    /* [C, P] dt_r x_r */
    float *xw;     /* [C, P] dt_r x_r e^{s_end - s_r} */
    float *read;   /* [C, P] C_t S0 */
    float *snap;   /* [N, P] a snapshot's state before it is transposed out */
    float *xs;     /* [C, P] dt_r x_r e^{s_j - s_r} for a snapshot after j tokens */
    float *xg;     /* [H / G, C, P] x of the chunk's tokens for each head of the group */
    float cum[MAX_CHUNK], din[MAX_CHUNK];
} Scratch;

/* The scratch buffers, in the order of their sizes in scratch_init. */
#define SLOTS(w)                                                                                 \
        &(w)->cc, &(w)->bc, &(w)->bt, &(w)->scores, &(w)->weight, &(w)->xdt, &(w)->xw, &(w)->read, \
        &(w)->snap, &(w)->xs, &(w)->xg
#define SCRATCH_SLOTS 11

static int scratch_init(Scratch *w, int64_t p, int64_t n, int64_t ratio) {
    const int64_t c16 = (MAX_CHUNK + 15) / 16 * 16;
    const size_t sizes[SCRATCH_SLOTS] = {
        (size_t)MAX_CHUNK * n, (size_t)MAX_CHUNK * n,   (size_t)n * c16,
        (size_t)MAX_CHUNK * c16, (size_t)MAX_CHUNK * c16, (size_t)MAX_CHUNK * p,
        (size_t)MAX_CHUNK * p, (size_t)MAX_CHUNK * p,   (size_t)n * p,
        (size_t)MAX_CHUNK * p, (size_t)ratio * MAX_CHUNK * p};
    float **slots[SCRATCH_SLOTS] = {SLOTS(w)};
    return scratch_alloc(slots, sizes, SCRATCH_SLOTS);
}

static void scratch_free(Scratch *w) {
    float **slots[SCRATCH_SLOTS] = {SLOTS(w)};
    scratch_release(slots, SCRATCH_SLOTS);
}

/* dst [rows, cols] = src^T for src [cols, rows] (row strides cols and rows). */
static void transpose(float *dst, const float *src, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[i * cols + j] = src[j * rows + i];
}

/* xw [j, P] = xdt_r e^{s_end - s_r} for r < j. */
static void weighted_writes(float *xw, const Scratch *w, float end, int j, int64_t p) {
    for (int r = 0; r < j; r++) scale_row(xw + r * p, w->xdt + r * p, decay_exp(end - w->cum[r]), (int)p);
}

/* One head's part of a chunk of len tokens; the group's C, B and C.B are in w. Advances the
 * transposed state `st` [N, P], writes the chunk's outputs (row stride h_stride) and the
 * snapshots inside the chunk ([H, P, N] each). */
static void head_chunk(const float *dt, float a, float *st, float *out,
                       float *snaps, const int64_t *snap_pos, int64_t num_snaps,
                       int64_t *next_snap, int64_t start, int len, int64_t heads, int64_t p,
                       int64_t n, int64_t h, int64_t h0, Scratch *w) {
    const int c16 = (len + 15) / 16 * 16;
    const int64_t h_stride = heads * p, state_size = p * n;
    float run = 0.0f;
    for (int t = 0; t < len; t++) {
        run += dt[(start + t) * heads + h] * a;
        w->cum[t] = run;
        w->din[t] = decay_exp(run);
    }
    /* dt x, and the same weighted by its decay to the chunk's end (the state's write), in one
     * pass over x. */
    const float end = w->cum[len - 1];
    const float *xg = w->xg + (h - h0) * MAX_CHUNK * p;
    for (int t = 0; t < len; t++) {
        const float step = dt[(start + t) * heads + h];
        const __m512 sv = _mm512_set1_ps(step), dv = _mm512_set1_ps(step * decay_exp(end - w->cum[t]));
        for (int64_t j = 0; j < p; j += 16) {
            const __m512 xv = _mm512_loadu_ps(xg + t * p + j);
            _mm512_storeu_ps(w->xdt + t * p + j, _mm512_mul_ps(xv, sv));
            _mm512_storeu_ps(w->xw + t * p + j, _mm512_mul_ps(xv, dv));
        }
    }
    for (int t = 0; t < len; t++) {
        float *wt = w->weight + t * c16;
        decay_row(wt, w->cum, t, c16);
        const float *sc = w->scores + t * c16;
        for (int r = 0; r <= t; r++) wt[r] *= sc[r];
    }
    /* C_t S0: [len, P] */
    gemm(len, (int)p, (int)n, w->cc, n, 1, st, p, w->read, p);
    /* y = e^{s_t} C_t S0 + weight (dt x), into the token-major out. */
    gemm_init(len, (int)p, len, w->weight, c16, 1, w->xdt, p, out + start * h_stride + h * p,
              h_stride, w->read, p, w->din, 0.0f);
    /* Snapshots inside this chunk: e^{s_j} S0 + sum_{r < j} e^{s_j - s_r} dt_r x_r B_r^T. */
    while (*next_snap < num_snaps && snap_pos[*next_snap] < start + len) {
        const int j = (int)(snap_pos[*next_snap] - start);
        const float to = w->cum[j - 1];
        weighted_writes(w->xs, w, to, j, p);
        gemm_init((int)n, (int)p, j, w->bc, 1, n, w->xs, p, w->snap, p, st, p, NULL,
                  decay_exp(to));
        transpose(snaps + (*next_snap * heads + h) * state_size, w->snap, p, n);
        (*next_snap)++;
    }
    /* The state at the chunk's end, in place: [N, P] = e^{s_C} S0^T + B^T (xw). */
    gemm_init((int)n, (int)p, len, w->bc, 1, n, w->xw, p, st, p, st, p, NULL, decay_exp(end));
    while (*next_snap < num_snaps && snap_pos[*next_snap] == start + len) {
        transpose(snaps + (*next_snap * heads + h) * state_size, st, p, n);
        (*next_snap)++;
    }
}

/* Heads [h0, h1) of group gr over one chunk of len tokens from `start`. */
static void group_chunk(const float *x, const float *dt, const float *a, const float *b,
                        const float *c, float *st, float *out, float *snaps,
                        const int64_t *snap_pos, int64_t num_snaps, int64_t *next_snap,
                        int64_t start, int len, int64_t heads, int64_t p, int64_t groups,
                        int64_t n, int64_t gr, int64_t h0, int64_t h1, Scratch *w) {
    const int c16 = (len + 15) / 16 * 16;
    const int64_t g_stride = groups * n;
    for (int t = 0; t < len; t++) {
        memcpy(w->cc + t * n, c + (start + t) * g_stride + gr * n, n * sizeof(float));
        memcpy(w->bc + t * n, b + (start + t) * g_stride + gr * n, n * sizeof(float));
    }
    for (int64_t i = 0; i < n; i++) {
        float *row = w->bt + i * c16;
        for (int t = 0; t < len; t++) row[t] = w->bc[t * n + i];
        for (int t = len; t < c16; t++) row[t] = 0.0f;
    }
    gemm(len, c16, (int)n, w->cc, n, 1, w->bt, c16, w->scores, c16);
    /* x of the group's heads, token by token (a token's heads are adjacent in x). */
    const int64_t h_stride = heads * p;
    for (int t = 0; t < len; t++)
        for (int64_t h = h0; h < h1; h++)
            memcpy(w->xg + ((h - h0) * MAX_CHUNK + t) * p, x + (start + t) * h_stride + h * p,
                   p * sizeof(float));
    for (int64_t h = h0; h < h1; h++)
        head_chunk(dt, a[h], st + h * p * n, out, snaps, snap_pos, num_snaps, &next_snap[h],
                   start, len, heads, p, n, h, h0, w);
}

int ssd_chunked_built(void) { return 1; }

/* x [L, H, P]; dt [L, H] (discretised); a [H]; b, c [L, G, N]; state [H, P, N], advanced in
 * place; out [L, H, P]; snaps [num_snaps, H, P, N] get the states after snap_pos[i] tokens
 * (ascending, 1..L). Every tensor contiguous. Returns 1, 0 (nothing written) for a shape it does
 * not take, or -1 where a buffer could not be allocated. */
int ssd_chunked_f32(const float *x, const float *dt, const float *a, const float *b,
                    const float *c, float *state, float *out, float *snaps,
                    const int64_t *snap_pos, int64_t num_snaps, int64_t length, int64_t heads,
                    int64_t p, int64_t groups, int64_t n, int64_t chunk, int threads) {
    if (p % 16 || chunk < 1 || chunk > MAX_CHUNK || groups < 1 || heads % groups || length < 1)
        return 0;
    const int64_t ratio = heads / groups, nthreads = threads > 0 ? threads : 1;
    const int64_t parts = scan_parts(groups, ratio, nthreads), items = groups * parts;
    const int64_t state_size = p * n;
    int64_t *next_snap = calloc((size_t)heads, sizeof(int64_t)); /* per head */
    float *st = aligned_alloc(64, ((size_t)heads * state_size * sizeof(float) + 63) / 64 * 64);
    if (!next_snap || !st) {
        free(next_snap);
        free(st);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads((int)nthreads) reduction(| : failed)
    {
        Scratch w;
        const int ready = scratch_init(&w, p, n, ratio);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const ScanItem it = scan_item(item, parts, ratio);
            for (int64_t h = it.h0; h < it.h1; h++)
                transpose(st + h * state_size, state + h * state_size, n, p);
        }
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
                    group_chunk(x, dt, a, b, c, st, out, snaps, snap_pos, num_snaps, next_snap,
                                start, len, heads, p, groups, n, it.group, it.h0, it.h1, &w);
                }
                if (!ready) failed = 1;
            }
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            const ScanItem it = scan_item(item, parts, ratio);
            for (int64_t h = it.h0; h < it.h1; h++)
                transpose(state + h * state_size, st + h * state_size, p, n);
        }
        scratch_free(&w);
    }
    free(next_snap);
    free(st);
    return failed ? -1 : 1;
}

#else

int ssd_chunked_built(void) { return 0; }

int ssd_chunked_f32(const float *x, const float *dt, const float *a, const float *b,
                    const float *c, float *state, float *out, float *snaps,
                    const int64_t *snap_pos, int64_t num_snaps, int64_t length, int64_t heads,
                    int64_t p, int64_t groups, int64_t n, int64_t chunk, int threads) {
    (void)x; (void)dt; (void)a; (void)b; (void)c; (void)state; (void)out; (void)snaps;
    (void)snap_pos; (void)num_snaps; (void)length; (void)heads; (void)p; (void)groups; (void)n;
    (void)chunk; (void)threads;
    return 0;
}

#endif
