/* y[n, N] = x[n, K] · W^T for a weight kept in GGUF-style blocks of 32 along K, every block read once for all n rows
 * (kangaroo's 4-bit verify kernel; see kangaroo_backends/block_weights.py for the layouts and why).
 *
 * Two families of blocks, repacked from the GGUF file once at export:
 *   q4  codes [N][K/32][16] bytes, 4-bit q in 0..15 (element j in the low nibble of byte j, element j + 16 in its high
 *       nibble), scales s and mins m [N][K/32] float32: w = s·q + m       (Q4_0, Q4_1, Q4_K)
 *   q8  codes [N][K/32][32] int8 q, scales [N][K/sub] float32 (sub = 32 or 16 elements per scale): w = s·q
 *                                                                            (Q8_0, Q5_0, Q6_K)
 * Two kinds of activations:
 *   int8     each row's x is quantized per block of 32 (scale amax/127, round to nearest even), the block dot products
 *            are integer (exact), their scaled sum runs in one fixed order: the lossy-by-choice speed path;
 *   float32  the block is dequantized to float32 (exactly the values transformers' dequantization gives) and
 *            multiplied in float32 (one fixed order too).
 *
 * Row-exact: a row's arithmetic never depends on how many rows come with it, which output columns are computed
 * together, or the thread count; the AVX2 and AVX-512-VNNI paths give the same integers (maddubs+madd and dpbusd sum
 * the same four products per lane) and the same float operations, so they agree bit for bit too. That is what keeps
 * Kangaroo's n-row verify passes equal to its target's one-row passes.
 *
 * How the rows share a block: the block's codes are loaded and unpacked once into a register, then multiplied by up to
 * 8 rows' activations (more rows: the next 8 read the same column again, from L1). The per-block integer sums of 8
 * blocks are reduced to one vector together (one hadd tree instead of eight), then scaled by the 8 blocks' scales at
 * once: a block costs about three vector operations per row, so 8 rows cost little more than the one-row memory stream.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QBLOCK 32
#define QGROUP 8      /* blocks reduced together */
#define QTILE 8       /* rows sharing one unpacked block */

enum { FAMILY_Q4 = 0, FAMILY_Q8 = 1 };
enum { ACT_INT8 = 0, ACT_FLOAT32 = 1 };
enum { ISA_NONE = 0, ISA_AVX2 = 1, ISA_VNNI = 2 };

typedef struct {
    int family, sub;            /* sub: elements per scale (q8: 32 or 16; q4: 32) */
    long n, k;                  /* output columns, inner size (a multiple of 32) */
    const uint8_t *codes;
    const float *scales, *mins; /* mins: q4 only */
} block_weight;

/* one call's activations: float rows, or their int8 quantization (codes, per-block scale d and d·Σq) */
typedef struct {
    int kind;
    long rows, k, blocks;
    const float *x;
    int8_t *q;
    float *d, *dsum;
    /* the same, rows in lanes (for LANES_FROM rows on): per tile of 8 rows and block, 8 vectors of 32 bytes (see
     * interleave()),
     * d and d·Σq [block][8 rows]; q8 weights on VNNI read the codes offset by +128 (unsigned) */
    uint8_t *lanes;
    float *lanes_d, *lanes_dsum;
    /* q4, few rows: per row and pair of blocks (b, b + 1), 64 bytes — elements 0-15 of b and of b + 1, then elements
     * 16-31 of both (what one load of the pair's nibbles unpacks to); d and d·Σq per group of 8 blocks in the order
     * the pairs reduce to (PAIR_ORDER), zero past the last block */
    int8_t *pairs;
    float *pair_d, *pair_dsum;
} block_acts;

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define QX86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

static int forced_isa = -1;

/* The best path this CPU has, at most the one KANGAROO_ISA names (avx2 | avx512-vnni; unset or anything else: no
 * cap, the Python side refuses other values in one line): a CPU with AVX-512 runs the AVX2 path as a CPU without it
 * would (CI runs the kernel's tests both ways). Read once: the variable is set before the process starts. */
