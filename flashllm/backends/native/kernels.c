/* flashllm's native CPU kernels for one decode token: a dense mat-vec and the sparse FFN over a neuron
 * cache's bundle rows in one pass, RMS norm and decode attention. Weights are float16, bfloat16 or float32;
 * every product is summed in float32. Threads are the library's own small pthread pool (kernels_pool.c: no
 * second OpenMP runtime beside torch's), taking chunks of output rows (mat-vec) or of cache rows (FFN, each
 * thread with its own float32 sum) from a shared counter, so that a thread the machine is slow to run leaves
 * its share to the others. The int8/int4 kernels are in kernels_quant.c, what both share in kernels.h.
 * Built on first use by flashllm/backends/native/__init__.py with the machine's C compiler; the x86 path
 * uses AVX2 + F16C + FMA when the compiler targets them (-march=native), every other machine the portable
 * C loops below (which the compiler may vectorize). */
#include "kernels.h"

/* ---- vector loops: dot(w, x) and acc += h * w, w in dt, x in float32 or dt, acc float32 ---- */
#if FL_AVX2
static inline __m256 load8(int dt, const void *p, int64_t i) {
    if (dt == DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

/* w . x, w of dtype wdt and x of dtype xdt (each converted to float32 as it is loaded) */
static inline float dot_of(int wdt, const void *w, int xdt, const void *x, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if FL_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(load8(wdt, w, i), load8(xdt, x, i), a0);
        a1 = _mm256_fmadd_ps(load8(wdt, w, i + 8), load8(xdt, x, i + 8), a1);
        a2 = _mm256_fmadd_ps(load8(wdt, w, i + 16), load8(xdt, x, i + 16), a2);
        a3 = _mm256_fmadd_ps(load8(wdt, w, i + 24), load8(xdt, x, i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(wdt, w, i), load8(xdt, x, i), a0);
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
    float part[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) part[k] += load1(wdt, w, i + k) * load1(xdt, x, i + k);
    for (int k = 0; k < 8; k++) s += part[k];
#endif
    for (; i < n; i++) s += load1(wdt, w, i) * load1(xdt, x, i);
    return s;
}

/* w . x with x float32 (attention's rotated query and softmax weights) */
static float dot(int dt, const void *w, const float *x, int64_t n) { return dot_of(dt, w, DT_F32, x, n); }

/* w . x with x of dtype dt too (the mat-vec's x as the caller passes it: no float32 copy, half the bytes in L1) */
static float dotx(int dt, const void *w, const void *x, int64_t n) { return dot_of(dt, w, dt, x, n); }

/* four rows' dot products with x (dtype dt), sharing each load of x: the mat-vec's inner loop where x does not
 * stay in L1 beside a streamed row */
static void dot4(int dt, const void *w, int64_t ld, const void *x, int64_t n, float *out) {
    size_t es = dt == DT_F32 ? 4 : 2;
#if FL_AVX2
    const char *r0 = w, *r1 = r0 + ld * es, *r2 = r1 + ld * es, *r3 = r2 + ld * es;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = load8(dt, x, i), x1 = load8(dt, x, i + 8);
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
        float xi = load1(dt, x, i);
        out[0] += load1(dt, r0, i) * xi;
        out[1] += load1(dt, r1, i) * xi;
        out[2] += load1(dt, r2, i) * xi;
        out[3] += load1(dt, r3, i) * xi;
    }
#else
    for (int k = 0; k < 4; k++) out[k] = dotx(dt, (const char *)w + k * ld * es, x, n);
#endif
}

/* (a . x, b . x): two rows' dot products sharing each load of x (a row's up and gate parts) */
static void dot2(int dt, const void *a, const void *b, const void *x, int64_t n, float *out) {
    int64_t i = 0;
    float sa = 0.0f, sb = 0.0f;
#if FL_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = load8(dt, x, i), x1 = load8(dt, x, i + 8);
        a0 = _mm256_fmadd_ps(load8(dt, a, i), x0, a0);
        b0 = _mm256_fmadd_ps(load8(dt, b, i), x0, b0);
        a1 = _mm256_fmadd_ps(load8(dt, a, i + 8), x1, a1);
        b1 = _mm256_fmadd_ps(load8(dt, b, i + 8), x1, b1);
    }
    sa = hsum(_mm256_add_ps(a0, a1));
    sb = hsum(_mm256_add_ps(b0, b1));
#endif
    for (; i < n; i++) {
        sa += load1(dt, a, i) * load1(dt, x, i);
        sb += load1(dt, b, i) * load1(dt, x, i);
    }
    out[0] = sa;
    out[1] = sb;
}

/* w[k] . x for four rows anywhere (two cache rows' up and gate parts), sharing each load of x */
static void dot4p(int dt, const void *const *w, const void *x, int64_t n, float *out) {
    int64_t i = 0;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if FL_AVX2
    __m256 a[4][2];
    for (int k = 0; k < 4; k++) a[k][0] = a[k][1] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 x0 = load8(dt, x, i), x1 = load8(dt, x, i + 8);
        for (int k = 0; k < 4; k++) {
            a[k][0] = _mm256_fmadd_ps(load8(dt, w[k], i), x0, a[k][0]);
            a[k][1] = _mm256_fmadd_ps(load8(dt, w[k], i + 8), x1, a[k][1]);
        }
    }
    for (int k = 0; k < 4; k++) s[k] = hsum(_mm256_add_ps(a[k][0], a[k][1]));
#endif
    for (; i < n; i++)
        for (int k = 0; k < 4; k++) s[k] += load1(dt, w[k], i) * load1(dt, x, i);
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

/* acc[0..n) = sum_s w[s] rows[s][0..n) over S contiguous rows of n values (dtype dt): attention's output over
 * its values in one pass, 128 columns at a time held in sixteen float32 registers */
static void weighted_rows(int dt, const void *rows, int64_t n, const float *w, int64_t S, float *acc) {
    size_t es = dt == DT_F32 ? 4 : 2;
    int64_t c = 0;
#if FL_AVX2
    for (; c + 128 <= n; c += 128) {
        __m256 a[16];
        for (int k = 0; k < 16; k++) a[k] = _mm256_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            const char *r = (const char *)rows + (size_t)(s * n + c) * es;
            __m256 ws = _mm256_set1_ps(w[s]);
            for (int k = 0; k < 16; k++) a[k] = _mm256_fmadd_ps(load8(dt, r, 8 * k), ws, a[k]);
        }
        for (int k = 0; k < 16; k++) _mm256_storeu_ps(acc + c + 8 * k, a[k]);
    }
#endif
    for (int64_t i = c; i < n; i++) acc[i] = 0.0f;
    if (c < n)
        for (int64_t s = 0; s < S; s++) axpy(dt, w[s], (const char *)rows + (size_t)(s * n + c) * es, acc + c, n - c);
}

