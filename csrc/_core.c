/*
 * _core.c -- CPython / NumPy glue: registers the kernels of gdn_kernels.c as generalized ufuncs.
 *
 * Kept apart from the kernels so that they stay plain C. Here: byte strides become element strides,
 * per-thread workspace is allocated (with PyMem_RawMalloc, so tracemalloc sees it) before the parallel
 * region and errors are raised after it, on the calling thread. NumPy releases the GIL around these
 * loops because no operand is an object array.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
/* NPY_TARGET_VERSION: keep in sync with the numpy floor in pyproject.toml's dependencies. */
#define NPY_TARGET_VERSION NPY_1_25_API_VERSION
#define NPY_NO_DEPRECATED_API NPY_1_25_API_VERSION
#include <numpy/arrayobject.h>
#include <numpy/ufuncobject.h>
#include "gdn.h"

#if defined(_MSC_VER)
#define GDN_THREAD_LOCAL __declspec(thread)
#else
#define GDN_THREAD_LOCAL _Thread_local
#endif

/* Threads for the next gufunc call made from this OS thread (0: OpenMP's default). Set by the Python
 * layer around one call, so that a per-call num_threads reaches the pragma's num_threads() clause
 * without touching omp_set_num_threads (which would override threadpoolctl / OMP_NUM_THREADS). */
static GDN_THREAD_LOCAL int call_threads = 0;

static void raise_from_loop(PyObject *type, const char *msg)
{
    NPY_ALLOW_C_API_DEF
    NPY_ALLOW_C_API;
    if (!PyErr_Occurred()) PyErr_SetString(type, msg);
    NPY_DISABLE_C_API;
}

/* Byte stride -> element stride; 0 on success. */
static int elem_strides(ptrdiff_t *out, const npy_intp *steps, int count, size_t itemsize)
{
    for (int i = 0; i < count; i++) {
        if (steps[i] % (npy_intp)itemsize != 0) return -1;
        out[i] = (ptrdiff_t)(steps[i] / (npy_intp)itemsize);
    }
    return 0;
}

/* Workspace for nt threads; NULL (with MemoryError set) on failure or size_t overflow. */
static void *alloc_workspace(int nt, size_t len, size_t itemsize)
{
    void *ws = NULL;
    if (len <= SIZE_MAX / itemsize / (size_t)nt) {
        size_t total = (size_t)nt * len * itemsize;
        ws = PyMem_RawMalloc(total ? total : 1);
    }
    if (ws == NULL) raise_from_loop(PyExc_MemoryError, "gdn_ext: cannot allocate the kernel workspace");
    return ws;
}

/* cu_seqlens checked; the longest sequence in *max_len; -1 with ValueError set when bad. */
static int check_cu(const int64_t *cu, ptrdiff_t cu_n, ptrdiff_t cu_m, ptrdiff_t N, ptrdiff_t NS,
                    ptrdiff_t T, ptrdiff_t *max_len)
{
    int r = gdn_check_cu_seqlens(cu, cu_n, cu_m, N, NS, T, max_len);
    if (r == -1)
        raise_from_loop(PyExc_ValueError, "cu_seqlens must start at 0");
    else if (r == -3)
        raise_from_loop(PyExc_ValueError, "cu_seqlens must end at T, the packed length");
    else if (r == -2)
        raise_from_loop(PyExc_ValueError, "cu_seqlens must be non-decreasing");
    return r < 0 ? -1 : 0;
}

/* The forward's items hold some of a state's value rows, all of them at most. */
#define STRIP_ROWS(Dv) (Dv)

#define STRIDES_OR_RETURN(dst, src, count, itemsize)                                            \
    if (elem_strides(dst, src, count, itemsize) < 0) {                                          \
        raise_from_loop(PyExc_ValueError, "gdn_ext: operand strides must be multiples of the item size"); \
        return;                                                                                 \
    }

