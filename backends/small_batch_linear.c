/* y[n, out] = x[n, in] @ w[out, in]^T for n >= 1 rows (a few: a verify pass; a few per stream: a merged pass of
 * several streams), fp32, reading w once from memory (kangaroo's verify kernel).
 *
 * Why: a verify pass multiplies a handful of positions by every weight matrix. BLAS treats n = 1 as a matrix-vector
 * product (memory-bound, fast) but n >= 2 as a general GEMM that re-packs the weights on every call; on a CPU this
 * made a two-position forward cost 1.7 one-position forwards. Here the weights stay in their own [out, in] layout
 * (shared with the model, never copied) and stream through once; the n rows of x sit in L1; a software prefetch keeps
 * the weight stream ahead of the arithmetic. The prefetch targets L2, not L1: a 36 KB look-ahead into L1 evicted the
 * x rows and the lines about to be used (measured on one core, SmolLM2's matrices: prefetching into L2 cut a
 * one-row sweep 41 -> 28 ms and an 8-row sweep 55 -> 34 ms). With n <= 8 the FMAs hide under the memory traffic, so n positions
 * cost about as much as one.
 *
 * Every output element is computed in the same order whatever n is (16-lane partial sums over `in`, then one fixed
 * reduction tree, the same additions whether one vector is reduced alone or sixteen side by side), so a row's result
 * does not depend on how many other rows came with it.
 *
 * Without AVX-512 a 16-lane vector has no register to live in (every operation on it goes through memory: several
 * times slower, docs/backends.md "Kernels on an AVX2-only CPU"), so there the same 16 partial sums are kept as two
 * 8-lane halves, each summed in its own sweep over `in` (the second reads the weights from L1), and reduced with the
 * same tree: the same additions per output element, the same bits as the AVX-512 build.
 * Built at first use by kangaroo_backends.native with the system C compiler; never required (plain path otherwise).
 */
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* how far ahead of the current weight element the stream is prefetched (floats; 36 KB, measured on 576-wide rows), and
 * into which cache level (__builtin_prefetch locality 2 = prefetcht1 = L2) */
#define PREFETCH 9216
#define PREFETCH_LOCALITY 2

/* In a KERNEL (passing its NP on): the outputs of weight rows r..r+m-1 for its NP input rows, each its reduced lane
 * sums (sums[j * NP + p]) plus, in order, the elements from K0 on that no whole 16-element step covered */
#define STORE_ROWS(K0, NP)                                                                                \
    for (int j = 0; j < m; j++)                                                                           \
        for (int p = 0; p < NP; p++) {                                                                    \
            const float *wr = w + (r + j) * in;                                                           \
            float s = sums[j * NP + p];                                                                   \
            for (long t = (K0); t < in; t++) s += wr[t] * x[p * in + t];                                  \
            y[p * out + r + j] = s;                                                                       \
        }

#if defined(__AVX512F__)
static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }

static inline float hsum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* hsum16 of 16 vectors at once: lane i of the result is hsum16(v[i]), computed with exactly hsum16's additions (the
 * same pairs in the same order), as 15 vector adds of shuffled halves instead of 16 separate reductions. With 8 rows
 * and 2 weight rows per step the 16 reductions cost as much as a tenth of the step's FMAs. */
