/* flashllm's quantized mat-vec with int8 activations (as llama.cpp's Q4_0 x Q8_0; the expert FFN over the same rows
 * is kernels_experts.c): the activations
 * are quantized once per call into blocks of 32 values (int8 codes, one float scale per block), and each weight row
 * (flashllm/format/quant.py's part: codes, float16 scales, float16 mins) is multiplied with integer dot products:
 * AVX2 (maddubs; VNNI's dpbusd where the CPU has it), NEON (sdot where the CPU has it) or portable C. The result is
 * exactly W_hat . x_hat up to float32 rounding (W_hat the dequantized weights, x_hat the dequantized activations);
 * x_hat's error, at most half a step of 1/127 of its block's largest |x|, is the price of the integer products. */
#include "kernels_qdot.h"

qrow qrow_of(int bits, int sym, int64_t group, int64_t d) {
    qrow q = {bits, sym, group, d, d * bits / 8, d * bits / 8 + (d / group) * 2, 0.0f};
    if (bits == 4) q.koff = sym ? -8.0f : 0.0f;
#if FL_VNNI
    else if (sym) q.koff = -128.0f;
#elif FL_NEON
    else if (!sym) q.koff = 128.0f;
#endif
    return q;
}

static int64_t pairs_of(int64_t d) { return (d / QB + 1) / 2; }

/* bytes of one qx of d values (all its arrays, 64-byte aligned pieces) */
int64_t qx_bytes(int64_t d, int64_t group) {
    int64_t np = pairs_of(d), nb = d / QB;
    return 64 * 5 + np * 64 + np * 128 + nb * 4 + nb * 16 + (d / group) * 4;
}

static uint8_t *align64(uint8_t *p) { return (uint8_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

void qx_place(qx *v, uint8_t *mem, int64_t d, int64_t group) {
    int64_t np = pairs_of(d), nb = d / QB;
    uint8_t *p = align64(mem);
    v->xq = (int8_t *)p, p = align64(p + np * 64);
    v->x16 = (int16_t *)p, p = align64(p + np * 128);
    v->dx = (float *)p, p = align64(p + nb * 4);
    v->dxv = (float *)p, p = align64(p + nb * 16);
    v->gs = (float *)p;
    (void)group;
}

/* position of value j (0..31) of block b in the int4 order */
static inline int64_t q4_pos(int64_t b, int64_t j) { return (b >> 1) * 64 + (j & 1) * 32 + (b & 1) * 16 + (j >> 1); }

#if FL_AVX2
/* block b of x (32 values, scale 1 / inv) as int8 codes, stored in the order of `bits`-bit rows; returns their sum */
static int quantize_block8(const float *xb, float inv, int bits, int64_t b, int8_t *xq) {
    __m256 s = _mm256_set1_ps(inv);
    __m256i lim = _mm256_set1_epi32(127), i[4];
    for (int k = 0; k < 4; k++)  /* round to nearest even, as lrintf */
        i[k] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * k), s)), lim),
                                _mm256_sub_epi32(_mm256_setzero_si256(), lim));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    __m256i r = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    r = _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  /* values 0..31 in order */
    if (bits == 8) {
        _mm256_storeu_si256((__m256i *)(xq + b * QB), r);
    } else {  /* even values, then odd ones: each lane's evens then odds, then the lanes' evens together */
        r = _mm256_shuffle_epi8(r, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                    0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
        r = _mm256_permute4x64_epi64(r, 0xd8);
        int8_t *at = xq + (b >> 1) * 64 + (b & 1) * 16;
        _mm_storeu_si128((__m128i *)at, _mm256_castsi256_si128(r));
        _mm_storeu_si128((__m128i *)(at + 32), _mm256_extracti128_si256(r, 1));
    }
    return _mm_cvtsi128_si32(s4);
}
#endif

