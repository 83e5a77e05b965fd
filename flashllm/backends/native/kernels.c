/* flashllm's native CPU kernels for one decode token: a dense mat-vec and the sparse FFN over a neuron
 * cache's bundle rows in one pass. Weights are float16, bfloat16 or float32; every product is summed in
 * float32. Threads are this file's own small pthread pool (no second OpenMP runtime beside torch's), taking
 * chunks of output rows (mat-vec) or of cache rows (FFN, each thread with its own float32 sum) from a shared
 * counter, so that a thread the machine is slow to run leaves its share to the others.
 * Built on first use by flashllm/backends/native/__init__.py with the machine's C compiler; the x86 path
 * uses AVX2 + F16C + FMA when the compiler targets them (-march=native), every other machine the portable
 * C loops below (which the compiler may vectorize). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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

/* ---- vector loops: dot(w, x) and acc += h * w, w in dt, x and acc float32 ---- */
#if FL_AVX2
static inline __m256 load8(int dt, const void *p, int64_t i) {
    if (dt == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static float dot(int dt, const void *w, const float *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if FL_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(load8(dt, w, i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load8(dt, w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(load8(dt, w, i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(load8(dt, w, i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(dt, w, i), _mm256_loadu_ps(x + i), a0);
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float part[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) part[k] += load1(dt, w, i + k) * x[i + k];
    for (int k = 0; k < 8; k++) s += part[k];
#endif
    for (; i < n; i++) s += load1(dt, w, i) * x[i];
    return s;
}

/* four rows' dot products with x, sharing each load of x (the mat-vec's inner loop) */
static void dot4(int dt, const void *w, int64_t ld, const float *x, int64_t n, float *out) {
#if FL_AVX2
    size_t es = dt == DT_F32 ? 4 : 2;
    const char *r0 = w, *r1 = r0 + ld * es, *r2 = r1 + ld * es, *r3 = r2 + ld * es;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(load8(dt, r0, i), x0, a0);
        a1 = _mm256_fmadd_ps(load8(dt, r1, i), x0, a1);
        a2 = _mm256_fmadd_ps(load8(dt, r2, i), x0, a2);
        a3 = _mm256_fmadd_ps(load8(dt, r3, i), x0, a3);
        b0 = _mm256_fmadd_ps(load8(dt, r0, i + 8), x1, b0);
        b1 = _mm256_fmadd_ps(load8(dt, r1, i + 8), x1, b1);
        b2 = _mm256_fmadd_ps(load8(dt, r2, i + 8), x1, b2);
        b3 = _mm256_fmadd_ps(load8(dt, r3, i + 8), x1, b3);
    }
    out[0] = hsum(_mm256_add_ps(a0, b0));
    out[1] = hsum(_mm256_add_ps(a1, b1));
    out[2] = hsum(_mm256_add_ps(a2, b2));
    out[3] = hsum(_mm256_add_ps(a3, b3));
    for (; i < n; i++) {
        out[0] += load1(dt, r0, i) * x[i];
        out[1] += load1(dt, r1, i) * x[i];
        out[2] += load1(dt, r2, i) * x[i];
        out[3] += load1(dt, r3, i) * x[i];
    }
#else
    size_t es = dt == DT_F32 ? 4 : 2;
    for (int k = 0; k < 4; k++) out[k] = dot(dt, (const char *)w + k * ld * es, x, n);
#endif
}

/* (a . x, b . x): two rows' dot products sharing each load of x (a row's up and gate parts) */
static void dot2(int dt, const void *a, const void *b, const float *x, int64_t n, float *out) {
    int64_t i = 0;
    float sa = 0.0f, sb = 0.0f;
#if FL_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(load8(dt, a, i), x0, a0);
        b0 = _mm256_fmadd_ps(load8(dt, b, i), x0, b0);
        a1 = _mm256_fmadd_ps(load8(dt, a, i + 8), x1, a1);
        b1 = _mm256_fmadd_ps(load8(dt, b, i + 8), x1, b1);
    }
    sa = hsum(_mm256_add_ps(a0, a1));
    sb = hsum(_mm256_add_ps(b0, b1));
#endif
    for (; i < n; i++) {
        sa += load1(dt, a, i) * x[i];
        sb += load1(dt, b, i) * x[i];
    }
    out[0] = sa;
    out[1] = sb;
}

/* w[k] . x for four rows anywhere (two cache rows' up and gate parts), sharing each load of x */
static void dot4p(int dt, const void *const *w, const float *x, int64_t n, float *out) {
    int64_t i = 0;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if FL_AVX2
    __m256 a[4][2];
    for (int k = 0; k < 4; k++) a[k][0] = a[k][1] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        for (int k = 0; k < 4; k++) {
            a[k][0] = _mm256_fmadd_ps(load8(dt, w[k], i), x0, a[k][0]);
            a[k][1] = _mm256_fmadd_ps(load8(dt, w[k], i + 8), x1, a[k][1]);
        }
    }
    for (int k = 0; k < 4; k++) s[k] = hsum(_mm256_add_ps(a[k][0], a[k][1]));
#endif
    for (; i < n; i++)
        for (int k = 0; k < 4; k++) s[k] += load1(dt, w[k], i) * x[i];
    for (int k = 0; k < 4; k++) out[k] = s[k];
}

/* acc += ha * a + hb * b: two rows' down parts in one pass over acc */
static void axpy2(int dt, float ha, const void *a, float hb, const void *b, float *acc, int64_t n) {
    int64_t i = 0;
#if FL_AVX2
    __m256 hav = _mm256_set1_ps(ha), hbv = _mm256_set1_ps(hb);
    for (; i + 16 <= n; i += 16) {
        __m256 s0 = _mm256_fmadd_ps(load8(dt, a, i), hav, _mm256_loadu_ps(acc + i));
        __m256 s1 = _mm256_fmadd_ps(load8(dt, a, i + 8), hav, _mm256_loadu_ps(acc + i + 8));
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(load8(dt, b, i), hbv, s0));
        _mm256_storeu_ps(acc + i + 8, _mm256_fmadd_ps(load8(dt, b, i + 8), hbv, s1));
    }
#endif
    for (; i < n; i++) acc[i] += ha * load1(dt, a, i) + hb * load1(dt, b, i);
}

/* acc += h[0] * w[0] + ... + h[3] * w[3]: four rows' down parts in one pass over acc */
static void axpy4(int dt, const float *h, const void *const *w, float *acc, int64_t n) {
    int64_t i = 0;
#if FL_AVX2
    __m256 h0 = _mm256_set1_ps(h[0]), h1 = _mm256_set1_ps(h[1]), h2 = _mm256_set1_ps(h[2]), h3 = _mm256_set1_ps(h[3]);
    for (; i + 16 <= n; i += 16) {
        __m256 s0 = _mm256_loadu_ps(acc + i), s1 = _mm256_loadu_ps(acc + i + 8);
        s0 = _mm256_fmadd_ps(load8(dt, w[0], i), h0, s0);
        s1 = _mm256_fmadd_ps(load8(dt, w[0], i + 8), h0, s1);
        s0 = _mm256_fmadd_ps(load8(dt, w[1], i), h1, s0);
        s1 = _mm256_fmadd_ps(load8(dt, w[1], i + 8), h1, s1);
        s0 = _mm256_fmadd_ps(load8(dt, w[2], i), h2, s0);
        s1 = _mm256_fmadd_ps(load8(dt, w[2], i + 8), h2, s1);
        s0 = _mm256_fmadd_ps(load8(dt, w[3], i), h3, s0);
        s1 = _mm256_fmadd_ps(load8(dt, w[3], i + 8), h3, s1);
        _mm256_storeu_ps(acc + i, s0);
        _mm256_storeu_ps(acc + i + 8, s1);
    }
#endif
    for (; i < n; i++)
        acc[i] += h[0] * load1(dt, w[0], i) + h[1] * load1(dt, w[1], i) + h[2] * load1(dt, w[2], i)
                  + h[3] * load1(dt, w[3], i);
}

static void axpy(int dt, float h, const void *w, float *acc, int64_t n) {
    int64_t i = 0;
#if FL_AVX2
    __m256 hv = _mm256_set1_ps(h);
    for (; i + 16 <= n; i += 16) {
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(load8(dt, w, i), hv, _mm256_loadu_ps(acc + i)));
        _mm256_storeu_ps(acc + i + 8, _mm256_fmadd_ps(load8(dt, w, i + 8), hv, _mm256_loadu_ps(acc + i + 8)));
    }
#endif
    for (; i < n; i++) acc[i] += h * load1(dt, w, i);
}

/* ---- the thread pool: a job is a count of chunks taken from a shared counter by the caller and by the
 * workers that wake while it is open; the caller never waits for a worker that has not joined (on a busy
 * machine a late worker simply finds no chunk left) ---- */
typedef void (*chunk_fn)(void *arg, int64_t chunk, int slot);  /* slot 0: the caller; k: worker k */

#define MAX_THREADS 64
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER;  /* one caller uses the workers at a time */
static pthread_cond_t pool_start = PTHREAD_COND_INITIALIZER, pool_done = PTHREAD_COND_INITIALIZER;
static int pool_workers;       /* started worker threads, slots 1..pool_workers */
static pid_t pool_pid;         /* the process the workers belong to (a forked child has none) */
static long pool_gen;          /* incremented per job */
static long start_gen[MAX_THREADS];  /* the generation a worker was started in: it waits for the next one */
static int pool_open, pool_active, pool_slots;
static chunk_fn pool_fn;
static void *pool_arg;
static int64_t pool_chunks, pool_next;  /* pool_next: the next chunk, taken atomically */

static void take_chunks(chunk_fn fn, void *arg, int64_t chunks, int slot) {
    int64_t c;
    while ((c = __atomic_fetch_add(&pool_next, 1, __ATOMIC_RELAXED)) < chunks) fn(arg, c, slot);
}

static void *worker(void *p) {
    int slot = (int)(intptr_t)p;
    pthread_mutex_lock(&pool_mu);
    long seen = start_gen[slot];
    for (;;) {
        while (pool_gen == seen) pthread_cond_wait(&pool_start, &pool_mu);
        seen = pool_gen;
        if (!pool_open || slot > pool_slots) continue;
        pool_active++;
        chunk_fn fn = pool_fn;
        void *arg = pool_arg;
        int64_t chunks = pool_chunks;
        pthread_mutex_unlock(&pool_mu);
        take_chunks(fn, arg, chunks, slot);
        pthread_mutex_lock(&pool_mu);
        if (--pool_active == 0) pthread_cond_signal(&pool_done);
    }
    return NULL;
}

/* fn(arg, c, slot) for every chunk c < chunks, on up to `threads` threads; returns when all are done */
static void run_chunks(chunk_fn fn, void *arg, int64_t chunks, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || chunks <= 1 || pthread_mutex_trylock(&pool_busy) != 0) {  /* or another caller has the pool */
        for (int64_t c = 0; c < chunks; c++) fn(arg, c, 0);
        return;
    }
    pthread_mutex_lock(&pool_mu);
    if (pool_pid != getpid()) { pool_workers = 0; pool_pid = getpid(); }  /* after fork: start afresh */
    while (pool_workers < threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[pool_workers + 1] = pool_gen;  /* the new worker joins jobs from the next one on */
        int failed = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool_workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_workers++;
    }
    pool_fn = fn;
    pool_arg = arg;
    pool_chunks = chunks;
    __atomic_store_n(&pool_next, 0, __ATOMIC_RELAXED);
    pool_slots = threads - 1;
    pool_open = 1;
    pool_gen++;
    pthread_cond_broadcast(&pool_start);
    pthread_mutex_unlock(&pool_mu);
    take_chunks(fn, arg, chunks, 0);
    pthread_mutex_lock(&pool_mu);
    pool_open = 0;  /* no worker joins from now on; wait for those inside */
    while (pool_active > 0) pthread_cond_wait(&pool_done, &pool_mu);
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_busy);
}

/* ---- dense mat-vec: y[o] = round(sum_i w[o, i] x[i] + bias[o]) ---- */
typedef struct {
    int dt;
    const void *w;
    int64_t rows, cols, ld;
    const float *x;
    const void *bias;
    void *y;
    int64_t chunk;  /* output rows per chunk */
} matvec_job;

/* output rows per chunk: 64, or for short rows as many as make MATVEC_CHUNK_BYTES of weights (a 16 KB chunk of a
 * predictor's 128-wide rows is too short a stream: 1024 of them measured 16% faster), a multiple of 4 */
#define MATVEC_CHUNK 64
#define MATVEC_CHUNK_BYTES (256 << 10)

static void matvec_chunk(void *p, int64_t c, int slot) {
    (void)slot;
    matvec_job *j = p;
    size_t es = j->dt == DT_F32 ? 4 : 2;
    int64_t o = c * j->chunk, hi = o + j->chunk < j->rows ? o + j->chunk : j->rows;
    float s[4];
    for (; o + 4 <= hi; o += 4) {
        dot4(j->dt, (const char *)j->w + o * j->ld * es, j->ld, j->x, j->cols, s);
        for (int k = 0; k < 4; k++)
            store1(j->dt, j->y, o + k, s[k] + (j->bias ? load1(j->dt, j->bias, o + k) : 0.0f));
    }
    for (; o < hi; o++) {
        float v = dot(j->dt, (const char *)j->w + o * j->ld * es, j->x, j->cols);
        store1(j->dt, j->y, o, v + (j->bias ? load1(j->dt, j->bias, o) : 0.0f));
    }
}

static float *as_f32(int dt, const void *x, int64_t n) {
    float *xf = malloc((size_t)n * sizeof(float) + 64);
    if (xf)
        for (int64_t i = 0; i < n; i++) xf[i] = load1(dt, x, i);
    return xf;
}

/* w [rows, cols] (row stride ld elements), x [cols], bias [rows] or NULL, y [rows]: all of dtype dt */
int fl_matvec(int dt, const void *w, int64_t rows, int64_t cols, int64_t ld, const void *x, const void *bias,
              void *y, int threads) {
    float *xf = as_f32(dt, x, cols);
    if (!xf) return -1;
    int64_t chunk = MATVEC_CHUNK_BYTES / ((cols > 0 ? cols : 1) * (dt == DT_F32 ? 4 : 2)) / 4 * 4;
    matvec_job j = {dt, w, rows, cols, ld, xf, bias, y, chunk > MATVEC_CHUNK ? chunk : MATVEC_CHUNK};
    run_chunks(matvec_chunk, &j, (rows + j.chunk - 1) / j.chunk, rows * cols < (1 << 17) ? 1 : threads);
    free(xf);
    return 0;
}

/* ---- the sparse FFN over bundle rows ---- */
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
    float *acc;                    /* [d] accumulated into by the caller's chunks */
    float *scratch;                /* [threads - 1, d]: each worker's own sum */
    char used[MAX_THREADS];        /* which workers' sums hold chunks */
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
static float hidden_of(const ffn_job *j, int64_t r, float up_dot, float gate_dot) {
    int dt = j->dt;
    float u = round_to(dt, up_dot + (j->up_bias ? load1(dt, j->up_bias, r) : 0.0f)), g = u;
    if (j->gate_pre) g = load1(dt, j->gate_pre, r);
    else if (j->gate) g = round_to(dt, gate_dot + (j->gate_bias ? load1(dt, j->gate_bias, r) : 0.0f));
    float a = round_to(dt, activate(j->act, g, j->act_param));
    if (j->has_threshold && !(fabsf(a) > j->threshold)) a = 0.0f;
    return j->gated ? round_to(dt, a * u) : a;
}

/* h of rows r0 and r1 (r1 < 0: r0 only) into h[0], h[1]; the up and gate dots of both rows share x's loads */
static void hidden2(const ffn_job *j, int64_t r0, int64_t r1, float *h) {
    int64_t es = j->dt == DT_F32 ? 4 : 2;
    int own_gate = j->gate && !j->gate_pre;
    const char *u0 = (const char *)j->up + r0 * j->ld * es;
    if (r1 < 0) {
        float s[2] = {0.0f, 0.0f};
        if (own_gate) dot2(j->dt, u0, (const char *)j->gate + r0 * j->ld * es, j->x, j->d, s);
        else s[0] = dot(j->dt, u0, j->x, j->d);
        h[0] = hidden_of(j, r0, s[0], s[1]);
        return;
    }
    const char *u1 = (const char *)j->up + r1 * j->ld * es;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (own_gate) {
        const void *w[4] = {u0, (const char *)j->gate + r0 * j->ld * es, u1, (const char *)j->gate + r1 * j->ld * es};
        dot4p(j->dt, w, j->x, j->d, s);
    } else {
        dot2(j->dt, u0, u1, j->x, j->d, s);
        s[2] = s[1];
        s[1] = 0.0f;
    }
    h[0] = hidden_of(j, r0, s[0], s[1]);
    h[1] = hidden_of(j, r1, s[2], s[3]);
}

#define FFN_CHUNK 16  /* cache rows per chunk (even: rows are taken in pairs) */

static void ffn_chunk(void *p, int64_t c, int slot) {
    ffn_job *j = p;
    int64_t es = j->dt == DT_F32 ? 4 : 2;
    int64_t lo = c * FFN_CHUNK, hi = lo + FFN_CHUNK < j->n ? lo + FFN_CHUNK : j->n;
    float *acc = slot == 0 ? j->acc : j->scratch + (int64_t)(slot - 1) * j->d;
    if (slot && !j->used[slot]) {  /* a worker's own sum, zeroed when it takes its first chunk */
        memset(acc, 0, (size_t)j->d * sizeof(float));
        j->used[slot] = 1;
    }
    const char *down = j->down;
    float hs[4];
    const void *ws[4];
    int held = 0;  /* rows whose h waits for partners: acc is passed once per four rows */
    for (int64_t k = lo; k < hi; k += 2) {
        int64_t r0 = j->index ? j->index[k] : k, r1 = k + 1 < hi ? (j->index ? j->index[k + 1] : k + 1) : -1;
        float h[2];
        hidden2(j, r0, r1, h);
        for (int t = 0; t < (r1 < 0 ? 1 : 2); t++) {
            if (h[t] == 0.0f) continue;
            hs[held] = h[t];
            ws[held++] = down + (t ? r1 : r0) * j->ld * es;
            if (held == 4) {
                axpy4(j->dt, hs, ws, acc, j->d);
                held = 0;
            }
        }
    }
    if (held >= 2) axpy2(j->dt, hs[0], ws[0], hs[1], ws[1], acc, j->d);
    if (held == 3) axpy(j->dt, hs[2], ws[2], acc, j->d);
    if (held == 1) axpy(j->dt, hs[0], ws[0], acc, j->d);
}

/* acc [d] (float32) += sum over rows r (index[0..n-1], or 0..n-1) of h_r * down_r, h_r = act(gate_r.x + gate_bias[r])
 * * (up_r.x + up_bias[r]) (gated) or act(up_r.x + up_bias[r]); gate_pre[r] replaces gate_r.x + gate_bias[r].
 * x [d] and per-row arrays are of dtype dt. Returns 0, or -1 when out of memory. */
int fl_ffn(int dt, const void *up, const void *gate, const void *down, int64_t ld, int64_t d, const int64_t *index,
           int64_t n, const void *x, const void *up_bias, const void *gate_bias, const void *gate_pre, int gated,
           int act, float act_param, int has_threshold, float threshold, float *acc, int threads) {
    float *xf = as_f32(dt, x, d);
    if (!xf) return -1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || n < 2 * FFN_CHUNK) threads = 1;
    float *scratch = threads > 1 ? malloc((size_t)(threads - 1) * (size_t)d * sizeof(float)) : NULL;
    if (threads > 1 && !scratch) threads = 1;
    ffn_job j = {dt, up, gate, down, ld, d, index, n, xf, up_bias, gate_bias, gate_pre, act, gated,
                 has_threshold, act_param, threshold, acc, scratch, {0}};
    run_chunks(ffn_chunk, &j, (n + FFN_CHUNK - 1) / FFN_CHUNK, threads);
    for (int t = 1; t < threads; t++)
        if (j.used[t])
            for (int64_t i = 0; i < d; i++) acc[i] += scratch[(int64_t)(t - 1) * d + i];
    free(scratch);
    free(xf);
    return 0;
}