static int available_isa(void) {
    static int cached = -2;  /* any thread may read it first: each computes the same value */
    int cap = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (cap == -2) {
        const char *want = getenv("KANGAROO_ISA");
        cap = !want ? -1 : !strcmp(want, "avx2") ? ISA_AVX2 : !strcmp(want, "avx512-vnni") ? ISA_VNNI : -1;
        __atomic_store_n(&cached, cap, __ATOMIC_RELAXED);
    }
    __builtin_cpu_init();
    int isa = ISA_NONE;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = ISA_AVX2;
    if (isa && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512bw"))
        isa = ISA_VNNI;
    return cap >= 0 && cap < isa ? cap : isa;
}

int block_matmul_isa(void) { return forced_isa >= 0 ? forced_isa : available_isa(); }

/* Tests run each path the CPU has: isa 0, 1 or 2 (never above what it has, or KANGAROO_ISA allows; -1: automatic). */
int block_matmul_force_isa(int isa) {
    forced_isa = -1;
    if (isa > available_isa()) return -1;
    forced_isa = isa;
    return 0;
}

/* ---- activations ---------------------------------------------------------------------------------------------- */
AVX2 static void quantize_rows(block_acts *a) {
    for (long r = 0; r < a->rows; r++)
        for (long b = 0; b < a->blocks; b++) {
            const float *x = a->x + r * a->k + b * QBLOCK;
            __m256 v[4], m = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.0f);
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(x + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            float amax = _mm_cvtss_f32(h), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            __m256i q[4];
            for (int i = 0; i < 4; i++)  /* round to nearest even (the default rounding mode) */
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            int8_t *out = a->q + r * a->k + b * QBLOCK;
            int sum = 0;
            for (int i = 0; i < 4; i++) {
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, q[i]);
                for (int j = 0; j < 8; j++) {
                    out[8 * i + j] = (int8_t)lanes[j];
                    sum += lanes[j];
                }
            }
            a->d[r * a->blocks + b] = d;
            a->dsum[r * a->blocks + b] = d * (float)sum;
        }
}

/* the rows in lanes (see block_acts): 0 when out of memory */
static int interleave(block_acts *a, int offset128) {
    long tiles = (a->rows + QTILE - 1) / QTILE, nb = a->blocks;
    a->lanes = malloc((size_t)(tiles * nb * 256));
    a->lanes_d = calloc((size_t)(tiles * nb * 8), sizeof(float));
    a->lanes_dsum = calloc((size_t)(tiles * nb * 8), sizeof(float));
    if (!a->lanes || !a->lanes_d || !a->lanes_dsum) return 0;
    memset(a->lanes, offset128 ? 128 : 0, (size_t)(tiles * nb * 256));  /* rows past the last: activations 0 */
    for (long r = 0; r < a->rows; r++) {
        long t = r / QTILE, p = r % QTILE;
        for (long b = 0; b < nb; b++) {
            const int8_t *q = a->q + r * a->k + b * QBLOCK;
            /* vector (g, quad) of the block: lanes 0-3 hold rows 4·quad.. group g, lanes 4-7 the same rows' group
             * g + 4 (the halves an in-lane shuffle of the unpacked weights gives) */
            uint8_t *out = a->lanes + (t * nb + b) * 256 + (p / 4) * 32 + (p % 4) * 4;
            for (int g = 0; g < 8; g++)
                for (int j = 0; j < 4; j++)
                    out[(g % 4) * 64 + (g / 4) * 16 + j] = (uint8_t)(q[g * 4 + j] + (offset128 ? 128 : 0));
            a->lanes_d[(t * nb + b) * 8 + p] = a->d[r * nb + b];
            a->lanes_dsum[(t * nb + b) * 8 + p] = a->dsum[r * nb + b];
        }
    }
    return 1;
}

/* the q4 few-rows layout (see block_acts): 0 when out of memory */
static const int PAIR_ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7};  /* lane L of a group's reduced sums holds block PAIR_ORDER[L] */

static int pair_up(block_acts *a) {
    long nb = a->blocks, npairs = (nb + 1) / 2, groups = (nb + 7) / 8;
    a->pairs = calloc((size_t)(a->rows * npairs * 64), 1);
    a->pair_d = calloc((size_t)(a->rows * groups * 8), sizeof(float));
    a->pair_dsum = calloc((size_t)(a->rows * groups * 8), sizeof(float));
    if (!a->pairs || !a->pair_d || !a->pair_dsum) return 0;
    for (long r = 0; r < a->rows; r++) {
        for (long b = 0; b < nb; b++) {
            const int8_t *q = a->q + r * a->k + b * QBLOCK;
            int8_t *out = a->pairs + (r * npairs + b / 2) * 64 + (b % 2) * 16;
            memcpy(out, q, 16);
            memcpy(out + 32, q + 16, 16);
        }
        for (long g = 0; g < groups; g++)
            for (int lane = 0; lane < 8; lane++) {
                long b = g * 8 + PAIR_ORDER[lane];
                if (b >= nb) continue;
                a->pair_d[(r * groups + g) * 8 + lane] = a->d[r * nb + b];
                a->pair_dsum[(r * groups + g) * 8 + lane] = a->dsum[r * nb + b];
            }
    }
    return 1;
}

/* ---- shared pieces -------------------------------------------------------------------------------------------- */
AVX2 static inline __m256i unpack_q4(const uint8_t *codes) {
    __m128i packed = _mm_loadu_si128((const __m128i *)codes);
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* lane i of the result = the sum of the 8 lanes of v[i] (integer: any order is exact). hadd works within each 128-bit
 * half, so after two rounds the low half holds v0..v3's sums over lanes 0-3 and the high half over lanes 4-7. */
AVX2 static inline __m256i reduce8(const __m256i *v) {
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

AVX2 static inline float hsum(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* the first `valid` lanes of p (the rest 0) */
AVX2 static inline __m256 load_part(const float *p, long valid) {
    if (valid >= 8) return _mm256_loadu_ps(p);
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), index));
}