/* x [d] (float32) -> v, for rows of `bits` bits and groups of `group` (a multiple of QB) */
void quantize_x(const float *x, int64_t d, int64_t group, int bits, qx *v) {
    int64_t nb = d / QB, bpg = group / QB;
    memset(v->xq, 0, (size_t)pairs_of(d) * 64);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f;
#if FL_AVX2
        __m256 m = _mm256_setzero_ps(), abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int k = 0; k < 4; k++) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * k), abs));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        int isum = quantize_block8(xb, amax > 0.0f ? 127.0f / amax : 0.0f, bits, b, v->xq);
#else
        for (int j = 0; j < QB; j++) amax = fmaxf(amax, fabsf(xb[j]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int isum = 0;
        for (int j = 0; j < QB; j++) {
            int c = (int)lrintf(xb[j] * inv);
            c = c > 127 ? 127 : c < -127 ? -127 : c;
            isum += c;
            v->xq[bits == 4 ? q4_pos(b, j) : b * QB + j] = (int8_t)c;
        }
#endif
        float dx = amax / 127.0f;
        v->dx[b] = dx;
        for (int k = 0; k < 4; k++) v->dxv[4 * b + k] = dx;
        if (b % bpg == 0) v->gs[b / bpg] = 0.0f;
        v->gs[b / bpg] += dx * (float)isum;
    }
#if FL_AVX2 && !FL_VNNI
    if (bits == 8)
        for (int64_t i = 0; i < d; i++) v->x16[i] = v->xq[i];
#endif
}

/* the row's scales as float32 (sc[g]); returns sum_g off_g * gs[g], off_g = min_g (asymmetric) + koff * s_g */
static float row_groups(const qrow *q, const uint8_t *w, const qx *x, float *sc) {
    int64_t G = q->d / q->group, g = 0;
    const uint8_t *hs = w + q->scales_off, *hm = w + q->mins_off;
    float off = 0.0f;
#if FL_AVX2
    __m256 o8 = _mm256_setzero_ps(), k8 = _mm256_set1_ps(q->koff);
    for (; g + 8 <= G; g += 8) {
        __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hs + 2 * g)));
        _mm256_storeu_ps(sc + g, s8);
        __m256 m8 = q->sym ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hm + 2 * g)));
        o8 = _mm256_fmadd_ps(_mm256_fmadd_ps(k8, s8, m8), _mm256_loadu_ps(x->gs + g), o8);
    }
    off = hsum(o8);
#endif
    for (; g < G; g++) {
        uint16_t h;
        memcpy(&h, hs + 2 * g, 2);
        sc[g] = h2f(h);
        float o = q->koff * sc[g];
        if (!q->sym) {
            memcpy(&h, hm + 2 * g, 2);
            o += h2f(h);
        }
        off += o * x->gs[g];
    }
    return off;
}

/* integer dot of block b's codes with x's block b (b's values in the paths' orders) */
static inline int32_t block_dot_c(const qrow *q, const uint8_t *w, const qx *x, int64_t b) {
    int32_t s = 0;
    if (q->bits == 4) {
        const uint8_t *c = w + b * 16;
        for (int j = 0; j < 16; j++)
            s += (c[j] & 15) * x->xq[q4_pos(b, 2 * j)] + (c[j] >> 4) * x->xq[q4_pos(b, 2 * j + 1)];
        return s;
    }
    const uint8_t *c = w + b * QB;
    const int8_t *xb = x->xq + b * QB;
    for (int j = 0; j < QB; j++) {
        int code = q->sym ? (int)(int8_t)c[j] : (int)c[j];
#if FL_VNNI
        if (q->sym) code += 128;
#elif FL_NEON
        if (!q->sym) code -= 128;
#endif
        s += code * xb[j];
    }
    return s;
}

