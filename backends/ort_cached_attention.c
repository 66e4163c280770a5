/* kangaroo.CachedAttention (and kangaroo.BlockMatMul, ort_block_matmul.c, and kangaroo.Rotary, ort_rotary.c): an onnxruntime custom op (CPU, float32) for one layer's attention over the KV cache,
 * reading the cache where it lies (see kangaroo_backends/ort_attention.py for why and how it is wired).
 *
 *   inputs   query [1, n, H, hd] (or [1, n, H*hd]), new_key / new_value [1, n, kvh, hd],
 *            past_key / past_value [1, past, kvh, hd], bias [1, 1, >= n, past + n] (additive; rows 0..n-1 read)
 *   output   [1, n, H * hd]
 *   attrs    heads, kv_heads, head_dim (int), scale (float)
 *
 * The backend binds past_key = cache[:, :past] and new_key = cache[:, past:past+n] of one buffer, so the keys are one
 * contiguous [past + n, kvh, hd] block when this op runs: it reads them in place. Otherwise (a plain session.run, or
 * an empty past) it copies past and new together first, and the arithmetic is the same either way: the attention of
 * small_batch_attention.c (every row alone, in a fixed order), included below and run on onnxruntime's intra-op
 * threads.
 *
 * The C API is declared here by hand (only what this op uses): onnxruntime's OrtApi is a table of function pointers
 * whose order never changes between releases (new functions are appended), so each function is read at its slot.
 * Slots and signatures follow onnxruntime's include/onnxruntime/core/session/onnxruntime_c_api.h. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "small_batch_attention.c"

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef const void *const *OrtApiTable;  /* the OrtApi struct read as its slots */

typedef struct OrtApiBase {
    OrtApiTable (*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { TENSOR_FLOAT = 1 };
enum { INPUT_OUTPUT_REQUIRED = 0 };

/* OrtApi slots (0-based; the same in every release since the function was added) */
enum {
    SLOT_CreateStatus = 0,
    SLOT_CreateCustomOpDomain = 26,
    SLOT_CustomOpDomain_Add = 27,
    SLOT_AddCustomOpDomain = 28,
    SLOT_GetTensorMutableData = 51,
    SLOT_GetTensorElementType = 60,
    SLOT_GetDimensionsCount = 61,
    SLOT_GetDimensions = 62,
    SLOT_GetTensorTypeAndShape = 65,
    SLOT_KernelInfoGetAttribute_float = 85,
    SLOT_KernelInfoGetAttribute_int64 = 86,
    SLOT_KernelContext_GetInput = 90,
    SLOT_KernelContext_GetOutput = 91,
    SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    SLOT_KernelContext_ParallelFor = 274,
};
/* the API (and OrtCustomOp layout) version asked for: 17 (onnxruntime 1.17) has KernelContext_ParallelFor and the
 * V2 kernel functions that return a status */
#define API_VERSION 17

typedef OrtStatus *(*CreateStatus_fn)(int code, const char *msg);
typedef OrtStatus *(*GetAttrFloat_fn)(const OrtKernelInfo *, const char *, float *);
typedef OrtStatus *(*GetAttrInt_fn)(const OrtKernelInfo *, const char *, int64_t *);
typedef OrtStatus *(*GetInput_fn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*GetOutput_fn)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef OrtStatus *(*MutableData_fn)(OrtValue *, void **);
typedef OrtStatus *(*TypeAndShape_fn)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef OrtStatus *(*ElementType_fn)(const OrtTensorTypeAndShapeInfo *, int *);
typedef OrtStatus *(*DimCount_fn)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*Dims_fn)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef void (*ReleaseShape_fn)(OrtTensorTypeAndShapeInfo *);
typedef OrtStatus *(*CreateDomain_fn)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*DomainAdd_fn)(OrtCustomOpDomain *, const void *);
typedef OrtStatus *(*AddDomain_fn)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*ParallelFor_fn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, const void *);

#define CALL(type, slot) ((type)api[SLOT_##slot])
#define TRY(expr) do { OrtStatus *status_ = (expr); if (status_) return status_; } while (0)

static OrtApiTable api;                   /* the OrtApi of the version this library asked for */
static ParallelFor_fn parallel_for;       /* onnxruntime's intra-op thread pool */

/* Calls that found the new keys right after the past ones / that copied them together (read by the tests). */
long kangaroo_attention_in_place = 0, kangaroo_attention_copied = 0;

