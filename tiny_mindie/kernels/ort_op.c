/* The onnxruntime custom operators tiny_mindie::MatMulGGUF and tiny_mindie::GatherGGUF,
 * registered by RegisterCustomOps (SessionOptions.register_custom_ops_library).
 *
 *   Y = MatMulGGUF(X, W), attributes type (the GGUF type id), N, K
 *   X float32 [..., K]; W uint8, the N rows of GGUF blocks exactly as in the file (any shape of
 *   N * K / block * block_bytes bytes); Y float32 [..., N] (dispatch.c, kern_impl.h).
 *   Y = GatherGGUF(W, ids), the same attributes and W
 *   ids int64 [...], each in 0 .. N-1 (else the run fails); Y float32 [..., K]: the rows ids of
 *   W dequantized (kern_gather.c).
 *
 * The onnxruntime C API is used through its documented ABI, declared here (no onnxruntime header
 * is included): OrtApiBase is {GetApi, GetVersionString}; OrtApi is a table of function
 * pointers that only ever grows at its end, so an entry's index is fixed once released; the
 * indices below hold from API version 17 on (KernelContext_ParallelFor is the newest entry
 * used), and version 17 is what is asked of GetApi: this library loads into onnxruntime 1.17
 * and every later release. The operator's rows are split over onnxruntime's intra-op thread
 * pool (KernelContext_ParallelFor), in pieces of whole rows: a row's arithmetic is the same
 * whatever the split.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "tm_kernels.h"

#define TM_EXPORT __attribute__((visibility("default")))
#define TM_ORT_API_VERSION 17

typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef void *const *OrtApiTable;             /* the OrtApi struct: function pointers */

typedef struct {
    OrtApiTable (*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* OrtErrorCode, ONNXTensorElementDataType, OrtCustomOpInputOutputCharacteristic, OrtMemType */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT64 = 7 };
enum { IO_REQUIRED = 0 };
enum { MEM_DEFAULT = 0 };

/* OrtApi entries used: their index in the table, and their type */
#define API_CreateStatus 0
#define API_CreateCustomOpDomain 26
#define API_CustomOpDomain_Add 27
#define API_AddCustomOpDomain 28
#define API_GetTensorMutableData 51
#define API_GetDimensionsCount 61
#define API_GetDimensions 62
#define API_GetTensorTypeAndShape 65
#define API_KernelInfoGetAttribute_int64 86
#define API_KernelContext_GetInput 90
#define API_KernelContext_GetOutput 91
#define API_ReleaseStatus 93
#define API_ReleaseTensorTypeAndShapeInfo 99
#define API_KernelContext_ParallelFor 274

typedef OrtStatus *(*CreateStatus_t)(int code, const char *msg);
typedef OrtStatus *(*CreateCustomOpDomain_t)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*CustomOpDomain_Add_t)(OrtCustomOpDomain *domain, const void *op);
typedef OrtStatus *(*AddCustomOpDomain_t)(OrtSessionOptions *options, OrtCustomOpDomain *d);
typedef OrtStatus *(*GetTensorMutableData_t)(OrtValue *value, void **out);
typedef OrtStatus *(*GetDimensionsCount_t)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*GetDimensions_t)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims,
                                      size_t n);
typedef OrtStatus *(*GetTensorTypeAndShape_t)(const OrtValue *value,
                                              OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*KernelInfoGetAttribute_int64_t)(const OrtKernelInfo *info,
                                                     const char *name, int64_t *out);
typedef OrtStatus *(*KernelContext_GetInput_t)(const OrtKernelContext *ctx, size_t index,
                                               const OrtValue **out);
typedef OrtStatus *(*KernelContext_GetOutput_t)(OrtKernelContext *ctx, size_t index,
                                                const int64_t *dims, size_t n, OrtValue **out);
typedef void (*ReleaseStatus_t)(OrtStatus *status);
typedef void (*ReleaseTensorTypeAndShapeInfo_t)(OrtTensorTypeAndShapeInfo *info);
typedef OrtStatus *(*KernelContext_ParallelFor_t)(const OrtKernelContext *ctx,
                                                  void (*fn)(void *, size_t), size_t total,
                                                  size_t num_batch, void *usr_data);

#define CALL(api, name) ((name##_t)(api)[API_##name])

/* OrtCustomOp, as far as version 17 reads it (later versions append fields) */
typedef struct tm_custom_op {
    uint32_t version;
    void *(*CreateKernel)(const struct tm_custom_op *op, OrtApiTable api,
                          const OrtKernelInfo *info);
    const char *(*GetName)(const struct tm_custom_op *op);
    const char *(*GetExecutionProviderType)(const struct tm_custom_op *op);
    int (*GetInputType)(const struct tm_custom_op *op, size_t index);
    size_t (*GetInputTypeCount)(const struct tm_custom_op *op);
    int (*GetOutputType)(const struct tm_custom_op *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct tm_custom_op *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *ctx);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const struct tm_custom_op *op, size_t index);
    int (*GetOutputCharacteristic)(const struct tm_custom_op *op, size_t index);
    int (*GetInputMemoryType)(const struct tm_custom_op *op, size_t index);
    int (*GetVariadicInputMinArity)(const struct tm_custom_op *op);
    int (*GetVariadicInputHomogeneity)(const struct tm_custom_op *op);
    int (*GetVariadicOutputMinArity)(const struct tm_custom_op *op);
    int (*GetVariadicOutputHomogeneity)(const struct tm_custom_op *op);
    OrtStatus *(*CreateKernelV2)(const struct tm_custom_op *op, OrtApiTable api,
                                 const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *ctx);
    void *InferOutputShapeFn;
    int (*GetStartVersion)(const struct tm_custom_op *op);
    int (*GetEndVersion)(const struct tm_custom_op *op);
} tm_custom_op;