/* y [rows, n] = round(w * round(x / sqrt(mean(x^2) + eps))) per row of x [rows, n], w [n], all of dtype dt: torch's
 * float32 rms_norm rounded to dt, then the scale in dt (TorchBackend.norm's tuned path), one row at a time on the
 * calling thread (a row is a few KB). Returns 0. */
int fl_rmsnorm(int dt, const void *x, const void *w, int64_t rows, int64_t n, float eps, void *y) {
    size_t es = dt == DT_F32 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * n * es;
        char *yr = (char *)y + r * n * es;
        float s = 0.0f;
        int64_t i = 0;
#if FL_AVX2
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (; i + 16 <= n; i += 16) {
            __m256 v0 = load8(dt, xr, i), v1 = load8(dt, xr, i + 8);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        s = hsum(_mm256_add_ps(a0, a1));
#endif
        for (; i < n; i++) s += load1(dt, xr, i) * load1(dt, xr, i);
        float scale = 1.0f / sqrtf(s / (float)n + eps);
        i = 0;
#if FL_AVX2
        if (dt == DT_F16) {
            __m256 sc = _mm256_set1_ps(scale);
            for (; i + 8 <= n; i += 8) {
                __m256 u = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(load8(dt, xr, i), sc), _MM_FROUND_TO_NEAREST_INT));
                _mm_storeu_si128((__m128i *)((uint16_t *)yr + i),
                                 _mm256_cvtps_ph(_mm256_mul_ps(u, load8(dt, w, i)), _MM_FROUND_TO_NEAREST_INT));
            }
        }