/* ---- the custom op's description (OrtCustomOp as of version 17; onnxruntime reads no later field) ----------------- */
typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *, OrtApiTable, const OrtKernelInfo *);
    const char *(*GetName)(const struct OrtCustomOp *);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *);
    int (*GetInputType)(const struct OrtCustomOp *, size_t);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *);
    int (*GetOutputType)(const struct OrtCustomOp *, size_t);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *);
    void (*KernelCompute)(void *, OrtKernelContext *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const struct OrtCustomOp *, size_t);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp *, size_t);
    int (*GetInputMemoryType)(const struct OrtCustomOp *, size_t);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *);
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *, OrtApiTable, const OrtKernelInfo *, void **);
    OrtStatus *(*KernelComputeV2)(void *, OrtKernelContext *);
    OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *, void *);
    int (*GetStartVersion)(const struct OrtCustomOp *);
    int (*GetEndVersion)(const struct OrtCustomOp *);
} OrtCustomOp;

typedef struct {
    long heads, kv_heads, head_dim;
    float scale;
} kernel_state;

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info, void **out) {
    (void)op; (void)table;
    int64_t heads, kv_heads, head_dim;
    float scale;
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "heads", &heads));
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "kv_heads", &kv_heads));
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "head_dim", &head_dim));
    TRY(CALL(GetAttrFloat_fn, KernelInfoGetAttribute_float)(info, "scale", &scale));
    if (heads <= 0 || kv_heads <= 0 || head_dim <= 0 || heads % kv_heads)
        return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT,
                                                   "CachedAttention: heads must be a positive multiple of kv_heads");
    kernel_state *k = malloc(sizeof *k);
    if (!k) return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "CachedAttention: out of memory");
    k->heads = (long)heads;
    k->kv_heads = (long)kv_heads;
    k->head_dim = (long)head_dim;
    k->scale = scale;
    *out = k;
    return NULL;
}

static void destroy_kernel(void *k) { free(k); }

/* One input's data and shape (float32 only). */
static OrtStatus *tensor(OrtKernelContext *ctx, size_t index, float **data, int64_t *dims, size_t *rank) {
    const OrtValue *value;
    OrtTensorTypeAndShapeInfo *info;
    int type;
    TRY(CALL(GetInput_fn, KernelContext_GetInput)(ctx, index, &value));
    TRY(CALL(TypeAndShape_fn, GetTensorTypeAndShape)(value, &info));
    OrtStatus *status = CALL(ElementType_fn, GetTensorElementType)(info, &type);
    if (!status) status = CALL(DimCount_fn, GetDimensionsCount)(info, rank);
    if (!status && *rank > 4) status = CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "CachedAttention: rank > 4");
    if (!status) status = CALL(Dims_fn, GetDimensions)(info, dims, *rank);
    CALL(ReleaseShape_fn, ReleaseTensorTypeAndShapeInfo)(info);
    if (status) return status;
    if (type != TENSOR_FLOAT)
        return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "CachedAttention: float32 tensors only");
    return CALL(MutableData_fn, GetTensorMutableData)((OrtValue *)value, (void **)data);
}

static void run_scores(void *job, size_t item) {
    const attention_job *j = job;
    float kt[W * j->d];
    score_item(j, (long)item, kt);
}

static void run_weighing(void *job, size_t item) { weigh_item(job, (long)item); }

