/* Row-wise float32 operations on the CPU, one call each instead of a chain of torch operators:
 * the RMS norm (Llama's `x * w`, Gemma's `x * (1 + w)`) and greedy sampling's argmax with its
 * finiteness check, in one pass over the logits.
 *
 * Compiled and loaded at run time with the paged decode kernel by cpu_kernels.py.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

/* Rows run on OpenMP threads only when there is this much work (below it the threads' start
 * costs more than the row). */
#define PARALLEL_ELEMENTS 65536

static void norm_row(const float *x, const float *w, int offset, float eps, int64_t dim,
                     float *out) {
    float squares = 0.0f;
    for (int64_t d = 0; d < dim; d++) squares += x[d] * x[d];
    float r = 1.0f / sqrtf(squares / (float)dim + eps);
    if (offset)
        for (int64_t d = 0; d < dim; d++) out[d] = x[d] * r * (1.0f + w[d]);
    else
        for (int64_t d = 0; d < dim; d++) out[d] = x[d] * r * w[d];
}

/* out[i] = x[i] / rms(x[i]) * w (offset: * (1 + w)) for rows i; x and out [rows, dim]
 * contiguous (out may be x). */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps, int offset, int threads) {
    if (threads < 1) threads = 1;
    int parallel = threads > 1 && rows > 1 && rows * dim >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel)
    for (int64_t i = 0; i < rows; i++) norm_row(x + i * dim, w, offset, eps, dim, out + i * dim);
}

/* Whether v is an infinity or a NaN: its exponent bits all set (read from the bits, which
 * -ffast-math cannot assume away). */
static inline int non_finite(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (bits & 0x7f800000u) == 0x7f800000u;
}

/* For each row of logits [rows, vocab] (contiguous): the index of its largest value (the first
 * of tied maxima) into index[i], and clean[i] = 1 when every value is finite. A row with an
 * infinity or a NaN gets clean[i] = 0 and an unspecified index: the caller decides those rows
 * another way. */
void greedy_rows_f32(const float *logits, int64_t rows, int64_t vocab, int64_t *index,
                     uint8_t *clean, int threads) {
    if (threads < 1) threads = 1;
    int parallel = threads > 1 && rows > 1 && rows * vocab >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel)
    for (int64_t i = 0; i < rows; i++) {
        const float *row = logits + i * vocab;
        float top = row[0];
        int bad = 0;
        for (int64_t j = 0; j < vocab; j++) {
            top = row[j] > top ? row[j] : top;
            bad |= non_finite(row[j]);
        }
        int64_t at = 0;
        if (!bad)
            while (at < vocab && row[at] != top) at++;
        index[i] = at < vocab ? at : 0;
        clean[i] = (uint8_t)!bad;
    }
}

/* The gated MLP's activation and product in one pass over a fused gate/up projection:
 * out[i, j] = act(y[i, j]) * y[i, inter + j] for y [rows, 2 * inter] and out [rows, inter]
 * (both contiguous). kind 0: GELU, tanh approximation (Gemma's gelu_pytorch_tanh); 1: SiLU. */
void act_mul_f32(const float *y, float *out, int64_t rows, int64_t inter, int kind,
                 int threads) {
    if (threads < 1) threads = 1;
    int parallel = threads > 1 && rows * inter >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel)
    for (int64_t i = 0; i < rows; i++) {
        const float *g = y + i * 2 * inter, *u = g + inter;
        float *o = out + i * inter;
        if (kind == 0) {
            for (int64_t j = 0; j < inter; j++) {
                float x = g[j];
                float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
                o[j] = 0.5f * x * (1.0f + t) * u[j];
            }
        } else {
            for (int64_t j = 0; j < inter; j++) {
                float x = g[j];
                o[j] = x / (1.0f + expf(-x)) * u[j];
            }
        }
    }
}

/* One decode token of the Mamba2 SSM for `batch` requests whose states `[heads, head_dim,
 * state_size]` lie at separate addresses (`states[i]`, the cache's own slots): per state row,
 * s = decay * s + xdt[p] * b, then y[p] = s . c, in one pass (the torch form reads the state
 * three times: the decay, the write, the read-out). Head h reads group h / (heads / groups) of
 * b and c `[batch, groups, state_size]`; decay `[batch, heads]`, xdt and y `[batch, heads,
 * head_dim]`. One job per (request, head). */
void ssm_step_f32(const int64_t *states, const float *decay, const float *xdt, const float *b,
                  const float *c, float *y, int64_t batch, int64_t heads, int64_t head_dim,
                  int64_t state_size, int64_t groups, int threads) {
    if (threads < 1) threads = 1;
    const int64_t ratio = heads / groups, jobs = batch * heads;
    int parallel = threads > 1 && jobs > 1 && jobs * head_dim * state_size >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t i = job / heads, h = job % heads, g = h / ratio;
        float *s = (float *)(intptr_t)states[i] + h * head_dim * state_size;
        const float d = decay[job];
        const float *bg = b + (i * groups + g) * state_size;
        const float *cg = c + (i * groups + g) * state_size;
        const float *w = xdt + job * head_dim;
        float *out = y + job * head_dim;
        for (int64_t p = 0; p < head_dim; p++) {
            float *row = s + p * state_size;
            const float wp = w[p];
            float acc = 0.0f;
            for (int64_t n = 0; n < state_size; n++) {
                const float v = row[n] * d + wp * bg[n];
                row[n] = v;
                acc += v * cg[n];
            }
            out[p] = acc;
        }
    }
}

/* One decode token of a depthwise causal conv1d of width `width` for `batch` requests whose
 * conv states `[channels, width - 1]` lie at separate addresses (`states[i]`, the cache's own
 * slots): over the window (the state, then x[i, c]), out[i, c] = act(bias[c] + sum_k
 * window[k] w[c, k]) (act: SiLU when `silu`, else none), and the state shifts by one token in
 * place. x `[batch, channels]` with rows `x_stride` apart, w `[channels, width]`, bias (NULL:
 * none) `[channels]`, out `[batch, channels]` contiguous. */
void conv_step_f32(const int64_t *states, const float *x, const float *w, const float *bias,
                   float *out, int64_t batch, int64_t channels, int64_t width, int64_t x_stride,
                   int silu, int threads) {
    if (threads < 1) threads = 1;
    const int64_t keep = width - 1;
    int parallel = threads > 1 && batch * channels * width >= PARALLEL_ELEMENTS;
#pragma omp parallel for num_threads(threads) if (parallel) schedule(static)
    for (int64_t i = 0; i < batch; i++) {
        float *state = (float *)(intptr_t)states[i];
        const float *xi = x + i * x_stride;
        float *o = out + i * channels;
        for (int64_t c = 0; c < channels; c++) {
            float *s = state + c * keep;
            const float *wc = w + c * width;
            const float xc = xi[c];
            float acc = bias ? bias[c] : 0.0f;
            for (int64_t k = 0; k < keep; k++) acc += s[k] * wc[k];
            acc += xc * wc[keep];
            for (int64_t k = 0; k + 1 < keep; k++) s[k] = s[k + 1];
            if (keep > 0) s[keep - 1] = xc;
            o[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
        }
    }
}