/* the integer dot product of 32 weight codes and 32 int8 activations, 8 lanes of 4 products each */
#define DOT_Q4_AVX2(w, a) _mm256_madd_epi16(_mm256_maddubs_epi16((w), (a)), _mm256_set1_epi16(1))
#define DOT_Q4_VNNI(w, a) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (w), (a))
/* q8 codes are signed: |w| times a with w's sign (the largest pair sum, 2·128·127, fits maddubs' int16) */
#define DOT_Q8_AVX2(w, a) _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8((w), (w)), _mm256_sign_epi8((a), (w))), \
                                            _mm256_set1_epi16(1))
#define DOT_Q8_VNNI(w, a) _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8((w), (w)), _mm256_sign_epi8((a), (w)))

/* ---- int8 activations --------------------------------------------------------------------------------------------
 * The arithmetic of one output element, whatever the path: the weight's scale units (blocks of 32, or halves of 16
 * for sub = 16) u = 0, 1, ... each give an exact integer dot product t_u; accumulator u mod 8 takes
 * fma(float(t_u), s_u · d_b(u), acc), unit after unit; q4 adds fma(m_b, d_b·Σq_b, macc) per block the same way; the
 * result is the 8 accumulators summed in hsum's tree, plus the 8 macc summed in the same tree.
 *
 * Two ways to run it. Few rows (below LANES_FROM): per row, 8 units' dot products reduced to one vector (unit i in lane
 * i) and scaled at once: accumulator i is lane i. More rows: rows in lanes — the activations of 8 rows interleaved four
 * bytes at a time, one weight group of 4 bytes broadcast to all lanes, so a multiply-add gives each row its own partial
 * sum (no reduction); accumulator i is the vector acc[i], row p its lane p. Same operations on the same values. */
#define LANES_FROM 3
#define Q4_LANES_FROM 5  /* q4's few-rows kernel (two blocks per vector) is the cheaper one up to 4 rows */

/* q8 blocks of sub = 16: the 8 half-blocks of 4 blocks' dot products as 8 vectors (lanes of the other half zeroed) */
AVX2 static inline void halves(const __m256i *dots, __m256i *out) {
    const __m256i first = _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0);
    for (int i = 0; i < 4; i++) {
        out[2 * i] = _mm256_and_si256(dots[i], first);
        out[2 * i + 1] = _mm256_andnot_si256(first, dots[i]);
    }
}

/* [d0 d0 d1 d1 d2 d2 d3 d3] from d[0..valid) */
AVX2 static inline __m256 doubled(const float *d, long valid) {
    float t[8] = {0};
    for (long i = 0; i < valid; i++) t[2 * i] = t[2 * i + 1] = d[i];
    return _mm256_loadu_ps(t);
}

#define FEW_ROWS_KERNEL(NAME, ISA, FAMILY, DOT)                                                                        \
ISA static inline __attribute__((always_inline)) void NAME(const block_weight *w, const block_acts *a, float *y,       \
                                                          long ystride, long c, long r0, int np) {                   \
    const long nb = w->k / QBLOCK;                                                                                     \
    const int halfs = FAMILY == FAMILY_Q8 && w->sub == 16;                                                            \
    const long per = halfs ? QGROUP / 2 : QGROUP; /* blocks per group of 8 units */                                     \
    const uint8_t *codes = w->codes + c * nb * (FAMILY == FAMILY_Q4 ? 16 : 32);                                       \
    __m256 acc[LANES_FROM], macc[LANES_FROM];                                                                         \
    for (int p = 0; p < np; p++) acc[p] = macc[p] = _mm256_setzero_ps();                                              \
    for (long g = 0; g < nb; g += per) {                                                                              \
        long valid = nb - g < per ? nb - g : per;                                                                     \
        __m256i wq[QGROUP];                                                                                            \
        for (long i = 0; i < valid; i++)                                                                              \
            wq[i] = FAMILY == FAMILY_Q4 ? unpack_q4(codes + (g + i) * 16)                                            \
                                        : _mm256_loadu_si256((const __m256i *)(codes + (g + i) * 32));               \
        __m256 ws = halfs ? load_part(w->scales + (c * nb + g) * 2, 2 * valid) : load_part(w->scales + c * nb + g, valid); \
        __m256 wm = FAMILY == FAMILY_Q4 ? load_part(w->mins + c * nb + g, valid) : _mm256_setzero_ps();              \
        for (int p = 0; p < np; p++) {                                                                                \
            __m256i dots[QGROUP], units[QGROUP];                                                                        \
            for (long i = 0; i < per; i++) {                                                                          \
                if (i >= valid) { dots[i] = _mm256_setzero_si256(); continue; }                                       \
                __m256i av = _mm256_loadu_si256((const __m256i *)(a->q + (r0 + p) * a->k + (g + i) * QBLOCK));        \
                dots[i] = DOT(wq[i], av);                                                                             \
            }                                                                                                         \
            const float *da = a->d + (r0 + p) * a->blocks + g;                                                        \
            __m256 s;                                                                                                 \
            if (halfs) {                                                                                              \
                halves(dots, units);                                                                                  \
                s = _mm256_mul_ps(ws, doubled(da, valid));                                                            \
            } else {                                                                                                  \
                for (int i = 0; i < QGROUP; i++) units[i] = dots[i];                                                   \
                s = _mm256_mul_ps(ws, load_part(da, valid));                                                          \
            }                                                                                                         \
            acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(units)), s, acc[p]);                                  \
            if (FAMILY == FAMILY_Q4)                                                                                  \
                macc[p] = _mm256_fmadd_ps(wm, load_part(a->dsum + (r0 + p) * a->blocks + g, valid), macc[p]);        \
        }                                                                                                             \
    }                                                                                                                 \
    for (int p = 0; p < np; p++) y[(r0 + p) * ystride] = hsum(acc[p]) + hsum(macc[p]);                           \
}