static inline v16 hsum16x16(const v16 *v) {
    v16 s[8], u[4], c[2];
    for (int i = 0; i < 8; i++)  /* lanes l and l + 8 */
        s[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  /* then l and l + 4 */
        u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(s[2 * i], s[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  /* b0 + b2, b1 + b3 */
        c[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Output rows r0..r1 for NP input rows, R weight rows at a time (R streams in flight; R*NP accumulators). The
 * arithmetic per output element is the same in the full-block and the remainder branch. */
#define KERNEL(NP, R)                                                                                     \
static void rows_##NP(const float *x, const float *w, float *y, long in, long out, long r0, long r1) {    \
    for (long r = r0; r < r1; r += R) {                                                                   \
        long m = r1 - r < R ? r1 - r : R;                                                                 \
        v16 acc[R][NP];                                                                                   \
        for (int j = 0; j < R; j++)                                                                       \
            for (int p = 0; p < NP; p++) acc[j][p] = (v16){0};                                            \
        long k = 0;                                                                                       \
        if (m == R) {                                                                                     \
            for (; k + 16 <= in; k += 16) {                                                               \
                v16 u[R];                                                                                 \
                for (int j = 0; j < R; j++) {                                                             \
                    __builtin_prefetch(w + (r + j) * in + k + PREFETCH, 0, PREFETCH_LOCALITY);                               \
                    u[j] = load16(w + (r + j) * in + k);                                                  \
                }                                                                                         \
                for (int p = 0; p < NP; p++) {                                                            \
                    v16 xv = load16(x + p * in + k);                                                      \
                    for (int j = 0; j < R; j++) acc[j][p] += u[j] * xv;                                   \
                }                                                                                         \
            }                                                                                             \
        } else {                                                                                          \
            for (; k + 16 <= in; k += 16)                                                                 \
                for (int j = 0; j < m; j++) {                                                             \
                    v16 u = load16(w + (r + j) * in + k);                                                 \
                    for (int p = 0; p < NP; p++) acc[j][p] += u * load16(x + p * in + k);                 \
                }                                                                                         \
        }                                                                                                 \
        float sums[R * NP + 15];  /* sums[j * NP + p] = hsum16(acc[j][p]), 16 at a time where there are 8+ */   \
        if (R * NP >= 8)                                                                                  \
            for (int g = 0; g < R * NP; g += 16) {                                                        \
                v16 group[16];                                                                            \
                for (int i = 0; i < 16; i++)                                                              \
                    group[i] = g + i < R * NP ? acc[(g + i) / NP][(g + i) % NP] : (v16){0};               \
                v16 h = hsum16x16(group);                                                                 \
                memcpy(sums + g, &h, sizeof h);                                                           \
            }                                                                                             \
        else                                                                                              \
            for (int i = 0; i < R * NP; i++) sums[i] = hsum16(acc[i / NP][i % NP]);                       \
        STORE_ROWS(k, NP)                                                                                 \
    }                                                                                                     \
}
/* 4 weight rows per step up to 4 input rows (16 accumulators), 2 beyond (measured best on 576/1536-wide rows) */
KERNEL(1, 4) KERNEL(2, 4) KERNEL(3, 2) KERNEL(4, 2) KERNEL(5, 2) KERNEL(6, 2) KERNEL(7, 2) KERNEL(8, 2)
#else
static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

/* hsum16 of a vector given as its halves' sum a = v[0:8] + v[8:16] (hsum16's first step): its remaining additions */
static inline float hsum8(v8 a) {
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* hsum8 of 8 vectors at once (lane i: hsum8(a[i])), with exactly hsum8's additions */
static inline v8 hsum8x8(const v8 *a) {
    v8 s[4], u[2];
    for (int i = 0; i < 4; i++)  /* lanes m and m + 4 */
        s[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)  /* b0 + b2, b1 + b3 */
        u[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* KERNEL's arithmetic in 8-lane halves: lanes 0-7 of every 16-element step in one sweep over `in`, lanes 8-15 in a
 * second (R*NP accumulators live at a time, within AVX2's 16 registers), then each output's halves added and reduced
 * as hsum16 does */
#define KERNEL(NP, R)                                                                                     \
static void rows_##NP(const float *x, const float *w, float *y, long in, long out, long r0, long r1) {    \
    for (long r = r0; r < r1; r += R) {                                                                   \
        long m = r1 - r < R ? r1 - r : R;                                                                 \
        long k16 = in & ~15L;                                                                             \
        v8 half[2][R][NP];                                                                                \
        for (int h = 0; h < 2; h++) {                                                                     \
            v8 acc[R][NP];                                                                                \
            for (int j = 0; j < R; j++)                                                                   \
                for (int p = 0; p < NP; p++) acc[j][p] = (v8){0};                                         \
            if (m == R) {                                                                                 \
                for (long k = 8 * h; k < k16; k += 16) {                                                  \
                    v8 u[R];                                                                              \
                    for (int j = 0; j < R; j++) {                                                         \
                        if (!h) __builtin_prefetch(w + (r + j) * in + k + PREFETCH, 0, PREFETCH_LOCALITY); \
                        u[j] = load8(w + (r + j) * in + k);                                               \
                    }                                                                                     \
                    for (int p = 0; p < NP; p++) {                                                        \
                        v8 xv = load8(x + p * in + k);                                                    \
                        for (int j = 0; j < R; j++) acc[j][p] += u[j] * xv;                               \
                    }                                                                                     \
                }                                                                                         \
            } else {                                                                                      \
                for (long k = 8 * h; k < k16; k += 16)                                                    \
                    for (int j = 0; j < m; j++) {                                                         \
                        v8 u = load8(w + (r + j) * in + k);                                               \
                        for (int p = 0; p < NP; p++) acc[j][p] += u * load8(x + p * in + k);              \
                    }                                                                                     \
            }                                                                                             \
            memcpy(half[h], acc, sizeof acc);                                                             \
        }                                                                                                 \
        float sums[R * NP + 7];  /* sums[j * NP + p] = hsum16 of output (j, p) */                        \
        for (int g = 0; g < R * NP; g += 8) {                                                             \
            v8 group[8];                                                                                  \
            for (int i = 0; i < 8; i++)                                                                   \
                group[i] = g + i < R * NP ? half[0][(g + i) / NP][(g + i) % NP] + half[1][(g + i) / NP][(g + i) % NP] \
                                          : (v8){0};                                                      \
            v8 h = hsum8x8(group);                                                                        \
            memcpy(sums + g, &h, sizeof h);                                                               \
        }                                                                                                 \
        STORE_ROWS(k16, NP)                                                                               \
    }                                                                                                     \
}
/* weight rows per step: R * NP accumulators + R weight vectors within 16 registers */
KERNEL(1, 4) KERNEL(2, 4) KERNEL(3, 2) KERNEL(4, 2) KERNEL(5, 1) KERNEL(6, 1) KERNEL(7, 1) KERNEL(8, 1)
#endif

typedef void (*rows_fn)(const float *, const float *, float *, long, long, long, long);
static const rows_fn ROWS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

/* 0 on success, -1 for n < 1. Blocks of 32 weight rows are spread over threads. More than 8 input rows go through
 * a block in chunks of 8 (the last one the rest), each chunk with the 8-row (or rest-row) kernel: a row's arithmetic
 * is the one it gets in any chunk, while the block's weights, read from memory by the first chunk, are still in
 * the core's L2 cache for the next (32 rows of 1536 floats are 192 KB). Before, every chunk of 8 was a call of its
 * own that streamed every weight again: a ragged pass of 4 streams' verify rows (about 14) read the model twice. */
int small_batch_linear(const float *x, const float *w, float *y, long n, long in, long out, int threads) {
    if (n < 1) return -1;
    const long block = 32;
    long blocks = (out + block - 1) / block;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long b = 0; b < blocks; b++) {
        long r0 = b * block, r1 = r0 + block < out ? r0 + block : out;
        for (long c = 0; c < n; c += 8) {
            long rows = n - c < 8 ? n - c : 8;
            ROWS[rows](x + c * in, w, y + c * out, in, out, r0, r1);
        }
    }
    return 0;
}

int small_batch_linear_max_rows(void) { return 8; }