#endif
        for (; i < n; i++) store1(dt, yr, i, round_to(dt, load1(dt, xr, i) * scale) * load1(dt, w, i));
    }
    return 0;
}

/* ---- one decode token's attention over a head-major KV cache ----
 * The torch backend's decode path as one call: rotary on q and the new k (float32 products, rounded to dt),
 * k and v written at `pos` into the layer's caches K [kv heads, ctx, hd] and V [kv heads, hd, ctx], then per
 * query head the scores q . K[lo..pos] rounded to dt, times `scale`, a float32 softmax whose weights are
 * rounded to dt, and the output sum_s w[s] V[:, s] rounded to dt: the same roundings as torch's
 * (bmm in dt, softmax in float32), summed in float32. Chunks are kv heads (a group's query heads share one). */
typedef struct {
    int dt;
    const void *q, *k, *v;          /* [heads, hd], [kv heads, hd], [kv heads, hd] of dtype dt */
    void *kc, *vc;                  /* the layer's caches (dt) */
    int64_t ctx, pos, lo, heads, kvh, hd, rd;
    const float *cos, *sin;         /* [rd] for position pos (halves repeated), or NULL: no rotary */
    float scale;
    void *out;                      /* [heads, hd] (dt) */
    float *scratch;                 /* per slot: hd + (pos - lo + 1) floats */
} attn_job;

