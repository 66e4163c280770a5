/* Attention for a verify pass (a few new query rows against the KV cache), fp32, row-independent bit for bit.
 *
 * Why: a Kangaroo round verifies n drafted positions in one pass, and its output must equal the target alone, which
 * computes the same positions one pass at a time. PyTorch's SDPA (flash or math) gives a query row slightly different
 * bits depending on how many rows came with it (measured on SmolLM2's shapes: every n >= 2 differs), so greedy
 * decoding could flip at a near-tie. Here every row is computed alone, in a fixed order:
 *
 *   s_j = scale * <q, k_j> + mask_j          summed over the head dimension in order, W keys per vector
 *   p_j = exp(s_j - max_j s_j)              one elementwise exp: the same instructions for every key
 *   out = (sum_j p_j v_j) / (sum_j p_j)      summed over keys strictly in key order
 *
 * A key the mask hides contributes an exact zero, and adding zero changes no float, so a row sees the same sums
 * whether it comes alone (its keys are the cache's prefix) or with later rows and tree siblings masked out between
 * its keys: a verify pass reproduces the one-position passes exactly, for chains and token trees alike.
 * The query heads sharing a KV head (grouped-query attention) read that KV head as it is, without copies.
 * Built at first use by kangaroo_backends.native together with small_batch_linear.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* W: the lanes of one vector, the CPU's register width: 16 floats with AVX-512, else 8 (AVX2). A GCC vector wider
 * than the CPU's registers has no register mode, so every operation on it goes through memory (docs/backends.md,
 * "Kernels on an AVX2-only CPU"). A row's arithmetic does not depend on W: a score sums over the head dimension in
 * order, a weighted sum over keys in key order for each head-dimension element, exp is elementwise and the maximum
 * exact, so both widths give the same bits. W sets how many keys a score block holds and how many head dimensions
 * a vector carries; the counts below, how many independent vectors a loop keeps in registers (32 with AVX-512, 16
 * with AVX2). */
#if defined(__AVX512F__)
#define W 16
#define WEIGH_CHUNKS 4  /* vectors of head dimensions per pass over the keys (64 dimensions) */
#define GROUP 4         /* query vectors weighed together */
#else
#define W 8
#define WEIGH_CHUNKS 4  /* 32 dimensions */
#define GROUP 2
#endif
#define SCORE_VECTORS 8 /* query vectors scored together: independent FMA chains */
typedef float vf __attribute__((vector_size(4 * W)));  /* W float lanes */
typedef int vi __attribute__((vector_size(4 * W)));

