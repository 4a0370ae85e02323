/* A float32 linear of a few rows (a decode batch) on AVX-512: y = x w^T (+ bias), x [rows, in],
 * w [out, in] in its plain row-major layout, y [rows, out]; every row of x and every row of w
 * contiguous.
 *
 * At a decode batch's row counts a linear is bound by reading its weight from memory, and the
 * libraries' kernels read it well below the bound on the Intel Xeon host (see layers/packed.py:
 * oneDNN's packed copy at 8 rows 12-15 GB/s on the hybrid's projections, MKL's plain one slower
 * still from 4 rows). Here each thread streams its own tiles of NT weight rows once, with a
 * software prefetch PREFETCH floats ahead, and multiplies each 16-float slice with up to MB rows
 * of x (held in L1/L2) into MB x NT vector accumulators, which are summed across lanes at the
 * end of the tile by one transpose-and-add tree per 16 of them. More rows than MB run as
 * further blocks over the same tile (already in cache).
 *
 * Compiled and loaded at run time with the other kernels by cpu_kernels.py. Without AVX-512
 * the entry point does nothing and returns 0 (the caller takes its torch form).
 */
#include <stdint.h>

/* Weights run on OpenMP threads only when there is this much of them. */
#define PARALLEL_WEIGHT 65536

#if defined(__AVX512F__)
#include <immintrin.h>

#define NT 4          /* weight rows per tile */
#define MB 8          /* rows of x per block */
#define TILES 16      /* tiles per OpenMP chunk */
#define PREFETCH 4096 /* floats ahead of the slice read (16 KiB) */

/* y[m, n0 + j] = x[m] . w[n0 + j] (+ bias[n0 + j]) for m < mm <= MB and j < nt <= NT. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w,
                                                       const float *bias, float *y, int mm,
                                                       int64_t in, int64_t out, int64_t n0,
                                                       int nt) {
    __m512 acc[MB][NT];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();
    const float *w0 = w + n0 * in;
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) {
        __m512 wv[NT];
#pragma GCC unroll 4
        for (int j = 0; j < nt; j++) {
            wv[j] = _mm512_loadu_ps(w0 + j * in + k);
            _mm_prefetch((const char *)(w0 + j * in + k + PREFETCH), _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int m = 0; m < mm; m++) {
            const __m512 xv = _mm512_loadu_ps(x + m * in + k);
#pragma GCC unroll 4
            for (int j = 0; j < nt; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    if (k < in) { /* the last in % 16 columns, masked */
        const __mmask16 mask = (__mmask16)((1u << (in - k)) - 1u);
        __m512 wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w0 + j * in + k);
        for (int m = 0; m < mm; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * in + k);
            for (int j = 0; j < nt; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
        }
    }
    /* Sixteen accumulators (4 rows x 4 weight rows) at a time into one vector of their sums,
     * lane group r (4 floats) holding row r's: pairs interleaved and added within 128-bit lanes,
     * then 64-bit pairs, then the lanes across. Unused accumulators are zero. */
    for (int g = 0; g < mm; g += 4) {
        __m512 s[8], q[4], r[2];
#pragma GCC unroll 8
        for (int p = 0; p < 8; p++) {
            const __m512 a = acc[g + p / 2][(p % 2) * 2], b = acc[g + p / 2][(p % 2) * 2 + 1];
            s[p] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const __m512d a = _mm512_castps_pd(s[2 * p]), b = _mm512_castps_pd(s[2 * p + 1]);
            q[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        }
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++)
            r[p] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * p], q[2 * p + 1], 0x88),
                                 _mm512_shuffle_f32x4(q[2 * p], q[2 * p + 1], 0xDD));
        float sums[16];
        _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88),
                                             _mm512_shuffle_f32x4(r[0], r[1], 0xDD)));
        for (int m = g; m < mm && m < g + 4; m++)
            for (int j = 0; j < nt; j++)
                y[m * out + n0 + j] = sums[(m - g) * 4 + j] + (bias ? bias[n0 + j] : 0.0f);
    }
}

/* One block of rows against one tile, the row count and tile width made constants. */
#define ROWS_CASES(NTV)                                                     \
    switch (mm) {                                                           \
    case 1: tile(xb, w, bias, yb, 1, in, out, n0, NTV); break;              \
    case 2: tile(xb, w, bias, yb, 2, in, out, n0, NTV); break;              \
    case 3: tile(xb, w, bias, yb, 3, in, out, n0, NTV); break;              \
    case 4: tile(xb, w, bias, yb, 4, in, out, n0, NTV); break;              \
    case 5: tile(xb, w, bias, yb, 5, in, out, n0, NTV); break;              \
    case 6: tile(xb, w, bias, yb, 6, in, out, n0, NTV); break;              \
    case 7: tile(xb, w, bias, yb, 7, in, out, n0, NTV); break;              \
    default: tile(xb, w, bias, yb, MB, in, out, n0, NTV); break;            \
    }

int few_rows_linear_f32(const float *x, const float *w, const float *bias, float *y,
                        int64_t rows, int64_t in, int64_t out, int threads) {
    if (threads < 1) threads = 1;
    const int64_t tiles = (out + NT - 1) / NT, chunks = (tiles + TILES - 1) / TILES;
    int parallel = threads > 1 && chunks > 1 && out * in >= PARALLEL_WEIGHT;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t last = (c + 1) * TILES < tiles ? (c + 1) * TILES : tiles;
        for (int64_t t = c * TILES; t < last; t++) {
            const int64_t n0 = t * NT;
            const int nt = out - n0 < NT ? (int)(out - n0) : NT;
            for (int64_t mb = 0; mb < rows; mb += MB) {
                const int mm = rows - mb < MB ? (int)(rows - mb) : MB;
                const float *xb = x + mb * in;
                float *yb = y + mb * out;
                if (nt == NT) {
                    ROWS_CASES(NT)
                } else if (nt == 3) {
                    ROWS_CASES(3)
                } else if (nt == 2) {
                    ROWS_CASES(2)
                } else {
                    ROWS_CASES(1)
                }
            }
        }
    }
    return 1;
}

#else

int few_rows_linear_f32(const float *x, const float *w, const float *bias, float *y,
                        int64_t rows, int64_t in, int64_t out, int threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)rows, (void)in, (void)out, (void)threads;
    return 0;
}

#endif

/* Whether few_rows_linear_f32 computes anything in this build (AVX-512). */
int few_rows_linear_built(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
