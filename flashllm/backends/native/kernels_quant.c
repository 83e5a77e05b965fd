/* flashllm's native kernels over quantized FFN parts as stored (int8/int4): a one-token mat-vec and the sparse
 * FFN over a neuron cache's rows, the float kernels' math (kernels.c) with the weights dequantized in registers. */
#include "kernels.h"

/* ---- quantized rows (flashllm/format/quant.py's FFN parts, as stored): one part of d values is its codes (int8: one
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
    const float *xs, *xe;  /* xe: x de-interleaved, NULL but on the int4 fast path (whose groups' sums in scratch are
                            * de-interleaved too) */
} qffn_job;

static void qffn_chunk(void *p, int64_t c, int slot) {
    qffn_job *qj = p;
    ffn_job *j = &qj->f;
    (void)slot;
    int64_t lo = c * j->per, hi = lo + j->per < j->n ? lo + j->per : j->n;
    float *acc = j->scratch + c * j->d;  /* the group's own sum */
    memset(acc, 0, (size_t)j->d * sizeof(float));
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
    (void)slot;
    int64_t lo = c * j->per, hi = lo + j->per < j->n ? lo + j->per : j->n;
    float *acc = j->scratch + c * j->d;  /* the group's own sum, de-interleaved */
    memset(acc, 0, (size_t)j->d * sizeof(float));
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
 * x and per-row arrays of dtype dt, each projection rounded to dt as the float kernel does; `zero` and y as
 * fl_ffn's. Returns 0, or -1. */
int fl_qffn(int bits, int sym, int64_t group, const uint8_t *up, const uint8_t *gate, const uint8_t *down, int64_t ld,
            int64_t d, const int64_t *index, int64_t n, int dt, const void *x, const void *up_bias,
            const void *gate_bias, const void *gate_pre, int gated, int act, float act_param, int has_threshold,
            float threshold, float *acc, int threads, int zero, void *y, const void *down_bias) {
    if (zero) memset(acc, 0, (size_t)d * sizeof(float));
    qfmt q = qfmt_of(bits, sym, group, d);
    float *xf = as_f32(dt, x, d), *xs = xf ? group_sums(xf, d, group) : NULL, *xe = NULL;
    if (!xs) { free(xf); return -1; }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || n < 2 * FFN_CHUNK) threads = 1;
    int fast = 0;
#if FL_AVX2
    fast = Q4_FAST(&q) && (xe = deinterleave(xf, d)) != NULL;
#endif
    int64_t per = ffn_group_rows(n), groups = (n + per - 1) / per;  /* (as fl_ffn: the same bits at any thread count) */
    float *scratch = malloc((size_t)(groups > 0 ? groups : 1) * (size_t)d * sizeof(float));
    if (!scratch) {
        free(xe), free(xs), free(xf);
        return -1;
    }
    qffn_job j = {{dt, up, gate, down, ld, d, index, n, xf, up_bias, gate_bias, gate_pre, act, gated,
                   has_threshold, act_param, threshold, acc, scratch, per, NULL}, q, xs, xe};
#if FL_AVX2
    if (fast) {
        run_chunks(q4ffn_chunk, &j, groups, threads);
        for (int64_t g = 0; g < groups; g++)
            for (int64_t i = 0, h = d / 2; i < h; i++) {
                acc[2 * i] += scratch[g * d + i];
                acc[2 * i + 1] += scratch[g * d + h + i];
            }
    } else
#endif
    {
        run_chunks(qffn_chunk, &j, groups, threads);
        ffn_add_groups(acc, scratch, groups, d);
    }
    free(scratch);
    free(xe);
    free(xs);
    free(xf);
    if (y) ffn_out(dt, acc, down_bias, y, d);
    return 0;
}