/* x [hd] (dt) rotated over its first rd values (rotate_half convention), rounded to dt, as float32 */
static void rotary(const attn_job *j, const void *x, float *out) {
    int64_t half = j->rd / 2;
    for (int64_t i = 0; i < j->hd; i++) {
        float xi = load1(j->dt, x, i);
        if (i < j->rd) {
            float other = i < half ? -load1(j->dt, x, i + half) : load1(j->dt, x, i - half);
            volatile float a = xi * j->cos[i], b = other * j->sin[i];  /* two products, then the sum */
            xi = a + b;
        }
        out[i] = round_to(j->dt, xi);
    }
}

static void attn_chunk(void *p, int64_t g, int slot) {
    attn_job *j = p;
    int64_t hd = j->hd, S = j->pos - j->lo + 1, group = j->heads / j->kvh;
    size_t es = j->dt == DT_F32 ? 4 : 2;
    float *qf = j->scratch + (size_t)slot * (size_t)(hd + S), *w = qf + hd;
    char *kc = (char *)j->kc + (size_t)(g * j->ctx) * hd * es, *vc = (char *)j->vc + (size_t)(g * hd) * j->ctx * es;
    const char *kn = (const char *)j->k + (size_t)(g * hd) * es, *vn = (const char *)j->v + (size_t)(g * hd) * es;
    if (j->cos) rotary(j, kn, qf);
    for (int64_t i = 0; i < hd; i++) {
        store1(j->dt, kc + (size_t)j->pos * hd * es, i, j->cos ? qf[i] : load1(j->dt, kn, i));
        store1(j->dt, vc + (size_t)i * j->ctx * es, j->pos, load1(j->dt, vn, i));
    }
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        const char *qh = (const char *)j->q + (size_t)(h * hd) * es;
        if (j->cos) rotary(j, qh, qf);
        else for (int64_t i = 0; i < hd; i++) qf[i] = load1(j->dt, qh, i);
        float top = -INFINITY, sum = 0.0f;
        for (int64_t s = 0; s < S; s++) {
            w[s] = round_to(j->dt, dot(j->dt, kc + (size_t)(j->lo + s) * hd * es, qf, hd)) * j->scale;
            if (w[s] > top) top = w[s];
        }
        for (int64_t s = 0; s < S; s++) sum += (w[s] = expf(w[s] - top));
        float inv = 1.0f / sum;
        for (int64_t s = 0; s < S; s++) w[s] = round_to(j->dt, w[s] * inv);
        for (int64_t i = 0; i < hd; i++)
            store1(j->dt, j->out, h * hd + i, dot(j->dt, vc + ((size_t)i * j->ctx + j->lo) * es, w, S));
    }
}

