/* What flashllm's native kernels share (kernels.c over float16/bfloat16/float32 weights, kernels_quant.c over
 * int8/int4 quantized parts, built into one library): the dtype and activation codes, scalar conversions, the
 * thread pool's interface (kernels_pool.c), and the sparse FFN's job and per-row hidden value. */
#ifndef FLASHLLM_KERNELS_H
#define FLASHLLM_KERNELS_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define FL_AVX2 1
#else
#define FL_AVX2 0
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { ACT_RELU = 0, ACT_RELU2 = 1, ACT_FATRELU = 2, ACT_SILU = 3, ACT_GELU = 4, ACT_GELU_TANH = 5 };

/* ---- scalar conversions (IEEE half and bfloat16, round to nearest even) ---- */
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float h2f(uint16_t h) {
#if FL_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000 | (man << 13));
    if (exp == 0) {  /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

static inline uint16_t f2h(float f) {
#if FL_AVX2
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000;
    uint32_t au = u & 0x7fffffff;
    if (au >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (au > 0x7f800000 ? 0x200 : 0));
    if (au >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* rounds to >= 65520: infinity */
    if (au < 0x38800000) {  /* below the smallest normal half: a subnormal, exact rounding via float add */
        float r = bits_f32(au) + 0.5f;  /* 0.5 = 2^-1: the ulp of [0.5, 1) is 2^-24, the half subnormal step */
        return (uint16_t)(sign | (f32_bits(r) - 0x3f000000));
    }
    uint32_t odd = (au >> 13) & 1;
    au += 0xc8000fff + odd;  /* rebias the exponent (-112 << 23) and round to nearest even */
    return (uint16_t)(sign | (au >> 13));
#endif
}

static inline float b2f(uint16_t b) { return bits_f32((uint32_t)b << 16); }

static inline uint16_t f2b(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float load1(int dt, const void *p, int64_t i) {
    if (dt == DT_F16) return h2f(((const uint16_t *)p)[i]);
    if (dt == DT_BF16) return b2f(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store1(int dt, void *p, int64_t i, float v) {
    if (dt == DT_F16) ((uint16_t *)p)[i] = f2h(v);
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f2b(v);
    else ((float *)p)[i] = v;
}

/* v rounded to the compute dtype (what torch's float16/bfloat16 ops return), as a float */
static inline float round_to(int dt, float v) {
    if (dt == DT_F16) return h2f(f2h(v));
    if (dt == DT_BF16) return b2f(f2b(v));
    return v;
}

#if FL_AVX2
/* the sum of v's eight lanes */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ---- the thread pool (kernels_pool.c) ---- */
typedef void (*chunk_fn)(void *arg, int64_t chunk, int slot);  /* slot 0: the caller; k: worker k */

#define MAX_THREADS 64

/* fn(arg, c, slot) for every chunk c < chunks, on up to `threads` threads; returns when all are done */
__attribute__((visibility("hidden"))) void run_chunks(chunk_fn fn, void *arg, int64_t chunks, int threads);

/* x [n] of dtype dt as a new float32 array, or NULL when out of memory */
static inline float *as_f32(int dt, const void *x, int64_t n) {
    float *xf = malloc((size_t)n * sizeof(float) + 64);
    if (xf)
        for (int64_t i = 0; i < n; i++) xf[i] = load1(dt, x, i);
    return xf;
}

#define MATVEC_CHUNK 64  /* a mat-vec's output rows per chunk, at least (kernels.c) */

/* ---- the sparse FFN over bundle rows: the float and quantized kernels' job and a row's hidden value ---- */
typedef struct {
    int dt;
    const void *up, *gate, *down;  /* part r of row r at part + r * ld (elements); gate NULL: gate_pre or none */
    int64_t ld, d;
    const int64_t *index;          /* rows to compute (NULL: 0..n-1) */
    int64_t n;
    const float *x;
    const void *up_bias, *gate_bias, *gate_pre;  /* per row (indexed by row), dtype dt, or NULL */
    int act, gated, has_threshold;
    float act_param, threshold;
    float *acc;                    /* [d]: the groups' sums are added to it, in group order */
    float *scratch;                /* [groups, d]: each group's own sum */
    int64_t per;                   /* rows per group (ffn_group_rows) */
    const void *xr;                /* x as passed, of dtype dt (the float kernels' dots; x: the quantized ones' float32 copy) */
} ffn_job;

static inline float activate(int act, float v, float param) {
    switch (act) {
    case ACT_RELU: return v > 0.0f ? v : 0.0f;
    case ACT_RELU2: return v > 0.0f ? v * v : 0.0f;
    case ACT_FATRELU: return v > param ? v : 0.0f;
    case ACT_SILU: return v / (1.0f + expf(-v));
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    default: return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    }
}

/* h of row r: what torch computes, the projections rounded to the compute dtype (bias added first), the
 * activation and its product rounded again; only the down sum stays float32 */
static inline float hidden_of(const ffn_job *j, int64_t r, float up_dot, float gate_dot) {
    int dt = j->dt;
    float u = round_to(dt, up_dot + (j->up_bias ? load1(dt, j->up_bias, r) : 0.0f)), g = u;
    if (j->gate_pre) g = load1(dt, j->gate_pre, r);
    else if (j->gate) g = round_to(dt, gate_dot + (j->gate_bias ? load1(dt, j->gate_bias, r) : 0.0f));
    float a = round_to(dt, activate(j->act, g, j->act_param));
    if (j->has_threshold && !(fabsf(a) > j->threshold)) a = 0.0f;
    return j->gated ? round_to(dt, a * u) : a;
}

#define FFN_CHUNK 16  /* a call of fewer than 2 FFN_CHUNK rows runs on one thread */

/* The sparse FFN's rows are summed in at most FFN_GROUPS groups of consecutive rows, each into its own float32 sum,
 * and the groups' sums are added to acc in group order: threads take groups as they come free (a thread the machine
 * is slow to run leaves its share to the others), and the result is the same bits whichever thread took which
 * group, at any thread count. (Per-thread sums made the last bits vary run to run at 2 threads.) */
#define FFN_GROUPS 16

/* rows per group for n rows: even (rows are taken in pairs), at least 2 */
static inline int64_t ffn_group_rows(int64_t n) {
    int64_t per = (n + FFN_GROUPS - 1) / FFN_GROUPS;
    per += per & 1;
    return per > 2 ? per : 2;
}

/* the groups' sums (scratch [groups, d]) added to acc [d] in group order */
static inline void ffn_add_groups(float *acc, const float *scratch, int64_t groups, int64_t d) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = 0; i < d; i++) acc[i] += scratch[g * d + i];
}

/* The FFN's output from its float32 sum, as TorchBackend.ffn_result makes it: y [d] = acc rounded to dt, plus
 * down_bias (NULL: none) rounded again as torch's add rounds; in the kernel call, so that the token makes no torch op
 * for it (each cost 30-90 us on the caches the weight streams had just flushed) */
static inline void ffn_out(int dt, const float *acc, const void *down_bias, void *y, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        float v = round_to(dt, acc[i]);
        store1(dt, y, i, down_bias ? v + load1(dt, down_bias, i) : v);
    }
}

#endif