typedef struct {
    OrtApiTable api;
    int type;
    int64_t N, K;
} tm_kernel;

static OrtStatus *fail(OrtApiTable api, int code, const char *msg)
{
    return CALL(api, CreateStatus)(code, msg);
}

static OrtStatus *create_kernel(const tm_custom_op *op, OrtApiTable api,
                                const OrtKernelInfo *info, void **out)
{
    int64_t type = 0, n = 0, k = 0;
    OrtStatus *st;
    tm_kernel *kern;
    const char *why = NULL;
    (void)op;
    if ((st = CALL(api, KernelInfoGetAttribute_int64)(info, "type", &type))) return st;
    if ((st = CALL(api, KernelInfoGetAttribute_int64)(info, "N", &n))) return st;
    if ((st = CALL(api, KernelInfoGetAttribute_int64)(info, "K", &k))) return st;
    if (type < 0 || type > 1000 || tm_check((int)type, n, k, -1, &why))
        return fail(api, ORT_INVALID_ARGUMENT, why);
    kern = (tm_kernel *)malloc(sizeof *kern);
    if (!kern) return fail(api, ORT_FAIL, "MatMulGGUF: out of memory");
    kern->api = api;
    kern->type = (int)type;
    kern->N = n;
    kern->K = k;
    *out = kern;
    return NULL;
}

/* the dims of a value (up to 8) and their count */
static OrtStatus *dims_of(OrtApiTable api, const OrtValue *v, int64_t *dims, size_t *n)
{
    OrtTensorTypeAndShapeInfo *info = NULL;
    OrtStatus *st = CALL(api, GetTensorTypeAndShape)(v, &info);
    if (st) return st;
    st = CALL(api, GetDimensionsCount)(info, n);
    if (!st && *n > 8) st = fail(api, ORT_INVALID_ARGUMENT, "MatMulGGUF: more than 8 dims");
    if (!st) st = CALL(api, GetDimensions)(info, dims, *n);
    CALL(api, ReleaseTensorTypeAndShapeInfo)(info);
    return st;
}

typedef struct {
    OrtApiTable api;
    const OrtKernelContext *ctx;
} tm_pf;

static void ort_parallel_for(void *pf_ctx, void (*fn)(void *, size_t), size_t total, void *arg)
{
    tm_pf *pf = (tm_pf *)pf_ctx;
    OrtStatus *st = CALL(pf->api, KernelContext_ParallelFor)(pf->ctx, fn, total, 0, arg);
    if (st) {                        /* no pool: run the pieces here */
        size_t i;
        CALL(pf->api, ReleaseStatus)(st);
        for (i = 0; i < total; i++) fn(arg, i);
    }
}

static OrtStatus *compute(void *kernel, OrtKernelContext *ctx)
{
    tm_kernel *k = (tm_kernel *)kernel;
    OrtApiTable api = k->api;
    const OrtValue *xv, *wv;
    OrtValue *yv;
    int64_t xd[8], wd[8], m = 1, wbytes = 1;
    size_t nx, nw, i;
    void *x, *w, *y;
    OrtStatus *st;
    const char *why = NULL;
    tm_pf pf;

    if ((st = CALL(api, KernelContext_GetInput)(ctx, 0, &xv))) return st;
    if ((st = CALL(api, KernelContext_GetInput)(ctx, 1, &wv))) return st;
    if ((st = dims_of(api, xv, xd, &nx))) return st;
    if ((st = dims_of(api, wv, wd, &nw))) return st;
    if (nx < 1 || xd[nx - 1] != k->K)
        return fail(api, ORT_INVALID_ARGUMENT, "MatMulGGUF: X's last dim is not K");
    for (i = 0; i + 1 < nx; i++) m *= xd[i];
    for (i = 0; i < nw; i++) wbytes *= wd[i];
    if (tm_check(k->type, k->N, k->K, wbytes, &why)) return fail(api, ORT_INVALID_ARGUMENT, why);
    xd[nx - 1] = k->N;
    if ((st = CALL(api, KernelContext_GetOutput)(ctx, 0, xd, nx, &yv))) return st;
    if ((st = CALL(api, GetTensorMutableData)((OrtValue *)xv, &x))) return st;
    if ((st = CALL(api, GetTensorMutableData)((OrtValue *)wv, &w))) return st;
    if ((st = CALL(api, GetTensorMutableData)(yv, &y))) return st;
    pf.api = api;
    pf.ctx = ctx;
    if (tm_run(k->type, (const float *)x, m, k->K, (const uint8_t *)w, k->N, (float *)y, 1,
               ort_parallel_for, &pf, &why))
        return fail(api, ORT_FAIL, why);
    return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const tm_custom_op *op) { (void)op; return "MatMulGGUF"; }