/* ---- dense mat-vec: y[o] = round(sum_i w[o, i] x[i] + bias[o]) ---- */
typedef struct {
    int dt;
    const void *w;
    int64_t rows, cols, ld;
    const void *x;  /* [cols] of dtype dt */
    const void *bias;
    void *y;
    int64_t chunk;  /* output rows per chunk */
    int one_row;    /* x stays in L1 beside one streamed row: rows one at a time (else four sharing x's loads) */
} matvec_job;

/* output rows per chunk: 64, or for short rows as many as make MATVEC_CHUNK_BYTES of weights (a 16 KB chunk of a
 * predictor's 128-wide rows is too short a stream: 1024 of them measured 16% faster), a multiple of 4 */
#define MATVEC_CHUNK_BYTES (256 << 10)

/* the L1 data cache's size in bytes (32 KiB where the system does not say) */
static int64_t l1_bytes(void) {
    static int64_t size;
    if (!size) {
        long v = -1;
#ifdef _SC_LEVEL1_DCACHE_SIZE
        v = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#endif
        size = v > 0 ? v : 32 << 10;
    }
    return size;
}

static void matvec_chunk(void *p, int64_t c, int slot) {
    (void)slot;
    matvec_job *j = p;
    size_t es = j->dt == DT_F32 ? 4 : 2;
    int64_t o = c * j->chunk, hi = o + j->chunk < j->rows ? o + j->chunk : j->rows;
    float s[4];
    for (; !j->one_row && o + 4 <= hi; o += 4) {
        dot4(j->dt, (const char *)j->w + o * j->ld * es, j->ld, j->x, j->cols, s);
        for (int k = 0; k < 4; k++)
            store1(j->dt, j->y, o + k, s[k] + (j->bias ? load1(j->dt, j->bias, o + k) : 0.0f));
    }
    for (; o < hi; o++) {
        float v = dotx(j->dt, (const char *)j->w + o * j->ld * es, j->x, j->cols);
        store1(j->dt, j->y, o, v + (j->bias ? load1(j->dt, j->bias, o) : 0.0f));
    }
}