int fl_attend(int dt, const void *q, const void *k, const void *v, void *kc, void *vc, int64_t ctx, int64_t pos,
              int64_t lo, int64_t heads, int64_t kvh, int64_t hd, int64_t rd, const float *cos, const float *sin,
              float scale, void *out, int threads) {
    int64_t S = pos - lo + 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || kvh < 2 || heads * S * hd < (1 << 17)) threads = 1;  /* a short context: one thread */
    float *scratch = malloc((size_t)threads * (size_t)(hd + S) * sizeof(float));
    if (!scratch) return -1;
    attn_job j = {dt, q, k, v, kc, vc, ctx, pos, lo, heads, kvh, hd, rd, cos, sin, scale, out, scratch};
    run_chunks(attn_chunk, &j, kvh, threads);
    free(scratch);
    return 0;
}

/* which vector path this build took (1: AVX2 + F16C + FMA, 0: portable C) */
int fl_simd(void) { return FL_AVX2; }

/* ---- quantized rows (flashllm/quant.py's FFN parts, as stored): one part of d values is its codes (int8: one
 * byte each, two's complement when symmetric; int4: two per byte, value 2j in the low nibble, symmetric codes
 * stored as q + 8), then a float16 scale per group of `group` values, then (asymmetric) a float16 minimum per
 * group. A value is w = c * s + m with m the group's minimum (asymmetric), -8 s (symmetric int4) or 0
 * (symmetric int8). Dot products use sum_g s_g (c . x)_g + m_g (sum of x over g): the codes are widened to
 * float32 in registers and never written out; every sum is float32. ---- */
typedef struct {
    int bits, sym;
    int64_t group, d, scales_off, mins_off;  /* byte offsets of the scales and mins inside a part */
} qfmt;

static qfmt qfmt_of(int bits, int sym, int64_t group, int64_t d) {
    qfmt q = {bits, sym, group, d, d * bits / 8, d * bits / 8 + (d / group) * 2};
    return q;
}

static inline float load_h(const uint8_t *p, int64_t g) {
    uint16_t h;
    memcpy(&h, p + 2 * g, 2);
    return h2f(h);
}