FEW_ROWS_KERNEL(q8_few_avx2, AVX2, FAMILY_Q8, DOT_Q8_AVX2)
FEW_ROWS_KERNEL(q8_few_vnni, VNNI, FAMILY_Q8, DOT_Q8_VNNI)

/* q4, few rows, two blocks per vector: one 32-byte load holds the nibbles of blocks b and b + 1; its low nibbles are
 * elements 0-15 of both, its high nibbles elements 16-31 (GGUF's order), so two multiply-adds against the pair layout
 * of the activations give lanes 0-3 block b's partial sums and lanes 4-7 block b + 1's. Three hadds reduce a group of
 * 8 blocks to one vector, block PAIR_ORDER[L] in lane L: accumulator slots follow that order on every path (SLOT). */
#define PAIR_DOT_AVX2(acc, w, a) _mm256_add_epi32((acc), DOT_Q4_AVX2((w), (a)))
#define PAIR_DOT_VNNI(acc, w, a) _mm256_dpbusd_epi32((acc), (w), (a))
#define Q4_PAIRS_KERNEL(NAME, ISA, PAIR_DOT)                                                                           \
ISA static inline __attribute__((always_inline)) void NAME(const block_weight *w, const block_acts *a, float *y,       \
                                                          long ystride, long c, long r0, int np) {                   \
    const long nb = w->k / QBLOCK, npairs = (nb + 1) / 2, groups = (nb + 7) / 8;                                       \
    const uint8_t *codes = w->codes + c * nb * 16;                                                                    \
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), nibbles = _mm256_set1_epi8(0x0F);               \
    __m256 acc[Q4_LANES_FROM], macc[Q4_LANES_FROM];                                                                   \
    for (int p = 0; p < np; p++) acc[p] = macc[p] = _mm256_setzero_ps();                                              \
    for (long g = 0; g < nb; g += QGROUP) {                                                                           \
        long valid = nb - g < QGROUP ? nb - g : QGROUP;                                                               \
        __m256i lo[4], hi[4];                                                                                         \
        for (int j = 0; j < 4; j++) {                                                                                 \
            long b = g + 2 * j;                                                                                       \
            if (b >= nb) { lo[j] = hi[j] = _mm256_setzero_si256(); continue; }                                        \
            __m256i v = b + 1 < nb ? _mm256_loadu_si256((const __m256i *)(codes + b * 16))                            \
                                   : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(codes + b * 16)));    \
            lo[j] = _mm256_and_si256(v, nibbles);                                                                     \
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);                                               \
        }                                                                                                             \
        __m256 ws = _mm256_permutevar8x32_ps(load_part(w->scales + c * nb + g, valid), order);                       \
        __m256 wm = _mm256_permutevar8x32_ps(load_part(w->mins + c * nb + g, valid), order);                         \
        for (int p = 0; p < np; p++) {                                                                                \
            const int8_t *ap = a->pairs + ((r0 + p) * npairs + g / 2) * 64;                                           \
            __m256i v[4];                                                                                             \
            for (int j = 0; j < 4; j++) {                                                                             \
                if (g + 2 * j >= nb) { v[j] = _mm256_setzero_si256(); continue; }                                     \
                __m256i t = PAIR_DOT(_mm256_setzero_si256(), lo[j], _mm256_loadu_si256((const __m256i *)(ap + j * 64))); \
                v[j] = PAIR_DOT(t, hi[j], _mm256_loadu_si256((const __m256i *)(ap + j * 64 + 32)));                  \
            }                                                                                                         \
            __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));              \
            const float *pd = a->pair_d + ((r0 + p) * groups + g / 8) * 8;                                            \
            const float *ps = a->pair_dsum + ((r0 + p) * groups + g / 8) * 8;                                         \
            acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(ws, _mm256_loadu_ps(pd)), acc[p]);          \
            macc[p] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(ps), macc[p]);                                              \
        }                                                                                                             \
    }                                                                                                                 \
    for (int p = 0; p < np; p++) y[(r0 + p) * ystride] = hsum(acc[p]) + hsum(macc[p]);                                \
}
Q4_PAIRS_KERNEL(q4_few_avx2, AVX2, PAIR_DOT_AVX2)
Q4_PAIRS_KERNEL(q4_few_vnni, VNNI, PAIR_DOT_VNNI)