static inline vf loadv(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* exp(x) for x <= 0, elementwise (Cody-Waite reduction, degree-6 polynomial, ~1 ulp); 0 below -87 (float underflow,
 * and the masks' -inf / finfo.min). Only ever called on whole vectors, so every key gets the same instructions. */
static inline vf expv(vf x) {
    const vi under = x < -87.0f;  /* all ones where x underflows */
    x = (vf)(((vi)x & ~under) | ((vi)((vf){0} - 87.0f) & under));
    vf t = x * 1.44269504088896341f;
    /* round to nearest even (what rintf gives) with the 1.5 * 2^23 trick: one vector add and subtract, |t| < 2^22 */
    vf n = (t + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;  /* 2^n, n in [-126, 0] here */
    vf y = p * (vf)e;
    return (vf)((vi)y & ~under);
}

/* Scores of every query vector of one KV head against one block of W keys: the block is transposed once, then each
 * score is a sum over the head dimension in order (lane l holds key j0 + l; no lane depends on the others). */
static void score_block(const float *q, long head_stride, long row_stride, long vectors, long rows, const float *k,
                        long k_row_stride, const float *mask, long mask_stride,
                        float *s, long padded, long j0, long keys, long d, float scale, float *kt) {
    long count = keys - j0 < W ? keys - j0 : W;
    for (long l = 0; l < W && j0 + W + l < keys; l++)  /* the next block's keys: on their way while this one runs */
        for (long t = 0; t < d; t += 16) __builtin_prefetch(k + (j0 + W + l) * k_row_stride + t);
    for (long t = 0; t < d; t++)
        for (long l = 0; l < W; l++) kt[t * W + l] = l < count ? k[(j0 + l) * k_row_stride + t] : 0.0f;
    for (long a0 = 0; a0 < vectors; a0 += SCORE_VECTORS) {
        const float *qa[SCORE_VECTORS];
        for (int x = 0; x < SCORE_VECTORS; x++) {  /* vector a: the a / rows-th query head of this KV head, row a % rows */
            long a = a0 + x < vectors ? a0 + x : vectors - 1;
            qa[x] = q + (a / rows) * head_stride + (a % rows) * row_stride;
        }
        vf acc[SCORE_VECTORS];
        for (int x = 0; x < SCORE_VECTORS; x++) acc[x] = (vf){0};
        for (long t = 0; t < d; t++) {
            vf kv = loadv(kt + t * W);
            for (int x = 0; x < SCORE_VECTORS; x++) acc[x] += qa[x][t] * kv;
        }
        for (int x = 0; x < SCORE_VECTORS && a0 + x < vectors; x++) {  /* vector a: query head kv * groups + a / rows, row a % rows */
            long a = a0 + x;
            float extra[W] = {0};
            if (mask)
                for (long l = 0; l < count; l++) extra[l] = mask[(a % rows) * mask_stride + j0 + l];
            float *out = s + a * padded + j0;
            storev(out, acc[x] * scale + loadv(extra));
            for (long l = count; l < W; l++) out[l] = -INFINITY;  /* padding: expv(-inf) = 0 */
        }
    }
}

/* s <- exp(s - max s) over one query vector's scores s[keys] (padded to W with -inf). */
static void exponentiate(float *s, long keys) {
    long padded = (keys + W - 1) & ~(long)(W - 1);
    vf mv = (vf){0} - INFINITY;  /* the maximum is exact in any order; W lanes, then across them */
    for (long j = 0; j < padded; j += W) {
        vf x = loadv(s + j);
        vi more = x > mv;
        mv = (vf)(((vi)x & more) | ((vi)mv & ~more));
    }
    float m = mv[0];
    for (int l = 1; l < W; l++) m = mv[l] > m ? mv[l] : m;
    for (long j = 0; j < padded; j += W) storev(s + j, expv(loadv(s + j) - m));
}

/* The head dimensions t.. of one vector's weighted sum (those past the last whole pass): W at a time, then the last
 * d % W zero-padded: the same vector FMAs as the rest, never a scalar loop (a compiler may vectorize that one
 * differently depending on the number of keys). */
static void weigh_tail(const float *s, const float *v, long vs, float *out, long keys, long d, long t, float total) {
    long t16 = d & ~(long)(W - 1);
    for (; t < t16; t += W) {
        vf acc = (vf){0};
        for (long j = 0; j < keys; j++) acc += s[j] * loadv(v + j * vs + t);
        storev(out + t, acc / total);
    }
    if (t < d) {
        long rest = d - t;
        vf acc = (vf){0};
        for (long j = 0; j < keys; j++) {
            float padded_v[W] = {0};
            memcpy(padded_v, v + j * vs + t, sizeof(float) * (size_t)rest);
            acc += s[j] * loadv(padded_v);
        }
        float result[W];
        storev(result, acc / total);
        memcpy(out + t, result, sizeof(float) * (size_t)rest);
    }
}

/* The softmax and weighted sum of the values of G query vectors of one KV head, over their scores (row g at
 * s + g * padded, each padded to 16 with -inf). Each vector's arithmetic is the same whatever G is (the same
 * operations, the same key order); G > 1 interleaves the vectors so that their dependency chains overlap and each
 * value vector loaded serves all G (a verify pass has groups * rows vectors per KV head).
 * The denominators run strictly in key order (not per lane): a token tree hides siblings between a row's keys, and
 * the row alone sees those keys packed together, so only a sequential sum adds the same floats in the same order. */
#define WEIGH_GROUP(G)                                                                                      \
static void weigh_values_##G(float *s, long padded, const float *v, long vs, float **out, long keys, long d) { \
    long t16 = d & ~(long)(W - 1);                                                                        \
    float total[G];                                                                                       \
    for (int g = 0; g < G; g++) {                                                                         \
        exponentiate(s + g * padded, keys);                                                               \
        total[g] = 0.0f;                                                                                  \
    }                                                                                                     \
    long t = 0;                                                                                           \
    int summed = 0;  /* the denominators ride along the first chunk's key loop (their adds hide under its FMAs) */ \
    for (; t + W * WEIGH_CHUNKS <= t16; t += W * WEIGH_CHUNKS) {                                          \
        vf acc[G][WEIGH_CHUNKS];                                                                         \
        for (int g = 0; g < G; g++)                                                                       \
            for (int c = 0; c < WEIGH_CHUNKS; c++) acc[g][c] = (vf){0};                                  \
        for (long j = 0; j < keys; j++) {  /* in key order; WEIGH_CHUNKS vectors: independent FMA chains */ \
            if (j + 8 < keys) __builtin_prefetch(v + (j + 8) * vs + t);                                   \
            if (!summed)                                                                                  \
                for (int g = 0; g < G; g++) total[g] += s[g * padded + j];                                \
            for (int c = 0; c < WEIGH_CHUNKS; c++) {                                                      \
                vf vc = loadv(v + j * vs + t + W * c);                                                  \
                for (int g = 0; g < G; g++) acc[g][c] += s[g * padded + j] * vc;                          \
            }                                                                                             \
        }                                                                                                 \
        summed = 1;                                                                                       \
        for (int g = 0; g < G; g++)                                                                       \
            for (int c = 0; c < WEIGH_CHUNKS; c++) storev(out[g] + t + W * c, acc[g][c] / total[g]);     \
    }                                                                                                     \
    if (!summed)                                                                                          \
        for (long j = 0; j < keys; j++)                                                                   \
            for (int g = 0; g < G; g++) total[g] += s[g * padded + j];                                    \
    if (t < d)                                                                                            \
        for (int g = 0; g < G; g++) weigh_tail(s + g * padded, v, vs, out[g], keys, d, t, total[g]);      \
}
WEIGH_GROUP(1) WEIGH_GROUP(2) WEIGH_GROUP(3) WEIGH_GROUP(4)
/* GROUP (above) vectors weighed together per work item: fewer passes over the values than one vector at a time
 * (docs/backends.md); bit-identical */
typedef void (*weigh_fn)(float *, long, const float *, long, float **, long, long);
static const weigh_fn WEIGH[5] = {0, weigh_values_1, weigh_values_2, weigh_values_3, weigh_values_4};  /* up to GROUP used */

/* One call's shapes and buffers, split into work items any thread pool can run: first every score item (one block of
 * 16 keys of one KV head), then every weigh item (up to GROUP vectors of one KV head). Items write disjoint outputs,
 * and each item's arithmetic is the same whoever runs it and whatever runs beside it. */
typedef struct {
    const float *query, *key, *value, *mask;
    float *out, *scores;
    long heads, kv_heads, rows, keys, d, q_head_stride, q_row_stride, kv_stride, kv_row_stride, mask_stride;
    long groups, vectors, padded, blocks, weigh_items;
    float scale;
} attention_job;

static void attention_plan(attention_job *job) {
    job->groups = job->heads / job->kv_heads;
    job->vectors = job->groups * job->rows;
    job->padded = (job->keys + W - 1) & ~(long)(W - 1);
    job->blocks = job->padded / W;
    job->weigh_items = (job->vectors + GROUP - 1) / GROUP;
}

static long score_items(const attention_job *job) { return job->kv_heads * job->blocks; }
static long weigh_items(const attention_job *job) { return job->kv_heads * job->weigh_items; }

/* The vectors of KV head kv (its groups query heads, each with its rows) against keys j0..j0+W-1; kt: W * d floats */
static void score_item(const attention_job *job, long item, float *kt) {
    long kv = item / job->blocks, j0 = (item % job->blocks) * W;
    score_block(job->query + kv * job->groups * job->q_head_stride, job->q_head_stride, job->q_row_stride,
                job->vectors, job->rows, job->key + kv * job->kv_stride, job->kv_row_stride, job->mask,
                job->mask_stride, job->scores + kv * job->vectors * job->padded, job->padded, j0, job->keys, job->d,
                job->scale, kt);
}

/* GROUP vectors of one KV head (the last item of each head takes the rest) */
static void weigh_item(const attention_job *job, long item) {
    long items = job->weigh_items, vectors = job->vectors, rows = job->rows;
    long kv = item / items, a0 = GROUP * (item % items), count = vectors - a0 < GROUP ? vectors - a0 : GROUP;
    float *outs[GROUP];
    for (long a = a0; a < a0 + count; a++)  /* vector a: query head kv * groups + a / rows, row a % rows */
        outs[a - a0] = job->out + ((a % rows) * job->heads + kv * job->groups + a / rows) * job->d;
    WEIGH[count](job->scores + (kv * vectors + a0) * job->padded, job->padded, job->value + kv * job->kv_stride,
                 job->kv_row_stride, outs, job->keys, job->d);
}

/* out[rows, heads, d] = softmax(scale * Q K^T + mask) V for query [heads, rows, d] with head stride q_head_stride and
 * row stride q_row_stride (rows of d contiguous: the projection's [rows, heads, d] output read as it is); key/value
 * [kv_heads, keys, d] with head stride kv_stride and key stride kv_row_stride (a view of the cache: d for a
 * [kv_heads, keys, d] cache, kv_heads * d for a [keys, kv_heads, d] one); mask [rows, keys] with row stride
 * mask_stride, or NULL. Query head h reads KV head h / (heads / kv_heads). 0 on success, -1 out of memory. */
int small_batch_attention(const float *query, const float *key, const float *value, const float *mask, float *out,
                          long heads, long kv_heads, long rows, long keys, long d, long q_head_stride, long q_row_stride,
                          long kv_stride, long kv_row_stride, long mask_stride, float scale, int threads) {
    attention_job job = {query, key, value, mask, out, NULL, heads, kv_heads, rows, keys, d, q_head_stride,
                         q_row_stride, kv_stride, kv_row_stride, mask_stride, 0, 0, 0, 0, 0, scale};
    attention_plan(&job);
    job.scores = malloc(sizeof(float) * (size_t)(kv_heads * job.vectors * job.padded));
    if (!job.scores) return -1;
    long scoring = score_items(&job), weighing = weigh_items(&job);
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *kt = malloc(sizeof(float) * (size_t)(W * d));
        failed = kt == NULL;
        #pragma omp for schedule(static)
        for (long item = 0; item < scoring; item++)
            if (kt) score_item(&job, item, kt);
        #pragma omp for schedule(static)
        for (long item = 0; item < weighing; item++) weigh_item(&job, item);
        free(kt);
    }
    free(job.scores);
    return failed ? -1 : 0;
}
