/* What kernels_qdot.c (the int8-activation mat-vec) shares with kernels_experts.c (several experts' FFN): the
 * quantized row and activation formats and the row dot product. */
#ifndef FLASHLLM_KERNELS_QDOT_H
#define FLASHLLM_KERNELS_QDOT_H

#include "kernels.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define FL_NEON 1
#else
#define FL_NEON 0
#endif
#if FL_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define FL_VNNI 1
#else
#define FL_VNNI 0
#endif

#define QB 32      /* activation values per block (one scale) */
#define MAXG 4096  /* groups per row the kernels take (a row's float scales live on the stack) */
#define ROW_CHUNK 32

/* A quantized row: bits 4 or 8, symmetric or not, `group` values per float16 scale (and min), d values. A value is
 * w = c * s + off with c the code as the integer dots read it: off = min (asymmetric) or `koff` * s, koff the code
 * bias of the path (-8 for symmetric int4 stored as q + 8; for int8, -128 where signed codes are read as unsigned
 * (VNNI) and +128 where unsigned codes are read as signed (NEON)). */
typedef struct {
    int bits, sym;
    int64_t group, d, scales_off, mins_off;
    float koff;
} qrow;

/* One vector of activations, quantized: codes in the kernels' order (int8 rows: natural; int4 rows: per pair of
 * blocks p, [even values of block 2p, even of 2p+1, odd of 2p, odd of 2p+1], 16 each, zero padded), dx[b] the scale
 * of block b (dxv: each four times, for 8-lane vectors over two blocks), gs[g] = sum over group g of x_hat. */
typedef struct {
    int8_t *xq;
    int16_t *x16;  /* xq widened (int8 rows without VNNI) */
    float *dx, *dxv, *gs;
} qx;

#define HIDDEN __attribute__((visibility("hidden")))
HIDDEN qrow qrow_of(int bits, int sym, int64_t group, int64_t d);
HIDDEN int64_t qx_bytes(int64_t d, int64_t group);
HIDDEN void qx_place(qx *v, uint8_t *mem, int64_t d, int64_t group);
HIDDEN void quantize_x(const float *x, int64_t d, int64_t group, int bits, qx *v);
HIDDEN float row_dot(const qrow *q, const uint8_t *w, const qx *x);  /* W_hat row . x_hat */
HIDDEN int qdot_fits(int bits, int64_t group, int64_t d);
/* T vectors x [T, d] (dtype dt) -> their qx in one allocation *mem (NULL when out of memory) */
HIDDEN qx *quantize_all(int dt, const void *x, int64_t T, int64_t d, int64_t group, int bits, void **mem);

#endif