#if FL_AVX2
static inline __m256i dot_u8s8(__m256i a, __m256i b) {  /* 8 int32 sums of 4 products (u8 x s8) */
#if FL_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* sum over groups of s_g * sum_b dx_b (c . xq)_b, groups a multiple of 64 values */
static float dot_avx2(const qrow *q, const uint8_t *w, const qx *x, const float *sc) {
    int64_t G = q->d / q->group, bpg = q->group / QB;
    __m256 tot = _mm256_setzero_ps(), tot1 = tot;  /* two sums: no chain of dependent adds */
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t g = 0, b = 0; g < G; g++) {
        __m256 ag = _mm256_setzero_ps();
        for (int64_t end = b + bpg; b < end; b += 2) {
            __m256i p;
            if (q->bits == 4) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w + b * 16));
                const int8_t *xp = x->xq + b * 32;
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#if FL_VNNI
                p = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo,
                                                            _mm256_loadu_si256((const __m256i *)xp)),
                                        hi, _mm256_loadu_si256((const __m256i *)(xp + 32)));
#else
                __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                                               _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 32))));
                p = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
                ag = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_loadu_ps(x->dxv + 4 * b), ag);
                continue;
            }
            for (int64_t k = b; k < b + 2; k++) {  /* int8: one block per 8 lanes */
                const uint8_t *c = w + k * QB;
#if FL_VNNI
                __m256i cv = _mm256_loadu_si256((const __m256i *)c);
                if (q->sym) cv = _mm256_xor_si256(cv, _mm256_set1_epi8((char)0x80));
                p = dot_u8s8(cv, _mm256_loadu_si256((const __m256i *)(x->xq + k * QB)));
#else
                __m128i c0 = _mm_loadu_si128((const __m128i *)c), c1 = _mm_loadu_si128((const __m128i *)(c + 16));
                __m256i w0 = q->sym ? _mm256_cvtepi8_epi16(c0) : _mm256_cvtepu8_epi16(c0);
                __m256i w1 = q->sym ? _mm256_cvtepi8_epi16(c1) : _mm256_cvtepu8_epi16(c1);
                p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)(x->x16 + k * QB))),
                                     _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x->x16 + k * QB + 16))));
#endif
                ag = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(x->dx + k), ag);
            }
        }
        if (g & 1) tot1 = _mm256_fmadd_ps(ag, _mm256_set1_ps(sc[g]), tot1);
        else tot = _mm256_fmadd_ps(ag, _mm256_set1_ps(sc[g]), tot);
    }
    return hsum(_mm256_add_ps(tot, tot1));
}
#endif

#if FL_NEON
static inline int32x4_t dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    p = vmlal_s8(p, vget_high_s8(a), vget_high_s8(b));  /* two products per lane: |sum| <= 2 * 128 * 127 */
    return vpadalq_s16(acc, p);
#endif
}

static float dot_neon(const qrow *q, const uint8_t *w, const qx *x, const float *sc) {
    int64_t nb = q->d / QB, bpg = q->group / QB;
    float32x4_t tot = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        int32x4_t s = vdupq_n_s32(0);
        if (q->bits == 4) {
            uint8x16_t v = vld1q_u8(w + b * 16);
            const int8_t *xp = x->xq + (b >> 1) * 64 + (b & 1) * 16;
            s = dot_s8(s, vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), vld1q_s8(xp));
            s = dot_s8(s, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vld1q_s8(xp + 32));
        } else {
            uint8x16_t c0 = vld1q_u8(w + b * QB), c1 = vld1q_u8(w + b * QB + 16);
            if (!q->sym) {
                c0 = veorq_u8(c0, vdupq_n_u8(0x80));
                c1 = veorq_u8(c1, vdupq_n_u8(0x80));
            }
            s = dot_s8(s, vreinterpretq_s8_u8(c0), vld1q_s8(x->xq + b * QB));
            s = dot_s8(s, vreinterpretq_s8_u8(c1), vld1q_s8(x->xq + b * QB + 16));
        }
        tot = vfmaq_n_f32(tot, vcvtq_f32_s32(s), x->dx[b] * sc[b / bpg]);
    }
    return vaddvq_f32(tot);
}
#endif

