/* llama.cpp's CPU mat-vec on one shape, for bench/compute/qkernels.py's kernel table: `copies` distinct Q4_0 or Q8_0
 * weight matrices [n, k] (random N(0, 0.02) values quantized by ggml) each times one float32 vector, as one ggml graph
 * of `copies` ggml_mul_mat nodes (ggml quantizes the vector to Q8_0 itself, as in a decode token), computed `reps`
 * times with `threads` threads by ggml_graph_compute_with_ctx (the CPU backend's type traits, without its repacked
 * buffer types: llama.cpp's --repack 0). Prints the median seconds per mat-vec and the weight bytes of one matrix.
 *   ggml_matvec q4_0|q8_0 N K THREADS REPS COPIES */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s q4_0|q8_0 N K THREADS REPS COPIES\n", argv[0]);
        return 2;
    }
    enum ggml_type type = strcmp(argv[1], "q8_0") == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_Q4_0;
    int64_t n = atoll(argv[2]), k = atoll(argv[3]);
    int threads = atoi(argv[4]), reps = atoi(argv[5]), copies = atoi(argv[6]);
    size_t row = ggml_row_size(type, k), bytes = row * (size_t)n;
    struct ggml_init_params ip = {(bytes + 4096) * (size_t)copies + (size_t)(k + n) * 4 * copies + (64 << 20), NULL, 0};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, 1);
    float *xs = (float *)x->data, *tmp = malloc(sizeof(float) * (size_t)k * 64);
    char *q = malloc(row * 64);
    srand(1);
    for (int64_t i = 0; i < k; i++) xs[i] = (float)rand() / RAND_MAX - 0.5f;
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    for (int c = 0; c < copies; c++) {
        struct ggml_tensor *w = ggml_new_tensor_2d(ctx, type, k, n);
        for (int64_t r = 0; r < n; r += 64) {
            int64_t m = n - r < 64 ? n - r : 64;
            for (int64_t i = 0; i < m * k; i++) tmp[i] = 0.04f * ((float)rand() / RAND_MAX - 0.5f);
            ggml_quantize_chunk(type, tmp, q, 0, m, k, NULL);
            memcpy((char *)w->data + r * row, q, row * m);
        }
        ggml_build_forward_expand(gf, ggml_mul_mat(ctx, w, x));
    }
    double *t = malloc(sizeof(double) * reps);
    ggml_graph_compute_with_ctx(ctx, gf, threads);  /* warm-up */
    for (int r = 0; r < reps; r++) {
        double a = now();
        ggml_graph_compute_with_ctx(ctx, gf, threads);
        t[r] = (now() - a) / copies;
    }
    qsort(t, reps, sizeof(double), cmp);
    printf("%.9f %zu\n", t[reps / 2], bytes);
    ggml_free(ctx);
    return 0;
}