/*
 * Forward loop, scalar gate. Signature (t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k)
 *   args:       q, k, v, alpha, beta, S_0, scale, o, S_T
 *   dimensions: [N, T, Dk, Dv]
 *   steps:      9 outer strides (one per operand), then the core strides
 *               q(t,k) k(t,k) v(t,v) alpha(t) beta(t) S_0(v,k) o(t,v) S_T(v,k)  -- 23 in all
 * A scalar gate is a per-key gate with key stride 0; one unpacked sequence: cu_seqlens = {0, T}.
 */
#define DEFINE_FWD_LOOP(SUF, REAL)                                                              \
static void fwd_loop_##SUF(char **args, npy_intp const *dims, npy_intp const *steps, void *data) \
{                                                                                               \
    (void)data;                                                                                 \
    const gdn_sizes sz = {dims[0], dims[1], 1, dims[2], dims[3], 1};                            \
    ptrdiff_t e[23];                                                                            \
    STRIDES_OR_RETURN(e, steps, 23, sizeof(REAL))                                               \
    const gdn_fwd_strides st = {                                                                \
        e[0], e[9], e[10],  e[1], e[11], e[12],  e[2], e[13], e[14],                            \
        e[3], e[15], 0,  e[4], e[16],  e[5], 0, e[17], e[18],  e[6],  0,  0, 1,                 \
        e[7], e[19], e[20],  e[8], 0, e[21], e[22]};                                            \
    const int64_t cu[2] = {0, (int64_t)sz.T};                                                   \
    const REAL no = 0;                                                                          \
    const int nt = gdn_threads_for(gdn_fwd_items(sz.N, sz.Dv), call_threads);                   \
    REAL *ws = alloc_workspace(nt, gdn_fwd_workspace_len(sz.T, sz.Dk, STRIP_ROWS(sz.Dv)), sizeof(REAL)); \
    if (ws == NULL) return;                                                                     \
    gdn_forward_##SUF((REAL *)args[7], (REAL *)args[8],                                         \
                      (const REAL *)args[0], (const REAL *)args[1], (const REAL *)args[2],      \
                      (const REAL *)args[3], (const REAL *)args[4], (const REAL *)args[5],      \
                      (const REAL *)args[6], &no, cu, &st, &sz, nt, ws);                        \
    PyMem_RawFree(ws);                                                                          \
}

/*
 * Backward loop, scalar gate.
 * Signature (t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),()->(t,k),(t,k),(t,v),(t),(t),(v,k)
 *   args:       do, q, k, v, alpha, beta, S_0, dS_T, scale, dq, dk, dv, dalpha, dbeta, dS_0
 *   dimensions: [N, T, Dv, Dk]   (core dimensions in order of first appearance: t, v, k)
 *   steps:      15 outer strides, then the core strides
 *               do(t,v) q(t,k) k(t,k) v(t,v) alpha(t) beta(t) S_0(v,k) dS_T(v,k)
 *               dq(t,k) dk(t,k) dv(t,v) dalpha(t) dbeta(t) dS_0(v,k)  -- 39 in all
 */