static const char *op_ep(const tm_custom_op *op) { (void)op; return "CPUExecutionProvider"; }
static int in_type(const tm_custom_op *op, size_t i) { (void)op; return i ? ELEM_UINT8 : ELEM_FLOAT; }
static size_t two(const tm_custom_op *op) { (void)op; return 2; }
static int out_type(const tm_custom_op *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t one(const tm_custom_op *op) { (void)op; return 1; }
static int required(const tm_custom_op *op, size_t i) { (void)op; (void)i; return IO_REQUIRED; }
static int mem_default(const tm_custom_op *op, size_t i) { (void)op; (void)i; return MEM_DEFAULT; }
static int arity_one(const tm_custom_op *op) { (void)op; return 1; }
static int since(const tm_custom_op *op) { (void)op; return 1; }
static int until(const tm_custom_op *op) { (void)op; return 2147483647; }

static const tm_custom_op matmul_op = {
    TM_ORT_API_VERSION, NULL, op_name, op_ep, in_type, two, out_type, one, NULL,
    destroy_kernel, required, required, mem_default, arity_one, arity_one, arity_one,
    arity_one, create_kernel, compute, NULL, since, until,
};

static OrtStatus *gather_compute(void *kernel, OrtKernelContext *ctx)
{
    tm_kernel *k = (tm_kernel *)kernel;
    OrtApiTable api = k->api;
    const OrtValue *wv, *iv;
    OrtValue *yv;
    int64_t wd[8], yd[9], t = 1, wbytes = 1;
    size_t nw, ni, i;
    void *w, *ids, *y;
    OrtStatus *st;
    const char *why = NULL;

    if ((st = CALL(api, KernelContext_GetInput)(ctx, 0, &wv))) return st;
    if ((st = CALL(api, KernelContext_GetInput)(ctx, 1, &iv))) return st;
    if ((st = dims_of(api, wv, wd, &nw))) return st;
    if ((st = dims_of(api, iv, yd, &ni))) return st;
    for (i = 0; i < nw; i++) wbytes *= wd[i];
    for (i = 0; i < ni; i++) t *= yd[i];
    yd[ni] = k->K;
    if ((st = CALL(api, KernelContext_GetOutput)(ctx, 0, yd, ni + 1, &yv))) return st;
    if ((st = CALL(api, GetTensorMutableData)((OrtValue *)wv, &w))) return st;
    if ((st = CALL(api, GetTensorMutableData)((OrtValue *)iv, &ids))) return st;
    if ((st = CALL(api, GetTensorMutableData)(yv, &y))) return st;
    if (tm_gather_rows(k->type, (const int64_t *)ids, t, (const uint8_t *)w, wbytes, k->N, k->K,
                       (float *)y, &why))
        return fail(api, ORT_INVALID_ARGUMENT, why);
    return NULL;
}

static const char *gather_name(const tm_custom_op *op) { (void)op; return "GatherGGUF"; }
static int gather_in_type(const tm_custom_op *op, size_t i) { (void)op; return i ? ELEM_INT64 : ELEM_UINT8; }

static const tm_custom_op gather_op = {
    TM_ORT_API_VERSION, NULL, gather_name, op_ep, gather_in_type, two, out_type, one, NULL,
    destroy_kernel, required, required, mem_default, arity_one, arity_one, arity_one,
    arity_one, create_kernel, gather_compute, NULL, since, until,
};

/* The entry onnxruntime calls (register_custom_ops_library): adds the domain "tiny_mindie" with
 * MatMulGGUF and GatherGGUF to the session options. Fails when onnxruntime is older than API version 17 or
 * TINY_MINDIE_KERNEL_ISA names a path this CPU cannot run. The domain is never freed: sessions
 * made with these options may outlive any point where it could be. */
TM_EXPORT OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base)
{
    OrtApiTable api = base->GetApi(TM_ORT_API_VERSION);
    OrtCustomOpDomain *domain = NULL;
    OrtStatus *st;
    if (!api) {                      /* older than 1.17: say so through the first table */
        OrtApiTable first = base->GetApi(1);
        return first ? fail(first, ORT_FAIL, "tiny_mindie kernels: onnxruntime >= 1.17 needed")
                     : NULL;
    }
    if (tm_isa_error()) return fail(api, ORT_INVALID_ARGUMENT, tm_isa_error());
    if ((st = CALL(api, CreateCustomOpDomain)("tiny_mindie", &domain))) return st;
    if ((st = CALL(api, CustomOpDomain_Add)(domain, &matmul_op))) return st;
    if ((st = CALL(api, CustomOpDomain_Add)(domain, &gather_op))) return st;
    return CALL(api, AddCustomOpDomain)(options, domain);
}