/* hsum's tree over 8 vectors, lane-wise: lane p of the result is what hsum gives for a vector of lanes acc[i][p] */
AVX2 static inline __m256 tree8(const __m256 *v) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
                         _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])));
}

/* one group of 4 weight bytes times 8 rows' 4 activation bytes each (rows in lanes), added to dot */
#define LANE_Q4_AVX2(dot, wb, al) _mm256_add_epi32((dot), _mm256_madd_epi16(_mm256_maddubs_epi16((wb), (al)), _mm256_set1_epi16(1)))
#define LANE_Q4_VNNI(dot, wb, al) _mm256_dpbusd_epi32((dot), (wb), (al))
#define LANE_Q8_AVX2(dot, wb, al) _mm256_add_epi32((dot), _mm256_madd_epi16(                                         \
    _mm256_maddubs_epi16(_mm256_sign_epi8((wb), (wb)), _mm256_sign_epi8((al), (wb))), _mm256_set1_epi16(1)))
/* activations offset by +128 (unsigned), signed weights: Σ (a + 128)·w; the caller takes 128·Σw back */
#define LANE_Q8_VNNI(dot, wb, al) _mm256_dpbusd_epi32((dot), (al), (wb))

#define LANES_KERNEL(NAME, ISA, FAMILY, LANE, OFFSET)                                                                  \
ISA static inline __attribute__((always_inline)) void NAME(const block_weight *w, const block_acts *a, float *y,       \
                                                          long ystride, long c, long r0, int np) {                   \
    const long nb = w->k / QBLOCK;                                                                                     \
    const int halfs = FAMILY == FAMILY_Q8 && w->sub == 16;                                                            \
    const uint8_t *codes = w->codes + c * nb * (FAMILY == FAMILY_Q4 ? 16 : 32);                                       \
    const uint8_t *al = a->lanes + (r0 / QTILE) * nb * 256;                                                            \
    const float *ld = a->lanes_d + (r0 / QTILE) * nb * 8, *ls = a->lanes_dsum + (r0 / QTILE) * nb * 8;                 \
    __m256 acc[QGROUP], macc[QGROUP];                                                                                   \
    for (int i = 0; i < QGROUP; i++) acc[i] = macc[i] = _mm256_setzero_ps();                                           \
    for (long b0 = 0; b0 < nb; b0 += QGROUP)  /* unrolled: every accumulator index a constant, acc[] in registers */ \
    _Pragma("GCC unroll 8") for (int i = 0; i < QGROUP; i++) {                                                         \
        const long b = b0 + i;                                                                                        \
        if (b >= nb) break;                                                                                           \
        __m256i wq = FAMILY == FAMILY_Q4 ? unpack_q4(codes + b * 16)                                                  \
                                         : _mm256_loadu_si256((const __m256i *)(codes + b * 32));                    \
        __m256 da = _mm256_loadu_ps(ld + b * 8);                                                                      \
        /* an in-lane shuffle puts group g in lanes 0-3 and group g + 4 in lanes 4-7; rows 0-3 multiply in one
         * vector, rows 4-7 in another; the halves are added at the end (integers: exact) */             \
        __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();                                             \
        const uint8_t *ab = al + b * 256;                                                                             \
        __m256i w0 = _mm256_shuffle_epi32(wq, 0x00), w1 = _mm256_shuffle_epi32(wq, 0x55);                             \
        __m256i w2 = _mm256_shuffle_epi32(wq, 0xAA), w3 = _mm256_shuffle_epi32(wq, 0xFF);                             \
        d0 = LANE(d0, w0, _mm256_loadu_si256((const __m256i *)(ab + 0)));                                             \
        d0 = LANE(d0, w1, _mm256_loadu_si256((const __m256i *)(ab + 64)));                                            \
        d0 = LANE(d0, w2, _mm256_loadu_si256((const __m256i *)(ab + 128)));                                           \
        d0 = LANE(d0, w3, _mm256_loadu_si256((const __m256i *)(ab + 192)));                                           \
        if (np > 4) {  /* rows 4-7 (up to 4 rows their lanes stay 0 and are never read) */                           \
            d1 = LANE(d1, w0, _mm256_loadu_si256((const __m256i *)(ab + 32)));                                        \
            d1 = LANE(d1, w1, _mm256_loadu_si256((const __m256i *)(ab + 96)));                                        \
            d1 = LANE(d1, w2, _mm256_loadu_si256((const __m256i *)(ab + 160)));                                       \
            d1 = LANE(d1, w3, _mm256_loadu_si256((const __m256i *)(ab + 224)));                                       \
        }                                                                                                             \
        __m256i first = _mm256_permute2x128_si256(d0, d1, 0x20), second = _mm256_permute2x128_si256(d0, d1, 0x31);    \
        if (halfs) {  /* elements 0-15 (groups 0-3) and 16-31 are units of their own */                               \
            __m256i units[2] = {first, second};                                                                       \
            for (int h = 0; h < 2; h++) {                                                                             \
                const long u = 2 * b + h, slot = (2 * i + h) % 8;  /* = u mod 8 */                                    \
                if (OFFSET) units[h] = _mm256_sub_epi32(units[h], _mm256_set1_epi32(128 * wsum16(wq, h)));           \
                __m256 s = _mm256_mul_ps(_mm256_set1_ps(w->scales[c * nb * 2 + u]), da);                              \
                acc[slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(units[h]), s, acc[slot]);                              \
            }                                                                                                         \
        }                                                                                                             \
        __m256i dot = _mm256_add_epi32(first, second);                                                                \
        if (halfs) continue;                                                                                          \
        if (OFFSET) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(128 * (wsum16(wq, 0) + wsum16(wq, 1))));            \
        __m256 s = _mm256_mul_ps(_mm256_set1_ps(w->scales[c * nb + b]), da);                                          \
        const int slot = FAMILY == FAMILY_Q4 ? (i % 2) * 4 + i / 2 : i;  /* q4: PAIR_ORDER's lanes */                \
        acc[slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[slot]);                                           \
        if (FAMILY == FAMILY_Q4)                                                                                      \
            macc[slot] = _mm256_fmadd_ps(_mm256_set1_ps(w->mins[c * nb + b]), _mm256_loadu_ps(ls + b * 8), macc[slot]); \
    }                                                                                                                 \
    float out[8], mout[8];                                                                                            \
    _mm256_storeu_ps(out, tree8(acc));                                                                                \
    _mm256_storeu_ps(mout, tree8(macc));                                                                              \
    for (int p = 0; p < np; p++) y[(r0 + p) * ystride] = out[p] + mout[p];                                        \
}