/* (scale, offset) of group g of a part: w = c * scale + offset */
static inline void q_group(const qfmt *q, const uint8_t *part, int64_t g, float *s, float *m) {
    *s = load_h(part + q->scales_off, g);
    *m = q->sym ? (q->bits == 4 ? -8.0f * *s : 0.0f) : load_h(part + q->mins_off, g);
}

static inline float q_code(const qfmt *q, const uint8_t *codes, int64_t i) {
    if (q->bits == 4) return (float)((codes[i >> 1] >> ((i & 1) * 4)) & 15);
    return q->sym ? (float)(int8_t)codes[i] : (float)codes[i];
}

#if FL_AVX2
/* codes i..i+7 (i a multiple of 8) as float32 */
static inline __m256 q_codes8(const qfmt *q, const uint8_t *codes, int64_t i) {
    if (q->bits == 4) {
        uint32_t four;
        memcpy(&four, codes + (i >> 1), 4);
        __m128i b = _mm_cvtsi32_si128((int)four);
        __m256i v = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));  /* each byte twice */
        v = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), _mm256_set1_epi32(15));
        return _mm256_cvtepi32_ps(v);
    }
    __m128i b = _mm_loadl_epi64((const __m128i *)(codes + i));
    return _mm256_cvtepi32_ps(q->sym ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}
#endif

/* codes[lo..hi) . x[lo..hi) */
static float q_codes_dot(const qfmt *q, const uint8_t *codes, const float *x, int64_t lo, int64_t hi) {
    int64_t i = lo;
    float s = 0.0f;
#if FL_AVX2
    if ((lo & 7) == 0) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (; i + 16 <= hi; i += 16) {
            a0 = _mm256_fmadd_ps(q_codes8(q, codes, i), _mm256_loadu_ps(x + i), a0);
            a1 = _mm256_fmadd_ps(q_codes8(q, codes, i + 8), _mm256_loadu_ps(x + i + 8), a1);
        }
        for (; i + 8 <= hi; i += 8) a0 = _mm256_fmadd_ps(q_codes8(q, codes, i), _mm256_loadu_ps(x + i), a0);
        s = hsum(_mm256_add_ps(a0, a1));
    }
#endif
    for (; i < hi; i++) s += q_code(q, codes, i) * x[i];
    return s;
}

/* dequantized part . x, with xs[g] the sum of x over group g */
static float q_dot(const qfmt *q, const uint8_t *part, const float *x, const float *xs) {
    float total = 0.0f, s, m;
#if FL_AVX2
    if (q->group % 8 == 0) {  /* each group's scale times its codes' dot, summed as one vector */
        __m256 t = _mm256_setzero_ps();
        for (int64_t g = 0, lo = 0; lo < q->d; g++, lo += q->group) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            int64_t i = lo;
            for (; i + 16 <= lo + q->group; i += 16) {
                a0 = _mm256_fmadd_ps(q_codes8(q, part, i), _mm256_loadu_ps(x + i), a0);
                a1 = _mm256_fmadd_ps(q_codes8(q, part, i + 8), _mm256_loadu_ps(x + i + 8), a1);
            }
            if (i < lo + q->group) a0 = _mm256_fmadd_ps(q_codes8(q, part, i), _mm256_loadu_ps(x + i), a0);
            q_group(q, part, g, &s, &m);
            t = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_add_ps(a0, a1), t);
            total += m * xs[g];
        }
        return hsum(t) + total;
    }
#endif
    for (int64_t g = 0, lo = 0; lo < q->d; g++, lo += q->group) {
        q_group(q, part, g, &s, &m);
        total += s * q_codes_dot(q, part, x, lo, lo + q->group) + m * xs[g];
    }
    return total;
}

/* acc += h * dequantized part */
static void q_axpy(const qfmt *q, float h, const uint8_t *part, float *acc) {
    float s, m;
    for (int64_t g = 0, lo = 0; lo < q->d; g++, lo += q->group) {
        q_group(q, part, g, &s, &m);
        float hs = h * s, hm = h * m;
        int64_t i = lo, hi = lo + q->group;
#if FL_AVX2
        if ((lo & 7) == 0) {
            __m256 hsv = _mm256_set1_ps(hs), hmv = _mm256_set1_ps(hm);
            for (; i + 8 <= hi; i += 8)
                _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(q_codes8(q, part, i), hsv,
                                                          _mm256_add_ps(_mm256_loadu_ps(acc + i), hmv)));
        }
#endif
        for (; i < hi; i++) acc[i] += q_code(q, part, i) * hs + hm;
    }
}

#if FL_AVX2
/* int4 with groups of a multiple of 16 values (the converter's): x de-interleaved once per call into its even
 * values xe [d/2] and odd values xo (= xe + d/2), so 8 code bytes widen to 8 even values (low nibbles) and 8 odd
 * ones (high nibbles) without shuffles; a down row is added into a de-interleaved float32 sum the same way. */
#define Q4_FAST(q) ((q)->bits == 4 && (q)->group % 16 == 0)
static inline __m256i q4_bytes8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256 q4_lo(__m256i c) { return _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15))); }
static inline __m256 q4_hi(__m256i c) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)); }

