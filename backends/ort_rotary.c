/* kangaroo.Rotary: an onnxruntime custom op (CPU, float32) for the rotary position embedding of one projection,
 * the ten elementwise nodes a layer's exported graph spends on its queries and keys in one (see
 * kangaroo_backends/ort_rotary.py for the pattern it replaces and why).
 *
 *   inputs   x [.., n, H, D] float32 (split_heads = 1: [.., n, H * D]), cos / sin [.., n, D]
 *   output   [.., n, H, D]: x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x[D/2:], x[:D/2])
 *   attrs    split_heads (int): 1 where the op absorbs the Reshape that split x's heads
 *
 * The exported graph computes rotate_half as a product with a ±1 matrix: every output sums one ±x and zeros, which
 * is exact and gives +0 for a zero x; 0 + x and 0 - x give the same values, signed zeros included. Products and the
 * sum are rounded separately, as the graph's Mul and Add nodes round them (no fused multiply-add: contraction is off
 * here), so the op gives the graph's bits.
 *
 * Included by ort_cached_attention.c (which declares the part of the C API used here) and registered beside it. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

typedef struct {
    int split;  /* 1: x is [.., n, H * D], the output [.., n, H, D] (the op absorbs the Reshape before it) */
} rotary_state;

static OrtStatus *rotary_create(const OrtCustomOp *op, OrtApiTable table, const OrtKernelInfo *info, void **out) {
    (void)op; (void)table;
    int64_t split;
    TRY(CALL(GetAttrInt_fn, KernelInfoGetAttribute_int64)(info, "split_heads", &split));
    rotary_state *s = malloc(sizeof *s);
    if (!s) return CALL(CreateStatus_fn, CreateStatus)(ORT_FAIL, "Rotary: out of memory");
    s->split = split != 0;
    *out = s;
    return NULL;
}

static void rotary_destroy(void *state) { free(state); }

static void rotary_rows(const float *x, const float *c, const float *s, float *y, long rows, long heads, long d) {
    const long half = d / 2;
    for (long t = 0; t < rows; t++) {
        const float *ct = c + t * d, *st = s + t * d;
        for (long h = 0; h < heads; h++) {
            const float *xr = x + (t * heads + h) * d;
            float *yr = y + (t * heads + h) * d;
            for (long i = 0; i < half; i++) {
                float rotated = 0.0f - xr[i + half];
                float a = xr[i] * ct[i], b = rotated * st[i];
                yr[i] = a + b;
            }
            for (long i = half; i < d; i++) {
                float rotated = 0.0f + xr[i - half];
                float a = xr[i] * ct[i], b = rotated * st[i];
                yr[i] = a + b;
            }
        }
    }
}

static OrtStatus *rotary_compute(void *state, OrtKernelContext *ctx) {
    const rotary_state *st = state;
    float *x, *c, *s;
    long nx, nc, ns;
    int64_t dims[9], cdims[8];
    size_t rank, crank;
    TRY(block_input(ctx, 0, TENSOR_FLOAT, (void **)&x, &nx, dims, &rank));
    TRY(block_input(ctx, 1, TENSOR_FLOAT, (void **)&c, &nc, cdims, &crank));
    TRY(block_input(ctx, 2, TENSOR_FLOAT, (void **)&s, &ns, NULL, NULL));
    long d = crank >= 1 ? (long)cdims[crank - 1] : 0;
    if (st->split && rank >= 1 && rank < 8 && d > 0 && dims[rank - 1] % d == 0) {  /* [.., H * D] -> [.., H, D] */
        dims[rank] = d;
        dims[rank - 1] /= d;
        rank++;
    }
    if (d <= 0 || d % 2 || rank < 1 || dims[rank - 1] != d || nc != ns || nc % d || nx % (nc ? nc : 1))
        return CALL(CreateStatus_fn, CreateStatus)(ORT_INVALID_ARGUMENT, "Rotary: input shapes disagree");
    long rows = nc / d, heads = rows ? nx / nc : 0;
    OrtValue *out_value;
    float *y;
    TRY(CALL(GetOutput_fn, KernelContext_GetOutput)(ctx, 0, dims, rank, &out_value));
    TRY(CALL(MutableData_fn, GetTensorMutableData)(out_value, (void **)&y));
    rotary_rows(x, c, s, y, rows, heads, d);
    return NULL;
}

#pragma GCC pop_options

static const char *rotary_name(const OrtCustomOp *op) { (void)op; return "Rotary"; }
static size_t rotary_inputs(const OrtCustomOp *op) { (void)op; return 3; }

static const OrtCustomOp rotary_op = {
    .version = API_VERSION,
    .GetName = rotary_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = op_type,
    .GetInputTypeCount = rotary_inputs,
    .GetOutputType = op_type,
    .GetOutputTypeCount = op_outputs,
    .KernelDestroy = rotary_destroy,
    .GetInputCharacteristic = op_required,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = op_memory,
    .CreateKernelV2 = rotary_create,
    .KernelComputeV2 = rotary_compute,
};