#define DEFINE_BWD_LOOP(SUF, REAL)                                                              \
static void bwd_loop_##SUF(char **args, npy_intp const *dims, npy_intp const *steps, void *data) \
{                                                                                               \
    (void)data;                                                                                 \
    const gdn_sizes sz = {dims[0], dims[1], 1, dims[3], dims[2], 1};                            \
    ptrdiff_t e[39];                                                                            \
    STRIDES_OR_RETURN(e, steps, 39, sizeof(REAL))                                               \
    const gdn_bwd_strides st = {                                                                \
        e[0], e[15], e[16],  e[1], e[17], e[18],  e[2], e[19], e[20],  e[3], e[21], e[22],      \
        e[4], e[23], 0,  e[5], e[24],  e[6], 0, e[25], e[26],  e[7], 0, e[27], e[28],  e[8],    \
        0,  0, 1,                                                                               \
        e[9], e[29], e[30],  e[10], e[31], e[32],  e[11], e[33], e[34],                         \
        e[12], e[35], 0,  e[13], e[36],  e[14], 0, e[37], e[38]};                               \
    const int64_t cu[2] = {0, (int64_t)sz.T};                                                   \
    const REAL no = 0;                                                                          \
    const int nt = gdn_threads_for(gdn_bwd_items(sz.N, sz.Dv), call_threads);                   \
    REAL *ws = alloc_workspace(nt, gdn_bwd_workspace_len(sz.T, sz.Dk, sz.Dv), sizeof(REAL));    \
    if (ws == NULL) return;                                                                     \
    gdn_backward_##SUF((REAL *)args[9], (REAL *)args[10], (REAL *)args[11], (REAL *)args[12],   \
                       (REAL *)args[13], (REAL *)args[14],                                      \
                       (const REAL *)args[0], (const REAL *)args[1], (const REAL *)args[2],     \
                       (const REAL *)args[3], (const REAL *)args[4], (const REAL *)args[5],     \
                       (const REAL *)args[6], (const REAL *)args[7], (const REAL *)args[8],     \
                       &no, cu, &st, &sz, nt, ws);                                              \
    PyMem_RawFree(ws);                                                                          \
}

/*
 * Forward loop, general: per-key gate, in-kernel q/k normalisation, packed sequences.
 * Signature (t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m)->(t,v),(n,v,k)
 *   args:       q, k, v, alpha, beta, S_0, scale, normalize_qk, cu_seqlens (int64), o, S_T
 *   dimensions: [N, T, Dk, Dv, NS, M = NS + 1]
 *   steps:      11 outer strides, then the core strides
 *               q(t,k) k(t,k) v(t,v) alpha(t,k) beta(t) S_0(n,v,k) cu(m) o(t,v) S_T(n,v,k) -- 29
 */
#define DEFINE_GEN_FWD_LOOP(SUF, REAL)                                                          \
static void gen_fwd_loop_##SUF(char **args, npy_intp const *dims, npy_intp const *steps,        \
                               void *data)                                                      \
{                                                                                               \
    (void)data;                                                                                 \
    const gdn_sizes sz = {dims[0], dims[1], dims[4], dims[2], dims[3], 0};                      \
    ptrdiff_t e[29], c[2];                                                                      \
    if (dims[5] != dims[4] + 1) {                                                               \
        raise_from_loop(PyExc_ValueError, "cu_seqlens must have one more entry than there are "  \
                        "sequences (initial_state's sequence axis)");                           \
        return;                                                                                 \
    }                                                                                           \
    STRIDES_OR_RETURN(e, steps, 29, sizeof(REAL))                                               \
    npy_intp cs[2] = {steps[8], steps[23]};                                                     \
    STRIDES_OR_RETURN(c, cs, 2, sizeof(int64_t))                                                \
    const gdn_fwd_strides st = {                                                                \
        e[0], e[11], e[12],  e[1], e[13], e[14],  e[2], e[15], e[16],  e[3], e[17], e[18],      \
        e[4], e[19],  e[5], e[20], e[21], e[22],  e[6],  e[7],  c[0], c[1],                     \
        e[9], e[24], e[25],  e[10], e[26], e[27], e[28]};                                       \
    ptrdiff_t max_len = 0;                                                                      \
    if (check_cu((const int64_t *)args[8], c[0], c[1], sz.N, sz.NS, sz.T, &max_len) < 0) return; \
    const int nt = gdn_threads_for(gdn_fwd_items(sz.N * sz.NS, sz.Dv), call_threads);           \
    REAL *ws = alloc_workspace(nt, gdn_fwd_workspace_len(max_len, sz.Dk, STRIP_ROWS(sz.Dv)), sizeof(REAL)); \
    if (ws == NULL) return;                                                                     \
    gdn_forward_##SUF((REAL *)args[9], (REAL *)args[10],                                        \
                      (const REAL *)args[0], (const REAL *)args[1], (const REAL *)args[2],      \
                      (const REAL *)args[3], (const REAL *)args[4], (const REAL *)args[5],      \
                      (const REAL *)args[6], (const REAL *)args[7], (const int64_t *)args[8],   \
                      &st, &sz, nt, ws);                                                        \
    PyMem_RawFree(ws);                                                                          \
}