/* w [rows, cols] (row stride ld elements), x [cols], bias [rows] or NULL, y [rows]: all of dtype dt. Rows are taken
 * one at a time (one sequential stream) where x and a row fit in 3/4 of L1, so that x is not evicted by the row:
 * on the 7B shape, rows of 4096 float16 streamed 1.14-1.30x faster on 2 threads (1.5-1.6x on one) than four at a
 * time; rows of 8192 float16 were up to 19% slower one at a time, of 11008 15-24% (bench/results/compute_roofline.md,
 * session 10). */
int fl_matvec(int dt, const void *w, int64_t rows, int64_t cols, int64_t ld, const void *x, const void *bias,
              void *y, int threads) {
    int64_t es = dt == DT_F32 ? 4 : 2;
    int64_t chunk = MATVEC_CHUNK_BYTES / ((cols > 0 ? cols : 1) * es) / 4 * 4;
    matvec_job j = {dt, w, rows, cols, ld, x, bias, y, chunk > MATVEC_CHUNK ? chunk : MATVEC_CHUNK,
                    2 * cols * es <= l1_bytes() * 3 / 4};
    run_chunks(matvec_chunk, &j, (rows + j.chunk - 1) / j.chunk, rows * cols < (1 << 17) ? 1 : threads);
    return 0;
}

/* ---- the sparse FFN over bundle rows (its job and a row's hidden value: kernels.h) ---- */

/* h of rows r0 and r1 (r1 < 0: r0 only) into h[0], h[1]; the up and gate dots of both rows share x's loads */
static void hidden2(const ffn_job *j, int64_t r0, int64_t r1, float *h) {
    int64_t es = j->dt == DT_F32 ? 4 : 2;
    int own_gate = j->gate && !j->gate_pre;
    const char *u0 = (const char *)j->up + r0 * j->ld * es;
    if (r1 < 0) {
        float s[2] = {0.0f, 0.0f};
        if (own_gate) dot2(j->dt, u0, (const char *)j->gate + r0 * j->ld * es, j->xr, j->d, s);
        else s[0] = dotx(j->dt, u0, j->xr, j->d);
        h[0] = hidden_of(j, r0, s[0], s[1]);
        return;
    }
    const char *u1 = (const char *)j->up + r1 * j->ld * es;
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (own_gate) {
        const void *w[4] = {u0, (const char *)j->gate + r0 * j->ld * es, u1, (const char *)j->gate + r1 * j->ld * es};
        dot4p(j->dt, w, j->xr, j->d, s);
    } else {
        dot2(j->dt, u0, u1, j->xr, j->d, s);
        s[2] = s[1];
        s[1] = 0.0f;
    }
    h[0] = hidden_of(j, r0, s[0], s[1]);
    h[1] = hidden_of(j, r1, s[2], s[3]);
}