/* out[0] = part a . x, out[1] = part b . x (b NULL: out[0] only), sharing the loads of x */
static void q4_dot2(const qfmt *q, const uint8_t *a, const uint8_t *b, const float *xe, const float *xs, float *out) {
    const float *xo = xe + q->d / 2;
    __m256 ta = _mm256_setzero_ps(), tb = ta;
    float ma = 0.0f, mb = 0.0f, s, m;
    int64_t half = q->group / 2;
    for (int64_t g = 0, lo = 0; lo < q->d / 2; g++, lo += half) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int64_t i = lo; i < lo + half; i += 8) {
            __m256 e = _mm256_loadu_ps(xe + i), o = _mm256_loadu_ps(xo + i);
            __m256i c = q4_bytes8(a + i);
            a0 = _mm256_fmadd_ps(q4_lo(c), e, a0);
            a1 = _mm256_fmadd_ps(q4_hi(c), o, a1);
            if (b) {
                c = q4_bytes8(b + i);
                b0 = _mm256_fmadd_ps(q4_lo(c), e, b0);
                b1 = _mm256_fmadd_ps(q4_hi(c), o, b1);
            }
        }
        q_group(q, a, g, &s, &m);
        ta = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_add_ps(a0, a1), ta);
        ma += m * xs[g];
        if (b) {
            q_group(q, b, g, &s, &m);
            tb = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_add_ps(b0, b1), tb);
            mb += m * xs[g];
        }
    }
    out[0] = hsum(ta) + ma;
    if (b) out[1] = hsum(tb) + mb;
}

/* (ae, ae + d/2) (the de-interleaved sum) += h0 * part p0 + h1 * part p1 (p1 NULL: p0 only) */
static void q4_axpy2(const qfmt *q, float h0, const uint8_t *p0, float h1, const uint8_t *p1, float *ae) {
    float *ao = ae + q->d / 2, s0, m0, s1 = 0.0f, m1 = 0.0f;
    int64_t half = q->group / 2;
    for (int64_t g = 0, lo = 0; lo < q->d / 2; g++, lo += half) {
        q_group(q, p0, g, &s0, &m0);
        if (p1) q_group(q, p1, g, &s1, &m1);
        __m256 hs0 = _mm256_set1_ps(h0 * s0), hs1 = _mm256_set1_ps(h1 * s1);
        __m256 hm = _mm256_set1_ps(h0 * m0 + (p1 ? h1 * m1 : 0.0f));
        for (int64_t i = lo; i < lo + half; i += 8) {
            __m256i c = q4_bytes8(p0 + i);
            __m256 e = _mm256_fmadd_ps(q4_lo(c), hs0, _mm256_add_ps(_mm256_loadu_ps(ae + i), hm));
            __m256 o = _mm256_fmadd_ps(q4_hi(c), hs0, _mm256_add_ps(_mm256_loadu_ps(ao + i), hm));
            if (p1) {
                c = q4_bytes8(p1 + i);
                e = _mm256_fmadd_ps(q4_lo(c), hs1, e);
                o = _mm256_fmadd_ps(q4_hi(c), hs1, o);
            }
            _mm256_storeu_ps(ae + i, e);
            _mm256_storeu_ps(ao + i, o);
        }
    }
}

/* x's even values then its odd ones (a new array), or NULL when out of memory */
static float *deinterleave(const float *x, int64_t d) {
    float *xe = malloc((size_t)d * sizeof(float));
    if (xe)
        for (int64_t i = 0; i < d / 2; i++) {
            xe[i] = x[2 * i];
            xe[d / 2 + i] = x[2 * i + 1];
        }
    return xe;
}
#else
#define Q4_FAST(q) 0
#endif

/* xs[g] = sum of x over group g */
static float *group_sums(const float *x, int64_t d, int64_t group) {
    float *xs = malloc((size_t)(d / group + 1) * sizeof(float));
    if (xs)
        for (int64_t g = 0; g * group < d; g++) {
            float s = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) s += x[i];
            xs[g] = s;
        }
    return xs;
}

typedef struct {
    qfmt q;
    const uint8_t *w;
    int64_t rows, ld;  /* part r at w + r * ld bytes */
    int dt;            /* of bias and y */
    const float *x, *xs, *xe;  /* xe: x de-interleaved (the int4 fast path) or NULL */
    const void *bias;
    void *y;
} qmatvec_job;

static void qmatvec_chunk(void *p, int64_t c, int slot) {
    (void)slot;
    qmatvec_job *j = p;
    int64_t o = c * MATVEC_CHUNK, hi = o + MATVEC_CHUNK < j->rows ? o + MATVEC_CHUNK : j->rows;
    for (; o < hi; o++) {
        float v;
#if FL_AVX2
        if (j->xe) q4_dot2(&j->q, j->w + o * j->ld, NULL, j->xe, j->xs, &v);
        else
#endif
        v = q_dot(&j->q, j->w + o * j->ld, j->x, j->xs);
        store1(j->dt, j->y, o, v + (j->bias ? load1(j->dt, j->bias, o) : 0.0f));
    }
}

/* y [rows] = round(w . x + bias) over quantized parts of d values (part r at w + r * ld bytes); x, bias (or NULL)
 * and y of dtype dt. Returns 0, or -1 when out of memory. */
int fl_qmatvec(int bits, int sym, int64_t group, const uint8_t *w, int64_t rows, int64_t d, int64_t ld, int dt,
               const void *x, const void *bias, void *y, int threads) {
    qfmt q = qfmt_of(bits, sym, group, d);
    float *xf = as_f32(dt, x, d), *xs = xf ? group_sums(xf, d, group) : NULL, *xe = NULL;
#if FL_AVX2
    if (xs && Q4_FAST(&q) && !(xe = deinterleave(xf, d))) { free(xs); xs = NULL; }
#endif
    if (!xs) { free(xf); return -1; }
    qmatvec_job j = {q, w, rows, ld, dt, xf, xs, xe, bias, y};
    run_chunks(qmatvec_chunk, &j, (rows + MATVEC_CHUNK - 1) / MATVEC_CHUNK, rows * d < (1 << 18) ? 1 : threads);
    free(xe);
    free(xs);
    free(xf);
    return 0;
}