/* W_hat row . x_hat */
float row_dot(const qrow *q, const uint8_t *w, const qx *x) {
    float sc[MAXG];
    float off = row_groups(q, w, x, sc), main = 0.0f;
#if FL_AVX2
    if (q->group % 64 == 0) return dot_avx2(q, w, x, sc) + off;
#elif FL_NEON
    return dot_neon(q, w, x, sc) + off;
#endif
    int64_t nb = q->d / QB, bpg = q->group / QB;
    for (int64_t g = 0, b = 0; g < q->d / q->group; g++) {
        float ag = 0.0f;
        for (int64_t end = b + bpg; b < end; b++) ag += x->dx[b] * (float)block_dot_c(q, w, x, b);
        main += sc[g] * ag;
    }
    (void)nb;
    return main + off;
}

/* whether these kernels take rows of d values in groups of `group` */
int qdot_fits(int bits, int64_t group, int64_t d) {
    return (bits == 4 || bits == 8) && group % QB == 0 && d % group == 0 && d / group <= MAXG && d > 0;
}

/* ---- mat-vec over T tokens: y [T, rows] = round(W_hat . x_hat + bias) ---- */
typedef struct {
    qrow q;
    const uint8_t *w;
    int64_t rows, ld, T;
    const qx *x;
    int dt;
    const void *bias;
    void *y;
} qmm_job;

static void qmm_chunk(void *p, int64_t c, int slot) {
    (void)slot;
    qmm_job *j = p;
    int64_t o = c * ROW_CHUNK, hi = o + ROW_CHUNK < j->rows ? o + ROW_CHUNK : j->rows;
    for (; o < hi; o++) {
        float b = j->bias ? load1(j->dt, j->bias, o) : 0.0f;
        for (int64_t t = 0; t < j->T; t++) store1(j->dt, j->y, t * j->rows + o, row_dot(&j->q, j->w + o * j->ld, j->x + t) + b);
    }
}

/* T vectors x [T, d] (dtype dt) -> their qx in one allocation (NULL when out of memory) */
qx *quantize_all(int dt, const void *x, int64_t T, int64_t d, int64_t group, int bits, void **mem) {
    int64_t each = qx_bytes(d, group);
    qx *v = malloc((size_t)T * sizeof(qx));
    uint8_t *m = malloc((size_t)(T * each));
    float *xf = malloc((size_t)d * sizeof(float));
    if (!v || !m || !xf) {
        free(v), free(m), free(xf);
        return NULL;
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < d; i++) xf[i] = load1(dt, x, t * d + i);
        qx_place(v + t, m + t * each, d, group);
        quantize_x(xf, d, group, bits, v + t);
    }
    free(xf);
    *mem = m;
    return v;
}

/* y [T, rows] (dtype dt) = W_hat . x_hat + bias for x [T, d] (dtype dt) over quantized rows (row r at w + r * ld
 * bytes); bias [rows] or NULL. Returns 0, -1 when out of memory, -2 when the row format is not one it takes. */
int fl_qmatmul(int bits, int sym, int64_t group, const uint8_t *w, int64_t rows, int64_t d, int64_t ld, int dt,
               int64_t T, const void *x, const void *bias, void *y, int threads) {
    if (!qdot_fits(bits, group, d)) return -2;
    void *mem;
    qx *xs = quantize_all(dt, x, T, d, group, bits, &mem);
    if (!xs) return -1;
    qmm_job j = {qrow_of(bits, sym, group, d), w, rows, ld, T, xs, dt, bias, y};
    run_chunks(qmm_chunk, &j, (rows + ROW_CHUNK - 1) / ROW_CHUNK, rows * d * T < (1 << 16) ? 1 : threads);
    free(mem);
    free(xs);
    return 0;
}
