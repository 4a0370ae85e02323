/* What the chunked scans (gated_delta_chunked.c, ssd_chunked.c) share: the decay floor of
 * recurrence.py and, on AVX-512, one register-blocked product kernel that can start from a scaled
 * copy of another matrix (so that a state's decay or an output's term from the state costs no
 * pass of its own), and a row scale. Included by each; all static.
 */
#ifndef HYBRIDSERVE_CHUNK_GEMM_H
#define HYBRIDSERVE_CHUNK_GEMM_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LOG_DECAY_FLOOR (-60.0f)
/* The longest chunk the scans take (cpu_kernels.SCAN_MAX_CHUNK). */
#define MAX_CHUNK 64
/* Chunks a work item runs before the threads move on together: its heads' states stay in the
 * thread's L2 for that long (Nemotron-H's 128 Mamba2 heads of 64 x 128 are 4 MiB of state, a
 * thread's half of them more than its 2 MiB L2 on the Intel Xeon host: 95-99 ms for 4,096 tokens
 * at 8 or 16 chunks a run against 105-108 at 1; the gated delta rule measured the same at 1 and
 * 8). */
#define RUN_CHUNKS 8
static inline float decay_exp(float x) { return x < LOG_DECAY_FLOOR ? 0.0f : expf(x); }

/* Row t of a chunk's decays from the cumulative log decays `cum`: dec[s] = e^{cum_t - cum_s}
 * for s <= t (0 below the floor; the exponentials in a loop of their own, which vectorises),
 * 0 for t < s < width. */
static inline void decay_row(float *dec, const float *cum, int t, int width) {
    const float ct = cum[t];
    for (int s = 0; s <= t; s++) {
        const float diff = ct - cum[s];
        dec[s] = expf(diff > 0.0f ? 0.0f : (diff < LOG_DECAY_FLOOR ? LOG_DECAY_FLOOR : diff));
    }
    for (int s = 0; s <= t; s++)
        if (ct - cum[s] < LOG_DECAY_FLOOR) dec[s] = 0.0f;
    for (int s = t + 1; s < width; s++) dec[s] = 0.0f;
}

/* A scan's work item: heads [h0, h1) of one group (heads that share per-chunk products: a key
 * head's value heads, a Mamba2 group's heads), h0 == h1 for an empty one. With fewer groups
 * than threads each group's heads are split into `parts` ranges, so that every thread has
 * work and each item still forms its group's products once a chunk. */
typedef struct {
    int64_t group, h0, h1;
} ScanItem;

static inline int64_t scan_parts(int64_t groups, int64_t ratio, int64_t threads) {
    int64_t parts = (threads + groups - 1) / groups;
    return parts < 1 ? 1 : (parts > ratio ? ratio : parts);
}

static inline ScanItem scan_item(int64_t item, int64_t parts, int64_t ratio) {
    const int64_t group = item / parts, per = (ratio + parts - 1) / parts;
    const int64_t h0 = group * ratio + (item % parts) * per, end = (group + 1) * ratio;
    const ScanItem out = {group, h0 < end ? h0 : end, h0 + per < end ? h0 + per : end};
    return out;
}

/* Each of `count` buffers of sizes[i] floats, 64-byte aligned and zeroed, into *slots[i]; 1, or
 * 0 if one could not be allocated (the others are still set, NULL where they failed: free them
 * with scratch_release). */
static inline int scratch_alloc(float **const *slots, const size_t *sizes, int count) {
    int ok = 1;
    for (int i = 0; i < count; i++) {
        *slots[i] = aligned_alloc(64, ((sizes[i] * sizeof(float) + 63) / 64) * 64);
        if (!*slots[i]) ok = 0;
        else memset(*slots[i], 0, sizes[i] * sizeof(float));
    }
    return ok;
}

