/* Paged decode attention on the CPU, float32: each decode's query heads attend over its
 * request's keys read in place from the paged cache, with no gather into a contiguous copy.
 *
 * One job per (request, KV head): the G query heads of that KV head attend together, so each
 * key and value row is read once for all of them. Keys are taken in tiles that never cross a
 * block (slots within a block are consecutive: no division per key) and the softmax is online
 * (a running maximum and sum per head, the output rescaled when the maximum grows). Jobs run on
 * OpenMP threads, largest first. With fewer jobs than threads (one decode of a model with one KV
 * head) each job's positions are split into parts, one per thread, whose partial softmaxes are
 * merged at the end. Each tile asks for the next tile's keys and values from memory before it
 * computes (software prefetch), so that the reads overlap the arithmetic, and the values of a
 * tile are summed with a slice of every head's output held in registers (`values_tile`).
 *
 * Compiled and loaded at run time by paged_kernel.py; the layouts it reads are described there.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16
/* A job is split only into parts of at least this many positions. */
#define MIN_PART 64

/* One query against four consecutive key rows: four independent sums (one would wait on the
 * latency of each add before the next). */
static inline void dot4(const float *q, const float *k, int64_t k_slot, int64_t D, float *s) {
    const float *k0 = k, *k1 = k + k_slot, *k2 = k + 2 * k_slot, *k3 = k + 3 * k_slot;
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        float x = q[d];
        a0 += x * k0[d];
        a1 += x * k1[d];
        a2 += x * k2[d];
        a3 += x * k3[d];
    }
    s[0] = a0;
    s[1] = a1;
    s[2] = a2;
    s[3] = a3;
}

#define CHUNK 16

/* acc[g] += sum_j p[g, j] * v_j over the n value rows of a tile, for G query heads (a constant
 * where it is inlined: 1, 2, 4 or 8). A CHUNK-wide slice of every head's output stays in
 * registers while the tile's rows stream past, so each value slice is loaded once for all G
 * heads and each output slice once a tile (not once a key). */
static inline __attribute__((always_inline)) void values_tile(const float *vt, int64_t v_slot,
                                                              int64_t n, const float *p,
                                                              const int64_t G, int64_t Dv,
                                                              float *acc) {
    int64_t d0 = 0;
    for (; d0 + CHUNK <= Dv; d0 += CHUNK) {
        float a[8][CHUNK];
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < CHUNK; d++) a[g][d] = acc[g * Dv + d0 + d];
        for (int64_t j = 0; j < n; j++) {
            const float *vj = vt + j * v_slot + d0;
            for (int64_t g = 0; g < G; g++) {
                float w = p[g * TILE + j];
                for (int64_t d = 0; d < CHUNK; d++) a[g][d] += w * vj[d];
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t d = 0; d < CHUNK; d++) acc[g * Dv + d0 + d] = a[g][d];
    }
    for (; d0 < Dv; d0++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < G; g++)
                acc[g * Dv + d0] += p[g * TILE + j] * vt[j * v_slot + d0];
}

/* Attends the G query heads of q over positions low <= pos < end, leaving the unnormalised
 * output in acc [G, Dv], the running maximum in top [G] and the sum of exp(score - top) in
 * sum [G] (0 where the range is empty). */
static void attend_range(const float *q, const float *k, const float *v, const int64_t *table,
                         int64_t low, int64_t end, int64_t G, int64_t D, int64_t Dv,
                         int64_t block_size, int64_t k_slot, int64_t v_slot, float scale,
                         float softcap, float *work, float *acc, float *top, float *sum) {
    float *qs = work;                   /* [G, D] scaled queries */
    float *p = qs + G * D;              /* [G, TILE] tile scores, then weights */
    for (int64_t i = 0; i < G * D; i++) qs[i] = q[i] * scale;
    for (int64_t i = 0; i < G * Dv; i++) acc[i] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        top[g] = -INFINITY;
        sum[g] = 0.0f;
    }
    int64_t pos = low;
    while (pos < end) {
        int64_t offset = pos % block_size;
        int64_t n = block_size - offset;
        if (n > end - pos) n = end - pos;
        if (n > TILE) n = TILE;
        int64_t slot = table[pos / block_size] * block_size + offset;
        const float *kt = k + slot * k_slot;
        const float *vt = v + slot * v_slot;
        int64_t next = pos + n;
        if (next < end) {
            int64_t next_offset = next % block_size, m = block_size - next_offset;
            if (m > end - next) m = end - next;
            if (m > TILE) m = TILE;
            const float *kn = k + (table[next / block_size] * block_size + next_offset) * k_slot;
            const float *vn = v + (table[next / block_size] * block_size + next_offset) * v_slot;
            for (int64_t j = 0; j < m; j++) {
                for (int64_t d = 0; d < D; d += 16)
                    __builtin_prefetch(kn + j * k_slot + d, 0, 3);
                for (int64_t d = 0; d < Dv; d += 16)
                    __builtin_prefetch(vn + j * v_slot + d, 0, 3);
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            float *pg = p + g * TILE;
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) dot4(qg, kt + j * k_slot, k_slot, D, pg + j);
            for (; j < n; j++) {
                const float *kj = kt + j * k_slot;
                float s = 0.0f;
                for (int64_t d = 0; d < D; d++) s += qg[d] * kj[d];
                pg[j] = s;
            }
        }
        if (softcap > 0.0f)
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < n; j++)
                    p[g * TILE + j] = softcap * tanhf(p[g * TILE + j] / softcap);
        for (int64_t g = 0; g < G; g++) {
            float *pg = p + g * TILE;
            float m = top[g];
            for (int64_t j = 0; j < n; j++) m = pg[j] > m ? pg[j] : m;
            float rescale = expf(top[g] - m);
            float total = sum[g] * rescale;
            for (int64_t j = 0; j < n; j++) {
                pg[j] = expf(pg[j] - m);
                total += pg[j];
            }
            top[g] = m;
            sum[g] = total;
            if (rescale != 1.0f) {
                float *ag = acc + g * Dv;
                for (int64_t d = 0; d < Dv; d++) ag[d] *= rescale;
            }
        }
        switch (G) {
        case 1: values_tile(vt, v_slot, n, p, 1, Dv, acc); break;
        case 2: values_tile(vt, v_slot, n, p, 2, Dv, acc); break;
        case 4: values_tile(vt, v_slot, n, p, 4, Dv, acc); break;
        case 8: values_tile(vt, v_slot, n, p, 8, Dv, acc); break;
        default:
            for (int64_t j = 0; j < n; j++) {
                const float *vj = vt + j * v_slot;
                for (int64_t g = 0; g < G; g++) {
                    float w = p[g * TILE + j];
                    float *ag = acc + g * Dv;
                    for (int64_t d = 0; d < Dv; d++) ag[d] += w * vj[d];
                }
            }
        }
        pos += n;
    }
}