typedef struct {
    ffn_job f;  /* up, gate, down: the parts' bytes (row r's part at part + r * ld bytes); dt: of x and per-row arrays */
    qfmt q;
    const float *xs, *xe;  /* xe: x de-interleaved, NULL but on the int4 fast path (whose sums are de-interleaved
                            * too: every worker's in scratch [threads, d], acc untouched until the end) */
} qffn_job;

static void qffn_chunk(void *p, int64_t c, int slot) {
    qffn_job *qj = p;
    ffn_job *j = &qj->f;
    int64_t lo = c * FFN_CHUNK, hi = lo + FFN_CHUNK < j->n ? lo + FFN_CHUNK : j->n;
    float *acc = slot == 0 ? j->acc : j->scratch + (int64_t)(slot - 1) * j->d;
    if (slot && !j->used[slot]) {
        memset(acc, 0, (size_t)j->d * sizeof(float));
        j->used[slot] = 1;
    }
    int own_gate = j->gate && !j->gate_pre;
    for (int64_t k = lo; k < hi; k++) {
        int64_t r = j->index ? j->index[k] : k, off = r * j->ld;
        float u = q_dot(&qj->q, (const uint8_t *)j->up + off, j->x, qj->xs);
        float g = own_gate ? q_dot(&qj->q, (const uint8_t *)j->gate + off, j->x, qj->xs) : 0.0f;
        float h = hidden_of(j, r, u, g);
        if (h != 0.0f) q_axpy(&qj->q, h, (const uint8_t *)j->down + off, acc);
    }
}

#if FL_AVX2
static void q4ffn_chunk(void *p, int64_t c, int slot) {
    qffn_job *qj = p;
    ffn_job *j = &qj->f;
    int64_t lo = c * FFN_CHUNK, hi = lo + FFN_CHUNK < j->n ? lo + FFN_CHUNK : j->n;
    float *acc = j->scratch + (int64_t)slot * j->d;
    if (!j->used[slot]) {
        memset(acc, 0, (size_t)j->d * sizeof(float));
        j->used[slot] = 1;
    }
    int own_gate = j->gate && !j->gate_pre;
    const uint8_t *down = j->down, *pend = NULL;  /* a down row waiting for a second one */
    float hpend = 0.0f;
    for (int64_t k = lo; k < hi; k++) {
        int64_t r = j->index ? j->index[k] : k, off = r * j->ld;
        float s[2] = {0.0f, 0.0f};
        q4_dot2(&qj->q, (const uint8_t *)j->up + off, own_gate ? (const uint8_t *)j->gate + off : NULL, qj->xe, qj->xs, s);
        float h = hidden_of(j, r, s[0], s[1]);
        if (h == 0.0f) continue;
        if (!pend) {
            pend = down + off;
            hpend = h;
        } else {
            q4_axpy2(&qj->q, hpend, pend, h, down + off, acc);
            pend = NULL;
        }
    }
    if (pend) q4_axpy2(&qj->q, hpend, pend, 0.0f, NULL, acc);
}
#endif

/* fl_ffn over quantized parts: acc [d] (float32) += sum over rows r (index[0..n-1], or 0..n-1) of h_r * down_r,
 * with up_r, gate_r (NULL: gate_pre or none) and down_r the dequantized parts at up/gate/down + r * ld bytes;
 * x and per-row arrays of dtype dt, each projection rounded to dt as the float kernel does. Returns 0, or -1. */
int fl_qffn(int bits, int sym, int64_t group, const uint8_t *up, const uint8_t *gate, const uint8_t *down, int64_t ld,
            int64_t d, const int64_t *index, int64_t n, int dt, const void *x, const void *up_bias,
            const void *gate_bias, const void *gate_pre, int gated, int act, float act_param, int has_threshold,
            float threshold, float *acc, int threads) {
    qfmt q = qfmt_of(bits, sym, group, d);
    float *xf = as_f32(dt, x, d), *xs = xf ? group_sums(xf, d, group) : NULL, *xe = NULL;
    if (!xs) { free(xf); return -1; }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || n < 2 * FFN_CHUNK) threads = 1;
    int fast = 0;
#if FL_AVX2
    fast = Q4_FAST(&q) && (xe = deinterleave(xf, d)) != NULL;
#endif
    int sums = fast ? threads : threads - 1;  /* workers' own sums (the fast path's de-interleaved, all of them) */
    float *scratch = sums > 0 ? malloc((size_t)sums * (size_t)d * sizeof(float)) : NULL;
    if (sums > 0 && !scratch) {
        free(xe), free(xs), free(xf);
        return -1;
    }
    qffn_job j = {{dt, up, gate, down, ld, d, index, n, xf, up_bias, gate_bias, gate_pre, act, gated,
                   has_threshold, act_param, threshold, acc, scratch, {0}}, q, xs, xe};
#if FL_AVX2
    if (fast) {
        run_chunks(q4ffn_chunk, &j, (n + FFN_CHUNK - 1) / FFN_CHUNK, threads);
        for (int t = 0; t < threads; t++)
            if (j.f.used[t])
                for (int64_t i = 0, h = d / 2; i < h; i++) {
                    acc[2 * i] += scratch[(int64_t)t * d + i];
                    acc[2 * i + 1] += scratch[(int64_t)t * d + h + i];
                }
    } else
#endif
    {
        run_chunks(qffn_chunk, &j, (n + FFN_CHUNK - 1) / FFN_CHUNK, threads);
        for (int t = 1; t < threads; t++)
            if (j.f.used[t])
                for (int64_t i = 0; i < d; i++) acc[i] += scratch[(int64_t)(t - 1) * d + i];
    }
    free(scratch);
    free(xe);
    free(xs);
    free(xf);
    return 0;
}