/*
 * Backward loop, general.
 * Signature (t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m)
 *           ->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)
 *   args:       do, q, k, v, alpha, beta, S_0, dS_T, scale, normalize_qk, cu_seqlens,
 *               dq, dk, dv, dalpha, dbeta, dS_0
 *   dimensions: [N, T, Dv, Dk, NS, M = NS + 1]
 *   steps:      17 outer strides, then the core strides
 *               do(t,v) q(t,k) k(t,k) v(t,v) alpha(t,k) beta(t) S_0(n,v,k) dS_T(n,v,k) cu(m)
 *               dq(t,k) dk(t,k) dv(t,v) dalpha(t,k) dbeta(t) dS_0(n,v,k)  -- 47 in all
 */
#define DEFINE_GEN_BWD_LOOP(SUF, REAL)                                                          \
static void gen_bwd_loop_##SUF(char **args, npy_intp const *dims, npy_intp const *steps,        \
                               void *data)                                                      \
{                                                                                               \
    (void)data;                                                                                 \
    const gdn_sizes sz = {dims[0], dims[1], dims[4], dims[3], dims[2], 0};                      \
    ptrdiff_t e[47], c[2];                                                                      \
    if (dims[5] != dims[4] + 1) {                                                               \
        raise_from_loop(PyExc_ValueError, "cu_seqlens must have one more entry than there are "  \
                        "sequences (initial_state's sequence axis)");                           \
        return;                                                                                 \
    }                                                                                           \
    STRIDES_OR_RETURN(e, steps, 47, sizeof(REAL))                                               \
    npy_intp cs[2] = {steps[10], steps[34]};                                                    \
    STRIDES_OR_RETURN(c, cs, 2, sizeof(int64_t))                                                \
    const gdn_bwd_strides st = {                                                                \
        e[0], e[17], e[18],  e[1], e[19], e[20],  e[2], e[21], e[22],  e[3], e[23], e[24],      \
        e[4], e[25], e[26],  e[5], e[27],  e[6], e[28], e[29], e[30],                           \
        e[7], e[31], e[32], e[33],  e[8],  e[9],  c[0], c[1],                                   \
        e[11], e[35], e[36],  e[12], e[37], e[38],  e[13], e[39], e[40],                        \
        e[14], e[41], e[42],  e[15], e[43],  e[16], e[44], e[45], e[46]};                       \
    ptrdiff_t max_len = 0;                                                                      \
    if (check_cu((const int64_t *)args[10], c[0], c[1], sz.N, sz.NS, sz.T, &max_len) < 0) return; \
    const int nt = gdn_threads_for(gdn_bwd_items(sz.N * sz.NS, sz.Dv), call_threads);           \
    REAL *ws = alloc_workspace(nt, gdn_bwd_workspace_len(max_len, sz.Dk, sz.Dv), sizeof(REAL)); \
    if (ws == NULL) return;                                                                     \
    gdn_backward_##SUF((REAL *)args[11], (REAL *)args[12], (REAL *)args[13], (REAL *)args[14],  \
                       (REAL *)args[15], (REAL *)args[16],                                      \
                       (const REAL *)args[0], (const REAL *)args[1], (const REAL *)args[2],     \
                       (const REAL *)args[3], (const REAL *)args[4], (const REAL *)args[5],     \
                       (const REAL *)args[6], (const REAL *)args[7], (const REAL *)args[8],     \
                       (const REAL *)args[9], (const int64_t *)args[10], &st, &sz, nt, ws);     \
    PyMem_RawFree(ws);                                                                          \
}