static inline void scratch_release(float **const *slots, int count) {
    for (int i = 0; i < count; i++) free(*slots[i]);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* c[i, j] = w_i init[i * ldi + j] + sum_p a[i * ar + p * ac] * b[p * ldb + j] for i < MR rows
 * (mr of them real), j < 16 * NV, with w_i = rs[i] (rs given) or us; no init: the sum alone.
 * `init` may be `c` itself. */
#define KERNEL(MR, NV)                                                                          \
    static inline __attribute__((always_inline)) void kernel_##MR##_##NV(                       \
        int mr, int k, const float *a, int64_t ar, int64_t ac, const float *b, int64_t ldb,      \
        float *c, int64_t ldc, const float *init, int64_t ldi, const float *rs, float us) {      \
        __m512 s[MR][NV];                                                                        \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                  \
            if (i < mr && init) {                                                                \
                const __m512 w = _mm512_set1_ps(rs ? rs[i] : us);                                \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                            \
                    s[i][v] = _mm512_mul_ps(w, _mm512_loadu_ps(init + i * ldi + 16 * v));        \
            } else {                                                                             \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) s[i][v] =                  \
                    _mm512_setzero_ps();                                                         \
            }                                                                                    \
        }                                                                                        \
        for (int p = 0; p < k; p++) {                                                            \
            __m512 bv[NV];                                                                       \
            _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                                \
                bv[v] = _mm512_loadu_ps(b + p * ldb + 16 * v);                                  \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                              \
                if (i < mr) {                                                                    \
                    const __m512 av = _mm512_set1_ps(a[i * ar + p * ac]);                        \
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                        \
                        s[i][v] = _mm512_fmadd_ps(av, bv[v], s[i][v]);                           \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                  \
            if (i < mr) {                                                                        \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++)                            \
                    _mm512_storeu_ps(c + i * ldc + 16 * v, s[i][v]);                             \
            }                                                                                    \
        }                                                                                        \
    }

/* Rows of the widest kernel (6 x 4 vectors: 24 accumulators, 4 loads of b and 6 broadcasts a
 * step; 4 x 4 measured the same). */
#define BIG_MR 6
KERNEL(6, 4)
KERNEL(4, 4)
KERNEL(8, 2)
KERNEL(8, 1)

/* C [m, n] = (w init +) A [m, k] B [k, n] as the kernels above: A's element (i, p) at
 * a[i * ar + p * ac], B and C row major with row strides ldb and ldc, n a multiple of 16.
 * Whole blocks of 4 rows call the kernels with a constant row count (their row guards vanish);
 * the last rows take the guarded form. */
#define COLUMNS_(MR, NV)                                                                         \
    for (; j + 16 * NV <= n; j += 16 * NV) {                                                    \
        int i = 0;                                                                               \
        for (; i + MR <= m; i += MR) {                                                           \
            kernel_##MR##_##NV(MR, k, a + i * ar, ar, ac, b + j, ldb, c + i * ldc + j, ldc,      \
                               init ? init + i * ldi + j : NULL, ldi, rs ? rs + i : NULL, us);   \
        }                                                                                        \
        if (i < m)                                                                               \
            kernel_##MR##_##NV(m - i, k, a + i * ar, ar, ac, b + j, ldb, c + i * ldc + j, ldc,   \
                               init ? init + i * ldi + j : NULL, ldi, rs ? rs + i : NULL, us);   \
    }

#define COLUMNS(MR, NV) COLUMNS_(MR, NV) /* MR expanded before it is pasted */

static void gemm_init(int m, int n, int k, const float *a, int64_t ar, int64_t ac,
                      const float *b, int64_t ldb, float *c, int64_t ldc, const float *init,
                      int64_t ldi, const float *rs, float us) {
    int j = 0;
    if (m % BIG_MR && m % 4 == 0) { /* whole blocks of 4 rather than a guarded tail */
        COLUMNS(4, 4)
    } else {
        COLUMNS(BIG_MR, 4)
    }
    COLUMNS(8, 2) /* narrow products (C x C, q.k): more rows for independent accumulators */
    COLUMNS(8, 1)
}

static inline void gemm(int m, int n, int k, const float *a, int64_t ar, int64_t ac,
                        const float *b, int64_t ldb, float *c, int64_t ldc) {
    gemm_init(m, n, k, a, ar, ac, b, ldb, c, ldc, NULL, 0, NULL, 1.0f);
}

/* y[j] = x[j] * s for a row of n floats, in place when y == x (a masked tail past the last 16). */
static inline void scale_row(float *y, const float *x, float s, int n) {
    const __m512 sv = _mm512_set1_ps(s);
    int j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(y + j, _mm512_mul_ps(_mm512_loadu_ps(x + j), sv));
    if (j < n) {
        const __mmask16 mask = (__mmask16)((1u << (n - j)) - 1u);
        _mm512_mask_storeu_ps(y + j, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, x + j), sv));
    }
}

#endif /* __AVX512F__ */

#endif /* HYBRIDSERVE_CHUNK_GEMM_H */