static void ffn_chunk(void *p, int64_t c, int slot) {
    ffn_job *j = p;
    int64_t es = j->dt == DT_F32 ? 4 : 2;
    (void)slot;
    int64_t lo = c * j->per, hi = lo + j->per < j->n ? lo + j->per : j->n;
    float *acc = j->scratch + c * j->d;  /* the group's own sum */
    memset(acc, 0, (size_t)j->d * sizeof(float));
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
 * x [d] and per-row arrays are of dtype dt; the dots load x as passed (no float32 copy: half the bytes beside the
 * float32 sum in L1). The rows' sum is made in groups (FFN_GROUPS): the same bits at any thread count. `zero`: acc
 * starts from zero; y (NULL: none): the FFN's output from acc (ffn_out). Returns 0, or -1 out of memory. */
int fl_ffn(int dt, const void *up, const void *gate, const void *down, int64_t ld, int64_t d, const int64_t *index,
           int64_t n, const void *x, const void *up_bias, const void *gate_bias, const void *gate_pre, int gated,
           int act, float act_param, int has_threshold, float threshold, float *acc, int threads, int zero, void *y,
           const void *down_bias) {
    if (zero) memset(acc, 0, (size_t)d * sizeof(float));
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || n < 2 * FFN_CHUNK) threads = 1;
    int64_t per = ffn_group_rows(n), groups = (n + per - 1) / per;
    float *scratch = malloc((size_t)(groups > 0 ? groups : 1) * (size_t)d * sizeof(float));
    if (!scratch) return -1;
    ffn_job j = {dt, up, gate, down, ld, d, index, n, NULL, up_bias, gate_bias, gate_pre, act, gated,
                 has_threshold, act_param, threshold, acc, scratch, per, x};
    run_chunks(ffn_chunk, &j, groups, threads);
    ffn_add_groups(acc, scratch, groups, d);
    free(scratch);
    if (y) ffn_out(dt, acc, down_bias, y, d);
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
 * k and v written at `pos` into the layer's caches K and V [kv heads, ctx, hd], then per query head the
 * scores q . K[lo..pos] rounded to dt, times `scale`, a float32 softmax whose weights are rounded to dt, and
 * the output sum_s w[s] V[s] rounded to dt (weighted_rows): the same roundings as torch's
 * (bmm in dt, softmax in float32), summed in float32. Chunks are kv heads (a group's query heads share one). */
typedef struct {
    int dt;
    const void *q, *k, *v;          /* [heads, hd], [kv heads, hd], [kv heads, hd] of dtype dt */
    void *kc, *vc;                  /* the layer's caches (dt) */
    int64_t ctx, pos, lo, heads, kvh, hd, rd;
    const float *cos, *sin;         /* [rd] for position pos (halves repeated), or NULL: no rotary */
    float scale;
    void *out;                      /* [heads, hd] (dt) */
    float *scratch;                 /* per slot: 2 hd + (pos - lo + 1) floats */
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
    float *qf = j->scratch + (size_t)slot * (size_t)(2 * hd + S), *w = qf + hd, *acc = w + S;
    char *kc = (char *)j->kc + (size_t)(g * j->ctx) * hd * es, *vc = (char *)j->vc + (size_t)(g * j->ctx) * hd * es;
    const char *kn = (const char *)j->k + (size_t)(g * hd) * es, *vn = (const char *)j->v + (size_t)(g * hd) * es;
    if (j->cos) rotary(j, kn, qf);
    for (int64_t i = 0; i < hd; i++) {
        store1(j->dt, kc + (size_t)j->pos * hd * es, i, j->cos ? qf[i] : load1(j->dt, kn, i));
        store1(j->dt, vc + (size_t)j->pos * hd * es, i, load1(j->dt, vn, i));
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
        weighted_rows(j->dt, vc + (size_t)j->lo * hd * es, hd, w, S, acc);
        for (int64_t i = 0; i < hd; i++) store1(j->dt, j->out, h * hd + i, acc[i]);
    }
}

int fl_attend(int dt, const void *q, const void *k, const void *v, void *kc, void *vc, int64_t ctx, int64_t pos,
              int64_t lo, int64_t heads, int64_t kvh, int64_t hd, int64_t rd, const float *cos, const float *sin,
              float scale, void *out, int threads) {
    int64_t S = pos - lo + 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || kvh < 2 || heads * S * hd < (1 << 17)) threads = 1;  /* a short context: one thread */
    float *scratch = malloc((size_t)threads * (size_t)(2 * hd + S) * sizeof(float));
    if (!scratch) return -1;
    attn_job j = {dt, q, k, v, kc, vc, ctx, pos, lo, heads, kvh, hd, rd, cos, sin, scale, out, scratch};
    run_chunks(attn_chunk, &j, kvh, threads);
    free(scratch);
    return 0;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* One decode token's attention block in one call: h = fl_rmsnorm(x), the fused q/k/v projection of h (fl_matvec,
 * rows of stride ld_qkv), fl_attend over it, and the output projection y (fl_matvec, [d_out, heads * hd], stride
 * ld_o); with ffn_w, also the residual x_out = x + y (rounded to dt, as torch adds) and its FFN norm
 * ffn_in = fl_rmsnorm(x_out) (d_out == d). These are the calls the torch backend makes one by one, with the same
 * arguments, so the same roundings: between them the runtime's Python ran on caches the weight streams had just
 * flushed, each tensor op ~10 us (bench/results/compute_roofline.md, session 11). h [d] and y [d_out] may be
 * NULL (not kept); times [5] (or NULL): seconds in the norm, the q/k/v projection, attention, the output projection
 * and the residual with its norm. Returns 0, or -1 out of memory. */
int fl_attn_block(int dt, const void *x, const void *norm_w, float eps, int64_t d, const void *wqkv, int64_t ld_qkv,
                  const void *bqkv, const void *wo, int64_t ld_o, const void *bo, int64_t d_out, void *kc, void *vc,
                  int64_t ctx, int64_t pos, int64_t lo, int64_t heads, int64_t kvh, int64_t hd, int64_t rd,
                  const float *cos, const float *sin, float scale, void *h, void *y, const void *ffn_w,
                  void *x_out, void *ffn_in, int threads, double *times) {
    size_t es = dt == DT_F32 ? 4 : 2;
    int64_t qkv_rows = (heads + 2 * kvh) * hd;
    char *qkv = malloc((size_t)(qkv_rows + heads * hd + d + d_out) * es);
    if (!qkv) return -1;
    char *att = qkv + (size_t)qkv_rows * es;
    if (!h) h = att + (size_t)(heads * hd) * es;
    if (!y) y = att + (size_t)(heads * hd + d) * es;
    double t[6];
    t[0] = seconds();
    fl_rmsnorm(dt, x, norm_w, 1, d, eps, h);
    t[1] = seconds();
    fl_matvec(dt, wqkv, qkv_rows, d, ld_qkv, h, bqkv, qkv, threads);
    t[2] = seconds();
    int rc = fl_attend(dt, qkv, qkv + (size_t)(heads * hd) * es, qkv + (size_t)((heads + kvh) * hd) * es, kc, vc, ctx,
                       pos, lo, heads, kvh, hd, rd, cos, sin, scale, att, threads);
    t[3] = seconds();
    if (!rc) fl_matvec(dt, wo, d_out, heads * hd, ld_o, att, bo, y, threads);
    t[4] = seconds();
    if (!rc && ffn_w) {
        for (int64_t i = 0; i < d; i++) store1(dt, x_out, i, load1(dt, x, i) + load1(dt, y, i));
        fl_rmsnorm(dt, x_out, ffn_w, 1, d, eps, ffn_in);
    }
    t[5] = seconds();
    free(qkv);
    if (times)
        for (int i = 0; i < 5; i++) times[i] = t[i + 1] - t[i];
    return rc;
}

/* which vector path this build took (1: AVX2 + F16C + FMA, 0: portable C) */
int fl_simd(void) { return FL_AVX2; }
