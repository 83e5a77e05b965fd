/* kernels_qdot.c's fl_qmatmul against a double-precision W_hat . x_hat, built for another CPU (tests/test_native_qdot.py runs
 * it under qemu for arm64: the NEON paths, with and without the dot-product instructions) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int fl_qmatmul(int, int, int64_t, const uint8_t *, int64_t, int64_t, int64_t, int, int64_t, const void *, const void *, void *, int);
static float h2f_(uint16_t h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static uint16_t f2h_(float x) { _Float16 f = (_Float16)x; uint16_t h; memcpy(&h, &f, 2); return h; }
static double rnd(void) { return (double)rand() / RAND_MAX * 2 - 1; }
int main(void) {
    int bad = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (int sym = 0; sym <= 1; sym++) {
            int64_t n = 37, d = 256, g = 64, G = d / g, cb = d * bits / 8, rb = cb + G * 2 * (sym ? 1 : 2);
            uint8_t *w = calloc(n, rb);
            double *W = calloc(n * d, sizeof(double));
            for (int64_t r = 0; r < n; r++)
                for (int64_t k = 0; k < G; k++) {
                    float s = 0.01f + 0.01f * (float)fabs(rnd()), m = sym ? 0.0f : -0.05f;
                    uint16_t hs = f2h_(s), hm = f2h_(m);
                    s = h2f_(hs), m = h2f_(hm);
                    memcpy(w + r * rb + cb + 2 * k, &hs, 2);
                    if (!sym) memcpy(w + r * rb + cb + 2 * G + 2 * k, &hm, 2);
                    for (int64_t i = k * g; i < (k + 1) * g; i++) {
                        int c = rand() % (bits == 4 ? 16 : 256);
                        double v;
                        if (bits == 4) {
                            w[r * rb + i / 2] |= (uint8_t)(c << (4 * (i & 1)));
                            v = sym ? (c - 8) * (double)s : c * (double)s + m;
                        } else {
                            w[r * rb + i] = (uint8_t)c;
                            v = sym ? (int8_t)c * (double)s : c * (double)s + m;
                        }
                        W[r * d + i] = v;
                    }
                }
            float x[256], y[37];
            double xh[256];
            for (int i = 0; i < d; i++) x[i] = (float)rnd();
            for (int b = 0; b < d / 32; b++) {
                float a = 0;
                for (int j = 0; j < 32; j++) a = fmaxf(a, fabsf(x[b * 32 + j]));
                for (int j = 0; j < 32; j++) xh[b * 32 + j] = lrintf(x[b * 32 + j] * (127.0f / a)) * (double)(a / 127.0f);
            }
            fl_qmatmul(bits, sym, g, w, n, d, rb, 0, 1, x, NULL, y, 1);
            double err = 0, mx = 0;
            for (int64_t r = 0; r < n; r++) {
                double ref = 0;
                for (int i = 0; i < d; i++) ref += W[r * d + i] * xh[i];
                err = fmax(err, fabs(ref - y[r]));
                mx = fmax(mx, fabs(ref));
            }
            printf("bits %d sym %d: max err %.2e of %.3f\n", bits, sym, err, mx);
            bad |= err > 1e-5 * mx;
        }
    printf(bad ? "FAIL\n" : "OK\n");
    return bad;
}
