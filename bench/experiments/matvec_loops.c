/* Inner loops of a float16 mat-vec against each other (see bench/results/compute/roofline.md):
 * the native kernel's AVX2 loop (kernels.c dot_of), the same with 8 accumulators, AVX-512, and two rows sharing x,
 * interleaved per round over COPIES x 32 MB of 4096 x 4096 matrices (default 24: 768 MB), on 2 threads that spin
 * between calls (as llama.cpp's do), rows split in halves. Prints each loop's best and mean GB/s of weights.
 *   cc -O2 -march=native -o matvec_loops bench/experiments/matvec_loops.c -lpthread && ./matvec_loops [COPIES] [4k]
 * x86 with AVX-512 only; `4k`: the weights on 4 KiB pages instead of transparent huge pages. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

static inline __m256 ld8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline float hsum(__m256 v) { __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a)); a = _mm_add_ss(a, _mm_movehdup_ps(a)); return _mm_cvtss_f32(a); }

static float dot_avx2(const uint16_t *w, const uint16_t *x, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; int i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(ld8(w + i), ld8(x + i), a0); a1 = _mm256_fmadd_ps(ld8(w + i + 8), ld8(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(ld8(w + i + 16), ld8(x + i + 16), a2); a3 = _mm256_fmadd_ps(ld8(w + i + 24), ld8(x + i + 24), a3);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
static float dot_avx2_8(const uint16_t *w, const uint16_t *x, int n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; int i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm256_fmadd_ps(ld8(w + i), ld8(x + i), a0); a1 = _mm256_fmadd_ps(ld8(w + i + 8), ld8(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(ld8(w + i + 16), ld8(x + i + 16), a2); a3 = _mm256_fmadd_ps(ld8(w + i + 24), ld8(x + i + 24), a3);
    a4 = _mm256_fmadd_ps(ld8(w + i + 32), ld8(x + i + 32), a4); a5 = _mm256_fmadd_ps(ld8(w + i + 40), ld8(x + i + 40), a5);
    a6 = _mm256_fmadd_ps(ld8(w + i + 48), ld8(x + i + 48), a6); a7 = _mm256_fmadd_ps(ld8(w + i + 56), ld8(x + i + 56), a7);
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))));
}
static inline __m512 ld16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static float dot_512(const uint16_t *w, const uint16_t *x, int n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0; int i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_fmadd_ps(ld16(w + i), ld16(x + i), a0); a1 = _mm512_fmadd_ps(ld16(w + i + 16), ld16(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(ld16(w + i + 32), ld16(x + i + 32), a2); a3 = _mm512_fmadd_ps(ld16(w + i + 48), ld16(x + i + 48), a3);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
/* two rows at once, sharing x loads */
static void dot2_512(const uint16_t *w0, const uint16_t *w1, const uint16_t *x, int n, float *o) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0; int i = 0;
  for (; i + 32 <= n; i += 32) {
    __m512 x0 = ld16(x + i), x1 = ld16(x + i + 16);
    a0 = _mm512_fmadd_ps(ld16(w0 + i), x0, a0); a1 = _mm512_fmadd_ps(ld16(w0 + i + 16), x1, a1);
    b0 = _mm512_fmadd_ps(ld16(w1 + i), x0, b0); b1 = _mm512_fmadd_ps(ld16(w1 + i + 16), x1, b1);
  }
  o[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)); o[1] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}

typedef struct { const uint16_t *w; const uint16_t *x; float *y; int row0, row1, n, variant; } job_t;
static void run(job_t *j) {
  for (int r = j->row0; r < j->row1; r++) {
    const uint16_t *row = j->w + (int64_t)r * j->n;
    switch (j->variant) {
      case 0: j->y[r] = dot_avx2(row, j->x, j->n); break;
      case 1: j->y[r] = dot_avx2_8(row, j->x, j->n); break;
      case 2: j->y[r] = dot_512(row, j->x, j->n); break;
      case 3: dot2_512(row, row + j->n, j->x, j->n, j->y + r); r++; break;
    }
  }
}
static volatile int go_gen = 0, done_cnt = 0; static job_t job2;
static void *worker(void *p) { (void)p; int seen = 0; for (;;) { while (go_gen == seen) _mm_pause(); seen = go_gen; run(&job2); __atomic_add_fetch(&done_cnt, 1, __ATOMIC_SEQ_CST); } return 0; }
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(int argc, char **argv) {
  int rows = 4096, n = 4096, copies = argc > 1 ? atoi(argv[1]) : 24;
  if (copies < 1) { fprintf(stderr, "COPIES must be a positive count\n"); return 2; }
  size_t mat = (size_t)rows * n, total = mat * copies;
  uint16_t *w = mmap(0, total * 2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (w == MAP_FAILED) { perror("mmap"); return 1; }
  if (!(argc > 2 && !strcmp(argv[2], "4k"))) madvise(w, total * 2, MADV_HUGEPAGE);
  for (size_t i = 0; i < total; i++) w[i] = 0x3c00 ^ (i & 0x3ff);
  uint16_t x[4096] __attribute__((aligned(64))); for (int i = 0; i < n; i++) x[i] = 0x3000 + (i & 0xff);
  float *y = aligned_alloc(64, rows * 4);
  pthread_t t; pthread_create(&t, 0, worker, 0);
  const char *names[] = {"avx2x4 (current)", "avx2x8", "avx512x4", "avx512 2rows"};
  double best[4] = {0}, sum[4] = {0}; int cnt[4] = {0};
  for (int round = 0; round < 30; round++)
    for (int v = 0; v < 4; v++) {
      double t0 = now();
      for (int c = 0; c < copies; c++) {
        const uint16_t *wc = w + mat * c;
        job2 = (job_t){wc, x, y, rows / 2, rows, n, v};
        job_t mine = {wc, x, y, 0, rows / 2, n, v};
        done_cnt = 0; __atomic_add_fetch(&go_gen, 1, __ATOMIC_SEQ_CST);
        run(&mine);
        while (__atomic_load_n(&done_cnt, __ATOMIC_SEQ_CST) == 0) _mm_pause();
      }
      double gbs = total * 2 / (now() - t0) / 1e9;
      if (gbs > best[v]) best[v] = gbs;
      if (round >= 2) { sum[v] += gbs; cnt[v]++; }  /* the mean leaves out 2 warm-up rounds */
    }
  for (int v = 0; v < 4; v++) printf("%-18s best %.1f GB/s mean %.1f\n", names[v], best[v], sum[v] / cnt[v]);
  return 0;
}