/* Σ of the 16 signed codes of one half of a q8 block (the +128 offset's correction) */
AVX2 static inline int wsum16(__m256i wq, int half) {
    __m128i h = half ? _mm256_extracti128_si256(wq, 1) : _mm256_castsi256_si128(wq);
    __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(_mm_set1_epi8(1), h), _mm_set1_epi16(1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

LANES_KERNEL(q4_lanes_avx2, AVX2, FAMILY_Q4, LANE_Q4_AVX2, 0)
LANES_KERNEL(q8_lanes_avx2, AVX2, FAMILY_Q8, LANE_Q8_AVX2, 0)
LANES_KERNEL(q4_lanes_vnni, VNNI, FAMILY_Q4, LANE_Q4_VNNI, 0)
LANES_KERNEL(q8_lanes_vnni, VNNI, FAMILY_Q8, LANE_Q8_VNNI, 1)

/* rows in lanes for np rows from LANES_FROM on, the few-rows kernel below */
#define INT8_ROWS(NAME, FEW, LANES, ISA, FROM)                                                                         \
ISA static inline __attribute__((always_inline)) void NAME(const block_weight *w, const block_acts *a, float *y,       \
                                                          long ystride, long c, long r0, int np) {                   \
    if (np >= FROM) LANES(w, a, y, ystride, c, r0, np);                                                               \
    else FEW(w, a, y, ystride, c, r0, np);                                                                            \
}
INT8_ROWS(q4_int8_avx2, q4_few_avx2, q4_lanes_avx2, AVX2, Q4_LANES_FROM)
INT8_ROWS(q8_int8_avx2, q8_few_avx2, q8_lanes_avx2, AVX2, LANES_FROM)
INT8_ROWS(q4_int8_vnni, q4_few_vnni, q4_lanes_vnni, VNNI, Q4_LANES_FROM)
INT8_ROWS(q8_int8_vnni, q8_few_vnni, q8_lanes_vnni, VNNI, LANES_FROM)

/* ---- float32 activations ---------------------------------------------------------------------------------------
 * The block's 32 weights dequantized into four vectors (w = s·q + m, or s·q: the values transformers computes), then
 * 4 multiply-adds per row into the row's accumulator: lane j sums elements j, j+8, j+16, j+24 of every block. */
AVX2 static inline void dequantize_block(const block_weight *w, long c, long b, __m256 out[4]) {
    const long nb = w->k / QBLOCK;
    if (w->family == FAMILY_Q4) {
        __m256i q = unpack_q4(w->codes + (c * nb + b) * 16);
        __m256 s = _mm256_set1_ps(w->scales[c * nb + b]), m = _mm256_set1_ps(w->mins[c * nb + b]);
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; i++) out[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), m);
    } else {
        const int8_t *q = (const int8_t *)w->codes + (c * nb + b) * 32;
        for (int i = 0; i < 4; i++) {
            float s = w->sub == 16 ? w->scales[(c * nb + b) * 2 + i / 2] : w->scales[c * nb + b];
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            out[i] = _mm256_mul_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
        }
    }
}