static OrtStatus *compute(void *state, OrtKernelContext *ctx) {
    const kernel_state *k = state;
    float *q, *k_new, *v_new, *k_past, *v_past, *bias;
    int64_t qd[4], kd[4], vd[4], pkd[4], pvd[4], bd[4];
    size_t qr, kr, vr, pkr, pvr, br;
    TRY(tensor(ctx, 0, &q, qd, &qr));
    TRY(tensor(ctx, 1, &k_new, kd, &kr));
    TRY(tensor(ctx, 2, &v_new, vd, &vr));
    TRY(tensor(ctx, 3, &k_past, pkd, &pkr));
    TRY(tensor(ctx, 4, &v_past, pvd, &pvr));
    TRY(tensor(ctx, 5, &bias, bd, &br));
    long heads = k->heads, kvh = k->kv_heads, d = k->head_dim;
    long n = kr == 4 ? (long)kd[1] : -1, past = pkr == 4 ? (long)pkd[1] : -1, total = past + n;
    long q_elems = 1;
    for (size_t i = 0; i < qr; i++) q_elems *= (long)qd[i];
    if (kr != 4 || vr != 4 || pkr != 4 || pvr != 4 || br != 4 || kd[0] != 1 || kd[2] != kvh || kd[3] != d
        || memcmp(kd, vd, sizeof kd) || pkd[0] != 1 || pkd[2] != kvh || pkd[3] != d || memcmp(pkd, pvd, sizeof pkd)
        || q_elems != n * heads * d || bd[3] != total || bd[2] < n)
        return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "CachedAttention: input shapes disagree");
    int64_t out_dims[3] = {1, n, heads * d};
    OrtValue *out_value;
    float *out;
    TRY(CALL(GetOutput_fn, KernelContext_GetOutput)(ctx, 0, out_dims, 3, &out_value));
    TRY(CALL(MutableData_fn, GetTensorMutableData)(out_value, (void **)&out));
    if (n == 0) return NULL;

    /* the keys/values: in place when the new rows follow the past ones in one buffer */
    size_t row = (size_t)(kvh * d);
    const float *keys = k_new, *values = v_new;
    float *joined = NULL;
    if (past > 0 && k_new == k_past + past * row && v_new == v_past + past * row) {
        keys = k_past;
        values = v_past;
        __atomic_add_fetch(&kangaroo_attention_in_place, 1, __ATOMIC_RELAXED);
    } else if (past > 0) {
        joined = malloc(sizeof(float) * 2 * (size_t)total * row);
        if (!joined) return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "CachedAttention: out of memory");
        memcpy(joined, k_past, sizeof(float) * (size_t)past * row);
        memcpy(joined + past * row, k_new, sizeof(float) * (size_t)n * row);
        memcpy(joined + total * row, v_past, sizeof(float) * (size_t)past * row);
        memcpy(joined + (total + past) * row, v_new, sizeof(float) * (size_t)n * row);
        keys = joined;
        values = joined + total * row;
        __atomic_add_fetch(&kangaroo_attention_copied, 1, __ATOMIC_RELAXED);
    }
    /* query [1, n, H, hd]: head stride hd, row stride H * hd; keys [T, kvh, hd]: head stride hd, key stride kvh * hd */
    attention_job job = {q, keys, values, bias, out, NULL, heads, kvh, n, total, d, d, heads * d, d, kvh * d, total,
                         0, 0, 0, 0, 0, k->scale};
    attention_plan(&job);
    job.scores = malloc(sizeof(float) * (size_t)(kvh * job.vectors * job.padded));
    if (!job.scores) {
        free(joined);
        return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "CachedAttention: out of memory");
    }
    /* every score item, then every weigh item, on onnxruntime's intra-op threads (each call returns when its items
     * are done: the weigh items read all the scores) */
    OrtStatus *status = parallel_for(ctx, run_scores, (size_t)score_items(&job), 0, &job);
    if (!status) status = parallel_for(ctx, run_weighing, (size_t)weigh_items(&job), 0, &job);
    free(job.scores);
    free(joined);
    return status;
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "CachedAttention"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return NULL; }  /* NULL: the CPU provider */
static int op_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return TENSOR_FLOAT; }
static size_t op_inputs(const OrtCustomOp *op) { (void)op; return 6; }
static size_t op_outputs(const OrtCustomOp *op) { (void)op; return 1; }
static int op_required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return INPUT_OUTPUT_REQUIRED; }
static int op_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }  /* OrtMemTypeDefault */

static const OrtCustomOp cached_attention = {
    .version = API_VERSION,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = op_type,
    .GetInputTypeCount = op_inputs,
    .GetOutputType = op_type,
    .GetOutputTypeCount = op_outputs,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = op_required,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_memory,
    .CreateKernelV2 = create_kernel,
    .KernelComputeV2 = compute,
};

#include "ort_block_matmul.c"
#include "ort_rotary.c"

/* The entry point SessionOptions.register_custom_ops_library calls. */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(API_VERSION);
    if (!api) {  /* an onnxruntime older than 1.17: say so through the oldest API */
        OrtApiTable oldest = base->GetApi(1);
        return oldest ? ((CreateStatus_fn)oldest[SLOT_CreateStatus])(
                            ORT_FAIL, "kangaroo's CachedAttention op needs onnxruntime >= 1.17")
                      : NULL;
    }
    parallel_for = CALL(ParallelFor_fn, KernelContext_ParallelFor);
    OrtCustomOpDomain *domain;
    TRY(CALL(CreateDomain_fn, CreateCustomOpDomain)("kangaroo", &domain));
    TRY(CALL(DomainAdd_fn, CustomOpDomain_Add)(domain, &cached_attention));
    TRY(CALL(DomainAdd_fn, CustomOpDomain_Add)(domain, &block_matmul_op));
    TRY(CALL(DomainAdd_fn, CustomOpDomain_Add)(domain, &rotary_op));
    return CALL(AddDomain_fn, AddCustomOpDomain)(options, domain);
}