DEFINE_FWD_LOOP(f32, float)
DEFINE_FWD_LOOP(f64, double)
DEFINE_BWD_LOOP(f32, float)
DEFINE_BWD_LOOP(f64, double)
DEFINE_GEN_FWD_LOOP(f32, float)
DEFINE_GEN_FWD_LOOP(f64, double)
DEFINE_GEN_BWD_LOOP(f32, float)
DEFINE_GEN_BWD_LOOP(f64, double)

/* The gufunc table: one entry per operation, float32 then float64 loops (NumPy picks the first loop
 * its casting rules allow, so float16 and small ints run in float32, other ints in float64). */
static PyUFuncGenericFunction fwd_funcs[] = {fwd_loop_f32, fwd_loop_f64};
static PyUFuncGenericFunction bwd_funcs[] = {bwd_loop_f32, bwd_loop_f64};
static PyUFuncGenericFunction gen_fwd_funcs[] = {gen_fwd_loop_f32, gen_fwd_loop_f64};
static PyUFuncGenericFunction gen_bwd_funcs[] = {gen_bwd_loop_f32, gen_bwd_loop_f64};
static void *no_data[] = {NULL, NULL};
#define TF NPY_FLOAT
#define TD NPY_DOUBLE
#define TI NPY_INT64
static const char fwd_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF,  TD, TD, TD, TD, TD, TD, TD, TD, TD};
static const char bwd_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF,
                                 TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD};
static const char gen_fwd_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF,
                                     TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD};
static const char gen_bwd_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF, TF, TF, TF,
                                     TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD, TD, TD, TD};
#undef TF
#undef TD
#undef TI

typedef struct {
    const char *name;
    PyUFuncGenericFunction *funcs;
    const char *types;
    int nin, nout;
    const char *signature;
    const char *doc;
} gufunc_descriptor;

static const gufunc_descriptor gufuncs[] = {
    {"gated_delta_rule_fwd", fwd_funcs, fwd_types, 7, 2,
     "(t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k)",
     "gated_delta_rule_fwd(q, k, v, alpha, beta, S_0, scale, /, out=None, **kwargs) -> (o, S_T)\n\n"
     "Gated delta rule forward, one (sequence, head) per loop element.\n"
     "Signature (t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k); float32 and float64 loops.\n"
     "S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T;  o_t = scale S_t q_t.\n"
     "Yang, Kautz, Hatamizadeh, Gated Delta Networks, ICLR 2025. See gdn_ext.ufuncs."},
    {"gated_delta_rule_bwd", bwd_funcs, bwd_types, 9, 6,
     "(t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),()->(t,k),(t,k),(t,v),(t),(t),(v,k)",
     "gated_delta_rule_bwd(do, q, k, v, alpha, beta, S_0, dS_T, scale, /, out=None, **kwargs)\n"
     "    -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "Backward over time of gated_delta_rule_fwd, with states recomputed from checkpoints.\n"
     "Signature (t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),()->(t,k),(t,k),(t,v),(t),(t),(v,k).\n"
     "See gdn_ext.ufuncs."},
    {"gated_delta_rule_general_fwd", gen_fwd_funcs, gen_fwd_types, 9, 2,
     "(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m)->(t,v),(n,v,k)",
     "gated_delta_rule_general_fwd(q, k, v, alpha, beta, S_0, scale, normalize_qk, cu_seqlens, /,\n"
     "    out=None, **kwargs) -> (o, S_T)\n\n"
     "Forward with a per-key gate alpha [t, k], optional in-kernel q/k L2 normalisation\n"
     "(normalize_qk != 0) and n sequences packed along t (cu_seqlens int64 [n + 1]).\n"
     "See gdn_ext.ufuncs."},
    {"gated_delta_rule_general_bwd", gen_bwd_funcs, gen_bwd_types, 11, 6,
     "(t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m)->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)",
     "gated_delta_rule_general_bwd(do, q, k, v, alpha, beta, S_0, dS_T, scale, normalize_qk,\n"
     "    cu_seqlens, /, out=None, **kwargs) -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "Backward of gated_delta_rule_general_fwd. See gdn_ext.ufuncs."},
};

static PyObject *py_openmp_enabled(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(gdn_openmp_enabled());
}

static PyObject *py_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(gdn_isa());
}

