/* kangaroo.BlockMatMul: an onnxruntime custom op (CPU) for a linear layer over GGUF-style blocks, every block read
 * once for all rows (the kernel is block_matmul.c; the layouts and why are in kangaroo_backends/block_weights.py).
 *
 *   inputs   x [.., K] float32, codes uint8, scales float32, mins float32 (q4; an empty tensor for q8)
 *   output   [.., N] float32
 *   attrs    family (0 q4, 1 q8), sub (elements per scale), N, K, activations (0 int8, 1 float32)
 *
 * Included by ort_cached_attention.c (which declares the part of the C API used here) and registered beside
 * CachedAttention in the "kangaroo" domain. The columns run on onnxruntime's intra-op threads in chunks; a row's result
 * does not depend on the split (see the kernel). */
#include "block_matmul.c"

enum { TENSOR_UINT8 = 2 };

typedef struct {
    int family, sub, activations;
    long n, k;
} block_op_state;

static OrtStatus *block_create(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info, void **out) {
    (void)op; (void)table;
    int64_t family, sub, n, k, activations;
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "family", &family));
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "sub", &sub));
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "N", &n));
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "K", &k));
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "activations", &activations));
    if (block_matmul_isa() == 0)
        return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "BlockMatMul: this CPU has no AVX2 and FMA");
    if (n <= 0 || k <= 0 || k % QBLOCK || (family != 0 && family != 1) || (activations != 0 && activations != 1))
        return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "BlockMatMul: bad attributes");
    block_op_state *s = malloc(sizeof *s);
    if (!s) return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "BlockMatMul: out of memory");
    *s = (block_op_state){(int)family, (int)sub, (int)activations, (long)n, (long)k};
    *out = s;
    return NULL;
}

/* One input's data, element count, and (optionally) shape; its element type must be `want`. */
static OrtStatus *block_input(OrtKernelContext *ctx, size_t index, int want, void **data, long *count, int64_t *dims,
                              size_t *rank) {
    const OrtValue *value;
    OrtTensorTypeAndShapeInfo *info;
    int type;
    size_t r;
    int64_t d[8];
    TRY(CALL(GetInput_fn, KernelContext_GetInput)(ctx, index, &value));
    TRY(CALL(TypeAndShape_fn, GetTensorTypeAndShape)(value, &info));
    OrtStatus *status = CALL(ElementType_fn, GetTensorElementType)(info, &type);
    if (!status) status = CALL(DimCount_fn, GetDimensionsCount)(info, &r);
    if (!status && r > 8) status = CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "BlockMatMul: rank > 8");
    if (!status) status = CALL(Dims_fn, GetDimensions)(info, d, r);
    CALL(ReleaseShape_fn, ReleaseTensorTypeAndShapeInfo)(info);
    if (status) return status;
    if (type != want) return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "BlockMatMul: input type");
    *count = 1;
    for (size_t i = 0; i < r; i++) *count *= (long)d[i];
    if (dims) memcpy(dims, d, sizeof(int64_t) * r);
    if (rank) *rank = r;
    return CALL(MutableData_fn, GetTensorMutableData)((OrtValue *)value, data);
}

static void block_run_chunk(void *job, size_t item) { block_job_chunk(job, (long)item); }

static OrtStatus *block_compute(void *state, OrtKernelContext *ctx) {
    const block_op_state *s = state;
    float *x, *scales, *mins;
    uint8_t *codes;
    long nx, ncodes, nscales, nmins;
    int64_t dims[8];
    size_t rank;
    TRY(block_input(ctx, 0, TENSOR_FLOAT, (void **)&x, &nx, dims, &rank));
    TRY(block_input(ctx, 1, TENSOR_UINT8, (void **)&codes, &ncodes, NULL, NULL));
    TRY(block_input(ctx, 2, TENSOR_FLOAT, (void **)&scales, &nscales, NULL, NULL));
    TRY(block_input(ctx, 3, TENSOR_FLOAT, (void **)&mins, &nmins, NULL, NULL));
    long blocks = s->n * (s->k / QBLOCK);
    if (rank < 1 || dims[rank - 1] != s->k || ncodes != blocks * (s->family == 0 ? 16 : 32)
        || nscales != s->n * (s->k / (s->family == 0 ? QBLOCK : s->sub)) || (s->family == 0 && nmins != blocks))
        return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "BlockMatMul: input shapes disagree");
    long rows = nx / s->k;
    dims[rank - 1] = s->n;
    OrtValue *out_value;
    float *y;
    TRY(CALL(GetOutput_fn, KernelContext_GetOutput)(ctx, 0, dims, rank, &out_value));
    TRY(CALL(MutableData_fn, GetTensorMutableData)(out_value, (void **)&y));
    if (rows == 0) return NULL;
    block_job job;
    int status = block_job_prepare(&job, s->family, s->sub, s->n, s->k, codes, scales, s->family == 0 ? mins : NULL,
                                   s->activations, x, rows, y);
    if (status == -3) return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "BlockMatMul: out of memory");
    if (status) return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "BlockMatMul: refused the call");
    OrtStatus *result = parallel_for(ctx, block_run_chunk, (size_t)block_job_chunks(&job), 0, &job);
    block_job_free(&job);
    return result;
}

static const char *block_name(const OrtCustomOp *op) { (void)op; return "BlockMatMul"; }
static int block_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? TENSOR_UINT8 : TENSOR_FLOAT; }
static size_t block_inputs(const OrtCustomOp *op) { (void)op; return 4; }

static const OrtCustomOp block_matmul_op = {
    .version = API_VERSION,
    .GetName = block_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = block_input_type,
    .GetInputTypeCount = block_inputs,
    .GetOutputType = op_type,
    .GetOutputTypeCount = op_outputs,
    .KernelDestroy = destroy_kernel,
    .GetInputCharacteristic = op_required,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_memory,
    .CreateKernelV2 = block_create,
    .KernelComputeV2 = block_compute,
};
