/* flashllm's expert FFN with int8 activations: several experts of one MoE layer (each with its tokens and router
 * weights) in one call, over their quantized rows as stored (kernels_qdot.h's formats and row dot product); and the
 * machine's streaming-read bandwidth, which the kernel table (bench/compute/qkernels.py) sets them beside. */
#include "kernels_qdot.h"

/* ---- experts: several experts' FFN in one call ---- */
typedef struct {
    qrow qin, qdown;
    int64_t n, d, f, T;
    const int64_t *ptrs;      /* [n, 3]: gate (0: not gated), up, down addresses of each item's expert */
    const int64_t *start;     /* [n + 1]: item i's (token, weight) pairs are start[i]..start[i+1] */
    const int64_t *tokens;
    const float *weights;
    int64_t ld_in, ld_down;
    const qx *x, *hq;         /* per token; per pair */
    float *h;                 /* [pairs, f] */
    int dt, act;
    float act_param;
    float *acc;               /* [T, d] */
} experts_job;

static void experts_up(void *p, int64_t c, int slot) {  /* chunk c: an item's rows */
    (void)slot;
    experts_job *j = p;
    int64_t per = (j->f + ROW_CHUNK - 1) / ROW_CHUNK, i = c / per, lo = (c % per) * ROW_CHUNK;
    int64_t hi = lo + ROW_CHUNK < j->f ? lo + ROW_CHUNK : j->f;
    const uint8_t *gate = (const uint8_t *)(intptr_t)j->ptrs[3 * i], *up = (const uint8_t *)(intptr_t)j->ptrs[3 * i + 1];
    for (int64_t r = lo; r < hi; r++)
        for (int64_t k = j->start[i]; k < j->start[i + 1]; k++) {
            const qx *x = j->x + j->tokens[k];
            float u = round_to(j->dt, row_dot(&j->qin, up + r * j->ld_in, x)), a;
            if (gate) {
                float g = round_to(j->dt, row_dot(&j->qin, gate + r * j->ld_in, x));
                a = round_to(j->dt, round_to(j->dt, activate(j->act, g, j->act_param)) * u);
            } else {
                a = round_to(j->dt, activate(j->act, u, j->act_param));
            }
            j->h[k * j->f + r] = a;
        }
}

static void experts_down(void *p, int64_t c, int slot) {  /* chunk c: output rows, every item in order */
    (void)slot;
    experts_job *j = p;
    int64_t lo = c * ROW_CHUNK, hi = lo + ROW_CHUNK < j->d ? lo + ROW_CHUNK : j->d;
    for (int64_t o = lo; o < hi; o++)
        for (int64_t i = 0; i < j->n; i++) {
            const uint8_t *down = (const uint8_t *)(intptr_t)j->ptrs[3 * i + 2] + o * j->ld_down;
            for (int64_t k = j->start[i]; k < j->start[i + 1]; k++)
                j->acc[j->tokens[k] * j->d + o] += j->weights[k] * round_to(j->dt, row_dot(&j->qdown, down, j->hq + k));
        }
}

/* acc [T, d] (float32) += sum over items i and their pairs k of weights[k] * round(expert_i(x[tokens[k]])): an expert's
 * up (and gate) rows [f, d] and down rows (W_down [d, f]) quantized as flashllm/format/quant.py's parts (row
 * strides ld_in, ld_down bytes; groups along each row's d or f values), h = act(gate) * up (or act(up)) rounded to
 * dt as torch rounds it; x [T, d] of dtype dt. Returns 0, -1 when out of memory, -2 for a row format it does not take. */
int fl_experts(int bits, int sym, int64_t group, int64_t n, const int64_t *ptrs, const int64_t *start,
                const int64_t *tokens, const float *weights, int64_t d, int64_t f, int64_t ld_in, int64_t ld_down,
                int dt, int64_t T, const void *x, int act, float act_param, float *acc, int threads) {
    if (!qdot_fits(bits, group, d) || !qdot_fits(bits, group, f)) return -2;
    int64_t pairs = start[n], slots = pairs > 0 ? pairs : 1, each = qx_bytes(f, group);
    void *xmem = NULL;
    qx *xs = quantize_all(dt, x, T, d, group, bits, &xmem), *hv = malloc((size_t)slots * sizeof(qx));
    float *h = malloc((size_t)slots * (size_t)f * sizeof(float));
    uint8_t *hm = malloc((size_t)slots * (size_t)each);
    if (!xs || !h || !hm || !hv) {
        free(xmem), free(xs), free(h), free(hm), free(hv);
        return -1;
    }
    experts_job j = {qrow_of(bits, sym, group, d), qrow_of(bits, sym, group, f), n, d, f, T, ptrs, start, tokens,
                     weights, ld_in, ld_down, xs, hv, h, dt, act, act_param, acc};
    run_chunks(experts_up, &j, n * ((f + ROW_CHUNK - 1) / ROW_CHUNK), threads);
    for (int64_t k = 0; k < pairs; k++) {
        qx_place(hv + k, hm + k * each, f, group);
        quantize_x(h + k * f, f, group, bits, hv + k);
    }
    run_chunks(experts_down, &j, (d + ROW_CHUNK - 1) / ROW_CHUNK, threads);
    free(xmem), free(xs), free(h), free(hm), free(hv);
    return 0;
}

/* ---- the machine's streaming-read bandwidth, for the kernel table: one pass over n bytes ---- */
typedef struct {
    const uint8_t *p;
    int64_t n;
    uint64_t sums[MAX_THREADS];
} stream_job;

#define STREAM_CHUNK (1 << 20)

static void stream_chunk(void *arg, int64_t c, int slot) {
    stream_job *j = arg;
    int64_t lo = c * STREAM_CHUNK, hi = lo + STREAM_CHUNK < j->n ? lo + STREAM_CHUNK : j->n;
    uint64_t s = 0;
#if FL_AVX2
    __m256i a = _mm256_setzero_si256(), b = a;
    for (; lo + 64 <= hi; lo += 64) {
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(j->p + lo)));
        b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i *)(j->p + lo + 32)));
    }
    uint64_t t[4];
    _mm256_storeu_si256((__m256i *)t, _mm256_xor_si256(a, b));
    s = t[0] ^ t[1] ^ t[2] ^ t[3];
#endif
    for (; lo + 8 <= hi; lo += 8) {
        uint64_t v;
        memcpy(&v, j->p + lo, 8);
        s ^= v;
    }
    j->sums[slot] ^= s;
}

/* reads p[0..n) once on `threads` threads; returns a value that depends on every byte (so no read is skipped) */
uint64_t fl_stream_read(const uint8_t *p, int64_t n, int threads) {
    stream_job j;
    memset(&j, 0, sizeof(j));
    j.p = p, j.n = n;
    run_chunks(stream_chunk, &j, (n + STREAM_CHUNK - 1) / STREAM_CHUNK, threads);
    uint64_t s = 0;
    for (int i = 0; i < MAX_THREADS; i++) s ^= j.sums[i];
    return s;
}