static PyObject *py_set_call_threads(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "num_threads must be between 0 and INT_MAX");
        return NULL;
    }
    int prev = call_threads;
    call_threads = (int)n;
    return PyLong_FromLong(prev);
}

static PyObject *py_threads_for(PyObject *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(gdn_threads_for(n, call_threads));
}

static PyObject *py_checkpoint_interval(PyObject *self, PyObject *arg)
{
    Py_ssize_t T = PyLong_AsSsize_t(arg);
    if (T == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(gdn_checkpoint_interval(T));
}

static PyObject *py_bwd_workspace_len(PyObject *self, PyObject *args)
{
    Py_ssize_t T, Dk, Dv;
    if (!PyArg_ParseTuple(args, "nnn", &T, &Dk, &Dv)) return NULL;
    return PyLong_FromSize_t(gdn_bwd_workspace_len(T, Dk, Dv));
}

static PyObject *py_fma_peak(PyObject *self, PyObject *args)
{
    int use_double = 0, threads = 0;
    double seconds = 0.2;
    if (!PyArg_ParseTuple(args, "pi|d", &use_double, &threads, &seconds)) return NULL;
    if (threads < 0 || !(seconds > 0 && seconds < 60)) {
        PyErr_SetString(PyExc_ValueError, "fma_peak: threads must be >= 0, seconds in (0, 60)");
        return NULL;
    }
    double r;
    Py_BEGIN_ALLOW_THREADS
    r = gdn_fma_peak(use_double, threads, seconds);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(r);
}

static PyMethodDef methods[] = {
    {"fma_peak", py_fma_peak, METH_VARARGS,
     "fma_peak(float64: bool, threads: int, seconds=0.2) -> GFLOP/s: the multiply-add ceiling of\n"
     "the kernels' instruction set (isa()) on `threads` threads (0: OpenMP's default), from\n"
     "independent vector FMA chains; a multiply-add counts 2 floating-point operations."},
    {"openmp_enabled", py_openmp_enabled, METH_NOARGS,
     "openmp_enabled() -> bool: whether this build runs the (sequence, head) loop with OpenMP."},
    {"isa", py_isa, METH_NOARGS,
     "isa() -> 'generic' | 'avx2' | 'avx512': the instruction set the kernels were picked for."},
    {"_set_call_threads", py_set_call_threads, METH_O,
     "_set_call_threads(n) -> previous: threads for gufunc calls from this OS thread (0: default)."},
    {"_threads_for", py_threads_for, METH_O,
     "_threads_for(N) -> threads a call over N (sequence, head) pairs would use now."},
    {"checkpoint_interval", py_checkpoint_interval, METH_O,
     "checkpoint_interval(T) -> C: the backward keeps the state every C = ceil(sqrt(T)) steps."},
    {"bwd_workspace_len", py_bwd_workspace_len, METH_VARARGS,
     "bwd_workspace_len(T, Dk, Dv) -> elements of backward workspace per thread."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "gdn_ext._core",
    "C kernels of gdn_ext: the gated delta rule as NumPy generalized ufuncs.", -1, methods};

PyMODINIT_FUNC PyInit__core(void)
{
    import_array();
    import_umath();
    gdn_init();
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    for (size_t i = 0; i < sizeof(gufuncs) / sizeof(gufuncs[0]); i++) {
        const gufunc_descriptor *d = &gufuncs[i];
        PyObject *f = PyUFunc_FromFuncAndDataAndSignature(
            d->funcs, no_data, (char *)d->types, 2, d->nin, d->nout, PyUFunc_None, d->name, d->doc,
            0, d->signature);
        if (f == NULL || PyModule_AddObject(m, d->name, f) < 0) {
            Py_XDECREF(f);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