#define F32_KERNEL(NAME, ISA)                                                                                          \
ISA static inline __attribute__((always_inline)) void NAME(const block_weight *w, const block_acts *a, float *y,       \
                                                          long ystride, long c, long r0, int np) {                   \
    const long nb = w->k / QBLOCK;                                                                                     \
    __m256 acc[QTILE];                                                                                                 \
    for (int p = 0; p < np; p++) acc[p] = _mm256_setzero_ps();                                                        \
    for (long b = 0; b < nb; b++) {                                                                                   \
        __m256 wv[4];                                                                                                 \
        dequantize_block(w, c, b, wv);                                                                                \
        for (int p = 0; p < np; p++) {                                                                                \
            const float *x = a->x + (r0 + p) * a->k + b * QBLOCK;                                                      \
            for (int i = 0; i < 4; i++) acc[p] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(x + 8 * i), acc[p]);         \
        }                                                                                                             \
    }                                                                                                                 \
    for (int p = 0; p < np; p++) y[(r0 + p) * ystride] = hsum(acc[p]);                                            \
}

F32_KERNEL(f32_avx2, AVX2)
F32_KERNEL(f32_vnni, VNNI)

/* Columns c0..c1 for every row: QTILE rows at a time per column, into y (row stride ystride, column c0 at y[0]).
 * Each row-count gets its own specialised loop (np a constant), all with the same per-row operations. */
#define COLUMNS(NAME, KERNEL, ISA)                                                                                     \
ISA static void NAME(const block_weight *w, const block_acts *a, float *y, long ystride, long c0, long c1) {          \
    for (long c = c0; c < c1; c++)                                                                                    \
        for (long r0 = 0; r0 < a->rows; r0 += QTILE) {                                                                 \
            long left = a->rows - r0;                                                                                 \
            float *yc = y + (c - c0);                                                                                 \
            switch (left >= QTILE ? QTILE : left) {                                                                     \
            case 1: KERNEL(w, a, yc, ystride, c, r0, 1); break;                                                       \
            case 2: KERNEL(w, a, yc, ystride, c, r0, 2); break;                                                       \
            case 3: KERNEL(w, a, yc, ystride, c, r0, 3); break;                                                       \
            case 4: KERNEL(w, a, yc, ystride, c, r0, 4); break;                                                       \
            case 5: KERNEL(w, a, yc, ystride, c, r0, 5); break;                                                       \
            case 6: KERNEL(w, a, yc, ystride, c, r0, 6); break;                                                       \
            case 7: KERNEL(w, a, yc, ystride, c, r0, 7); break;                                                       \
            default: KERNEL(w, a, yc, ystride, c, r0, 8); break;                                                      \
            }                                                                                                         \
        }                                                                                                             \
}

COLUMNS(columns_q4_int8_avx2, q4_int8_avx2, AVX2)
COLUMNS(columns_q8_int8_avx2, q8_int8_avx2, AVX2)
COLUMNS(columns_q4_int8_vnni, q4_int8_vnni, VNNI)
COLUMNS(columns_q8_int8_vnni, q8_int8_vnni, VNNI)
COLUMNS(columns_f32_avx2, f32_avx2, AVX2)
COLUMNS(columns_f32_vnni, f32_vnni, VNNI)

typedef void (*columns_fn)(const block_weight *, const block_acts *, float *, long, long, long);

static columns_fn pick(const block_weight *w, int kind) {
    int isa = block_matmul_isa();
    if (isa == ISA_NONE) return NULL;
    if (kind == ACT_FLOAT32) return isa == ISA_VNNI ? columns_f32_vnni : columns_f32_avx2;
    if (w->family == FAMILY_Q4) return isa == ISA_VNNI ? columns_q4_int8_vnni : columns_q4_int8_avx2;
    return isa == ISA_VNNI ? columns_q8_int8_vnni : columns_q8_int8_avx2;
}