/* q [B, H, D] and out [B, H, Dv] contiguous; k/v rows at slot * k_slot + head * k_head (the
 * last dimension contiguous); tables [B, W] block ids; request b attends to positions
 * lows[b] <= pos < ends[b]. softcap <= 0: none. order [B]: the requests, longest first; job i
 * is request order[i / KVH] with KV head i % KVH.
 * Returns 0, or 1 where a thread could not allocate its working memory (out is then partial). */
int paged_decode_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                      const int64_t *lows, const int64_t *ends, const int64_t *order, float *out,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t Dv, int64_t W,
                      int64_t block_size, int64_t k_slot, int64_t k_head, int64_t v_slot,
                      int64_t v_head, float scale, float softcap, int threads) {
    int64_t G = H / KVH;
    int64_t jobs = B * KVH;
    if (threads < 1) threads = 1;
    /* Parts per job: one, unless there are fewer jobs than threads and the longest job
     * (order[0]) has positions enough for more. */
    int64_t parts = 1;
    if (jobs < threads && jobs > 0) {
        int64_t longest = ends[order[0]] - lows[order[0]];
        parts = (threads + jobs - 1) / jobs;
        if (parts > longest / MIN_PART) parts = longest / MIN_PART > 1 ? longest / MIN_PART : 1;
    }
    int64_t items = jobs * parts;
    if (threads > items) threads = (int)items;
    /* Each item's partial result: acc [G, Dv], top [G], sum [G]. */
    int64_t part_size = G * Dv + 2 * G;
    float *partial = malloc(sizeof(float) * (size_t)(items * part_size));
    if (partial == NULL) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *work = malloc(sizeof(float) * (size_t)(G * D + G * TILE));
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (work == NULL) continue;
            int64_t job = i / parts, part = i % parts;
            int64_t b = order[job / KVH], h = job % KVH;
            int64_t low = lows[b], span = ends[b] - lows[b];
            int64_t from = low + span * part / parts, to = low + span * (part + 1) / parts;
            float *acc = partial + i * part_size;
            attend_range(q + (b * H + h * G) * D, k + h * k_head, v + h * v_head,
                         tables + b * W, from, to, G, D, Dv, block_size, k_slot, v_slot, scale,
                         softcap, work, acc, acc + G * Dv, acc + G * Dv + G);
        }
        free(work);
        /* Merge each job's parts: out = sum_p acc_p * exp(top_p - M) / sum_p sum_p * exp(...). */
#pragma omp for schedule(static)
        for (int64_t job = 0; job < jobs; job++) {
            int64_t b = order[job / KVH], h = job % KVH;
            float *o = out + (b * H + h * G) * Dv;
            for (int64_t g = 0; g < G; g++) {
                float m = -INFINITY, total = 0.0f;
                for (int64_t part = 0; part < parts; part++) {
                    const float *r = partial + (job * parts + part) * part_size;
                    if (r[G * Dv + G + g] > 0.0f && r[G * Dv + g] > m) m = r[G * Dv + g];
                }
                for (int64_t d = 0; d < Dv; d++) o[g * Dv + d] = 0.0f;
                for (int64_t part = 0; part < parts; part++) {
                    const float *r = partial + (job * parts + part) * part_size;
                    float s = r[G * Dv + G + g];
                    if (!(s > 0.0f)) continue; /* an empty part */
                    float w = expf(r[G * Dv + g] - m);
                    total += s * w;
                    for (int64_t d = 0; d < Dv; d++) o[g * Dv + d] += r[g * Dv + d] * w;
                }
                float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t d = 0; d < Dv; d++) o[g * Dv + d] *= inv;
            }
        }
    }
    free(partial);
    return failed;
}
