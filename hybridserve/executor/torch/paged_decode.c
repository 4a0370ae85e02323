/* Paged decode attention on the CPU, float32: each decode's query heads attend over its
 * request's keys read in place from the paged cache, with no gather into a contiguous copy.
 *
 * One job per (request, KV head): the G query heads of that KV head attend together, so each
 * key and value row is read once for all of them. Keys are taken in tiles that never cross a
 * block (slots within a block are consecutive: no division per key) and the softmax is online
 * (a running maximum and sum per head, the output rescaled when the maximum grows). Jobs run on
 * OpenMP threads, largest first.
 *
 * Compiled and loaded at run time by paged_kernel.py; the layouts it reads are described there.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16

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

static void attend_job(const float *q, const float *k, const float *v, const int64_t *table,
                       int64_t low, int64_t end, float *out, int64_t G, int64_t D, int64_t Dv,
                       int64_t block_size, int64_t k_slot, int64_t v_slot, float scale,
                       float softcap, float *work) {
    float *qs = work;                   /* [G, D] scaled queries */
    float *acc = qs + G * D;            /* [G, Dv] unnormalised output */
    float *top = acc + G * Dv;          /* [G] running maximum */
    float *sum = top + G;               /* [G] running sum of exp(score - top) */
    float *p = sum + G;                 /* [G, TILE] tile scores, then weights */
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
            if (softcap > 0.0f)
                for (j = 0; j < n; j++) pg[j] = softcap * tanhf(pg[j] / softcap);
        }
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
        for (int64_t j = 0; j < n; j++) {
            const float *vj = vt + j * v_slot;
            for (int64_t g = 0; g < G; g++) {
                float w = p[g * TILE + j];
                float *ag = acc + g * Dv;
                for (int64_t d = 0; d < Dv; d++) ag[d] += w * vj[d];
            }
        }
        pos += n;
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = sum[g] > 0.0f ? 1.0f / sum[g] : 0.0f;
        for (int64_t d = 0; d < Dv; d++) out[g * Dv + d] = acc[g * Dv + d] * inv;
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
    if (threads > jobs) threads = (int)jobs;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *work = malloc(sizeof(float) * (size_t)(G * D + G * Dv + 2 * G + G * TILE));
        if (work == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < jobs; i++) {
            if (work == NULL) continue;
            int64_t b = order[i / KVH], h = i % KVH;
            attend_job(q + (b * H + h * G) * D, k + h * k_head, v + h * v_head, tables + b * W,
                       lows[b], ends[b], out + (b * H + h * G) * Dv, G, D, Dv, block_size,
                       k_slot, v_slot, scale, softcap, work);
        }
        free(work);
    }
    return failed;
}