#else  /* not x86: no kernel (the caller refuses in one line) */
#define QX86 0
int block_matmul_isa(void) { return 0; }
int block_matmul_force_isa(int isa) { (void)isa; return -1; }
#endif

/* ---- a call: prepare the activations, then columns in chunks (run by the caller's threads) --------------------- */
#define CHUNK 64        /* output columns per work item */
#define LOCAL_ROWS 64   /* up to this many rows a work item writes its results at once (see block_job_chunk) */
typedef struct {
    block_weight w;
    block_acts a;
    float *y;
    long chunk;
#if QX86
    columns_fn run;
#endif
} block_job;

void block_job_free(block_job *job);

/* 0, or -1 (no AVX2), -2 (bad shape), -3 (out of memory). Fills job; the caller runs block_job_chunk(job, i) for i in
 * 0..block_job_chunks(job)-1 (any order, any threads) and then block_job_free(job). */
int block_job_prepare(block_job *job, int family, int sub, long n, long k, const uint8_t *codes, const float *scales,
                      const float *mins, int kind, const float *x, long rows, float *y) {
    memset(job, 0, sizeof *job);
    if (k <= 0 || k % QBLOCK || n <= 0 || rows < 0 || (family != FAMILY_Q4 && family != FAMILY_Q8)
        || (family == FAMILY_Q8 && sub != 16 && sub != 32) || (family == FAMILY_Q4 && !mins))
        return -2;
#if QX86
    job->w = (block_weight){family, family == FAMILY_Q4 ? 32 : sub, n, k, codes, scales, mins};
    job->a = (block_acts){.kind = kind, .rows = rows, .k = k, .blocks = k / QBLOCK, .x = x};
    job->y = y;
    job->chunk = CHUNK;
    job->run = pick(&job->w, kind);
    if (!job->run) return -1;
    if (kind == ACT_INT8 && rows > 0) {
        job->a.q = malloc((size_t)(rows * k) + 64);
        job->a.d = malloc(sizeof(float) * (size_t)(rows * job->a.blocks));
        job->a.dsum = malloc(sizeof(float) * (size_t)(rows * job->a.blocks));
        if (!job->a.q || !job->a.d || !job->a.dsum) {
            block_job_free(job);
            return -3;
        }
        quantize_rows(&job->a);
        if (family == FAMILY_Q4 && !pair_up(&job->a)) {
            block_job_free(job);
            return -3;
        }
        if (rows >= LANES_FROM && !interleave(&job->a, family == FAMILY_Q8 && block_matmul_isa() == ISA_VNNI)) {
            block_job_free(job);
            return -3;
        }
    }
    return 0;
#else
    (void)codes; (void)scales; (void)mins; (void)kind; (void)x; (void)y;
    return -1;
#endif
}

long block_job_chunks(const block_job *job) { return job->a.rows ? (job->w.n + job->chunk - 1) / job->chunk : 0; }

void block_job_chunk(const block_job *job, long i) {
#if QX86
    long c0 = i * job->chunk, c1 = c0 + job->chunk < job->w.n ? c0 + job->chunk : job->w.n, rows = job->a.rows;
    if (rows > LOCAL_ROWS) {
        job->run(&job->w, &job->a, job->y + c0, job->w.n, c0, c1);
        return;
    }
    /* computed into a local block, then copied out row by row: threads working on neighbouring chunks would
     * otherwise write into the same cache lines column after column (measured: 2 threads slower than 1) */
    float local[LOCAL_ROWS * CHUNK];
    job->run(&job->w, &job->a, local, c1 - c0, c0, c1);
    for (long r = 0; r < rows; r++) memcpy(job->y + r * job->w.n + c0, local + r * (c1 - c0), sizeof(float) * (size_t)(c1 - c0));
#else
    (void)job; (void)i;
#endif
}

void block_job_free(block_job *job) {
    free(job->a.q); free(job->a.d); free(job->a.dsum);
    free(job->a.lanes); free(job->a.lanes_d); free(job->a.lanes_dsum);
    free(job->a.pairs); free(job->a.pair_d); free(job->a.pair_dsum);
    job->a.pairs = NULL; job->a.pair_d = job->a.pair_dsum = NULL;
    job->a.q = NULL; job->a.d = job->a.dsum = NULL;
    job->a.lanes = NULL; job->a.lanes_d = job->a.lanes_dsum = NULL;
}

/* The whole product on the calling thread (tests and ctypes callers); same result as any split over threads. */
int block_matmul(int family, int sub, long n, long k, const uint8_t *codes, const float *scales, const float *mins,
                 int kind, const float *x, long rows, float *y) {
    block_job job;
    int status = block_job_prepare(&job, family, sub, n, k, codes, scales, mins, kind, x, rows, y);
    if (status) return status;
    for (long i = 0; i < block_job_chunks(&job); i++) block_job_chunk(&job, i);
    block_job_free(&job);
    return 0;
}
