/*
 * _core.c -- CPython / NumPy glue: registers the kernels of gdn_kernels.c as generalized ufuncs.
 *
 * Kept apart from the kernels so that they stay plain C. Here: byte strides become element strides,
 * per-thread workspace is allocated (from _block_cache.c, traced by tracemalloc) before the parallel
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
#include "_block_cache.h"
#include <fenv.h>
#if !defined(_WIN32)
#include <pthread.h>
#include <signal.h>
#endif

#if defined(_MSC_VER)
#define GDN_THREAD_LOCAL __declspec(thread)
#else
#define GDN_THREAD_LOCAL _Thread_local
#endif

/* Threads for the next gufunc call made from this OS thread (0: OpenMP's default). Set by the Python
 * layer around one call, so that a per-call num_threads reaches the pragma's num_threads() clause
 * without touching omp_set_num_threads (which would override threadpoolctl / OMP_NUM_THREADS). */
static GDN_THREAD_LOCAL int call_threads = 0;
/* Tokens per chunk of the chunkwise form for the checked call open on this OS thread (0: the
 * recurrence). Set with the thread count by _call_begin; bare gufunc calls run the recurrence. */
static GDN_THREAD_LOCAL ptrdiff_t call_chunk = 0;
static GDN_THREAD_LOCAL int call_chunk_auto = 0;   /* per pair, where the chunkwise form suits */
/* the _ckpt gufuncs' checkpoints are the chunk form's states (its pairs'), not the recurrence's */
static GDN_THREAD_LOCAL int call_chunk_states = 0;

/* This OS thread's calls (see "calls and Ctrl-C" below). */
typedef struct {
    int depth;                /* calls open on this thread (nested only from a signal handler) */
    int failed;               /* an inner loop of this gufunc call left an error set */
    gdn_cancel_flag cancel;   /* the main thread's call: set by on_sigint */
    int saved_threads[8];     /* call_threads before each open call (_call_begin) */
    ptrdiff_t saved_chunk[8]; /* call_chunk likewise */
    int saved_auto[8];        /* call_chunk_auto likewise */
    int saved_states[8];      /* call_chunk_states likewise */
} call_state;
static GDN_THREAD_LOCAL call_state this_call;

static void raise_from_loop(PyObject *type, const char *msg)
{
    NPY_ALLOW_C_API_DEF
    NPY_ALLOW_C_API;
    if (!PyErr_Occurred()) PyErr_SetString(type, msg);
    NPY_DISABLE_C_API;
    this_call.failed = 1;
}

/* Workspace for nt threads; NULL (with MemoryError set) on failure or size_t overflow. */
static void *alloc_workspace(int nt, size_t len, size_t itemsize)
{
    void *ws = NULL;
    if (len <= SIZE_MAX / itemsize / (size_t)nt) {
        size_t total = (size_t)nt * len * itemsize;
        ws = gdn_workspace_alloc(total);
    }
    if (ws == NULL) raise_from_loop(PyExc_MemoryError, "gdn_ext: cannot allocate the kernel workspace");
    return ws;
}

/* cu_seqlens checked; the longest sequence in *max_len; -1 with ValueError set when bad.
 * Protects memory: the kernels index t by it (the Python API checks it first, with its own
 * messages; this stands for the raw gufuncs). */
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

/* One operand's element strides in a gufunc loop: its outer (loop) stride and its core strides.
 * NumPy passes every operand's outer stride first, then the core strides operand by operand. */
typedef struct {
    ptrdiff_t n, c[4];
} op_strides;

/* The strides of nops operands with core_ndim[i] core dimensions and items of itemsize[i] bytes;
 * -1 with ValueError set when one is not a multiple of its item size (protects memory: the
 * kernels step in whole elements). */
static int operand_strides(op_strides *op, const npy_intp *steps, const int *core_ndim,
                           const size_t *itemsize, int nops)
{
    int pos = nops;
    for (int i = 0; i < nops; i++) {
        const npy_intp size = (npy_intp)itemsize[i];
        if (steps[i] % size != 0) goto bad;
        op[i].n = (ptrdiff_t)(steps[i] / size);
        for (int d = 0; d < core_ndim[i]; d++, pos++) {
            if (steps[pos] % size != 0) goto bad;
            op[i].c[d] = (ptrdiff_t)(steps[pos] / size);
        }
    }
    return 0;
bad:
    raise_from_loop(PyExc_ValueError, "gdn_ext: operand strides must be multiples of the item size");
    return -1;
}

/* Enough checkpoints for the longest sequence? (-1 with ValueError set if not.) Protects memory:
 * the backward reads, the forward writes, one per C steps of the longest sequence. */
static int check_ckpt_count(ptrdiff_t have, ptrdiff_t max_len, const gdn_sizes *sz)
{
    const ptrdiff_t need = sz->chunk_states
                               ? gdn_chunk_checkpoint_count(max_len, sz->chunk, sz->Dk, sz->Dv)
                               : gdn_checkpoint_count(max_len);
    if (have >= need) return 0;
    char msg[200];
    snprintf(msg, sizeof msg, "checkpoints: need %td along their axis c for sequences of %td steps "
             "(%s), got %td", need, max_len,
             sz->chunk_states ? "the chunk form's states" : "gdn_ext.checkpoint_count", have);
    raise_from_loop(PyExc_ValueError, msg);
    return -1;
}

/* The general loops' packing: cu_seqlens [n + 1] (dims[4] = n, dims[5] = m) checked, the longest
 * sequence in sz->max_len, and enough checkpoints (dims[6]) when ck; -1 with ValueError set if
 * not. */
static int check_packed(const char *cu, ptrdiff_t cu_n, ptrdiff_t cu_m, npy_intp const *dims, int ck,
                        gdn_sizes *sz)
{
    ptrdiff_t *max_len = &sz->max_len;
    if (dims[5] != dims[4] + 1) {
        raise_from_loop(PyExc_ValueError, "cu_seqlens must have one more entry than there are "
                        "sequences (initial_state's sequence axis)");
        return -1;
    }
    if (check_cu((const int64_t *)cu, cu_n, cu_m, dims[0], dims[4], dims[1], max_len) < 0)
        return -1;
    if (ck) sz->nck = dims[6];
    return ck ? check_ckpt_count(dims[6], *max_len, sz) : 0;
}

/* In a child made by fork() after the parent ran a parallel region, the OpenMP runtime's
 * threads are gone but the runtime does not know it: a parallel region with more than one thread
 * never returns. A child therefore runs every call on one thread. */
static volatile int forked_child = 0;

/* The team for a call over `items` work items: one thread in a forked child; else this OS
 * thread's request (call_threads, 0: OpenMP's default) under the busy-machine cap. */
static int team_size(ptrdiff_t items)
{
    if (forked_child) return 1;
    return gdn_capped_threads(gdn_threads_for(items, call_threads), call_threads);
}

/* ---- exact aliases of outputs and inputs --------------------------------------------------
 * NumPy copies an input that partly overlaps an output, but passes one that is exactly an output
 * (same memory, same strides) through, assuming element-wise access. The kernels are not
 * element-wise (they read inputs of later steps after writing outputs of earlier ones), so such
 * an input is copied here first. The one exception is the forward's S_0 given as S_T's memory
 * (gated_delta_rule_step(inplace=True)): each state row is read whole before it is written. */

/* The byte range [*lo, *hi) operand i touches; empty (lo == hi) when a dimension is 0. */
static void operand_range(const char *base, const op_strides *p, const int *cd, int nd,
                          const npy_intp *dims, size_t is, const char **lo, const char **hi)
{
    ptrdiff_t a = 0, b = 0;
    const npy_intp counts[5] = {dims[0], nd > 0 ? dims[cd[0]] : 1, nd > 1 ? dims[cd[1]] : 1,
                                nd > 2 ? dims[cd[2]] : 1, nd > 3 ? dims[cd[3]] : 1};
    const ptrdiff_t strides[5] = {p->n, p->c[0], p->c[1], p->c[2], p->c[3]};
    *lo = *hi = base;
    for (int d = 0; d < 5; d++) {
        if (counts[d] == 0) return;
        const ptrdiff_t e = (ptrdiff_t)(counts[d] - 1) * strides[d];
        if (e < 0) a += e; else b += e;
    }
    *lo = base + a * (ptrdiff_t)is;
    *hi = base + (b + 1) * (ptrdiff_t)is;
}

/* Copies input i (outer dimension and nd core dimensions, item size is) into a new contiguous
 * buffer and points args[i] / p[i] at it; NULL with MemoryError set on failure. */
static void *copy_operand(char **args, op_strides *p, int i, const int *cd, int nd,
                          const npy_intp *dims, size_t is)
{
    npy_intp counts[5] = {dims[0], 1, 1, 1, 1};
    ptrdiff_t src[5] = {p[i].n, 0, 0, 0, 0}, dst[5];
    for (int d = 0; d < nd; d++) {
        counts[d + 1] = dims[cd[d]];
        src[d + 1] = p[i].c[d];
    }
    size_t total = 1;
    for (int d = 4; d >= 0; d--) {
        dst[d] = (ptrdiff_t)total;
        total *= (size_t)counts[d];
    }
    char *buf = PyMem_RawMalloc(total ? total * is : 1);
    if (buf == NULL) {
        raise_from_loop(PyExc_MemoryError, "gdn_ext: cannot copy an input that aliases an output");
        return NULL;
    }
    for (npy_intp a = 0; a < counts[0]; a++)
        for (npy_intp b = 0; b < counts[1]; b++)
            for (npy_intp c = 0; c < counts[2]; c++)
                for (npy_intp d = 0; d < counts[3]; d++)
                    for (npy_intp e = 0; e < counts[4]; e++)
                        memcpy(buf + (a * dst[0] + b * dst[1] + c * dst[2] + d * dst[3] + e) * is,
                               args[i] + (a * src[0] + b * src[1] + c * src[2] + d * src[3]
                                          + e * src[4]) * (ptrdiff_t)is, is);
    args[i] = buf;
    p[i].n = dst[0];
    for (int d = 0; d < nd; d++) p[i].c[d] = dst[d + 1];
    return buf;
}

/* Inputs 0 .. nin - 1 that overlap an output nin .. nops - 1 are copied (tmp[i] the copy, to
 * free); keep_in / keep_out: an exact alias pair left alone (-1: none). -1 on error. */
static int unalias_inputs(char **args, op_strides *p, const int *nd, const int (*cd)[4],
                          const size_t *is, const npy_intp *dims, int nin, int nops, int keep_in,
                          int keep_out, void **tmp)
{
    for (int i = 0; i < nin; i++) tmp[i] = NULL;
    for (int i = 0; i < nin; i++) {
        const char *lo, *hi;
        operand_range(args[i], &p[i], cd[i], nd[i], dims, is[i], &lo, &hi);
        if (lo == hi) continue;
        for (int j = nin; j < nops; j++) {
            const char *olo, *ohi;
            operand_range(args[j], &p[j], cd[j], nd[j], dims, is[j], &olo, &ohi);
            if (olo == ohi || ohi <= lo || hi <= olo) continue;
            if (i == keep_in && j == keep_out && args[i] == args[j]
                && memcmp(&p[i], &p[j], sizeof(op_strides)) == 0)
                continue;
            if ((tmp[i] = copy_operand(args, p, i, cd[i], nd[i], dims, is[i])) == NULL) return -1;
            break;
        }
    }
    return 0;
}

static void free_copies(void **tmp, int n)
{
    for (int i = 0; i < n; i++) PyMem_RawFree(tmp[i]);
}

/* ---- calls and Ctrl-C ---------------------------------------------------------------------
 * A call is one gufunc call: the checked API opens it around the ufunc (_call_begin / _call_end),
 * so that it spans NumPy's casts and every inner-loop call (NumPy calls the inner loop once per
 * outer row, B times for a [B, H, ...] view); a bare gufunc call opens one per inner-loop call.
 *
 * Ctrl-C belongs to the main thread, where Python runs its signal handlers. While the main thread
 * is in a call, on_sigint sits in front of the SIGINT handler it found (Python's): it passes the
 * signal on, then sets that call's flag, and the kernels stop within a block of tokens (forward)
 * or a segment (backward). The main thread then runs Python's handler (PyErr_CheckSignals): if it
 * raises (KeyboardInterrupt), the call fails and its half-written outputs are dropped with it; if
 * it does not, the kernel runs again from its unchanged inputs and the call completes. Calls on
 * other threads are never cut short (they complete, as NumPy's own do), and a call that writes
 * its state in place (S_0 is S_T's memory) always completes, the signal then raising after it.
 * When the call ends, SIGINT's disposition is put back unless a handler replaced ours meanwhile.
 * POSIX only: on Windows a call runs to its end and Python raises after it. */
static unsigned long main_ident;   /* Python's main thread (after a fork: the forking thread) */

static int on_main_thread(void) { return PyThread_get_thread_ident() == main_ident; }

#if !defined(_WIN32)
static struct sigaction replaced;               /* the disposition on_sigint stands in front of */
static volatile sig_atomic_t armed = 0;         /* on_sigint installed by this module */
static gdn_cancel_flag *volatile main_flag;     /* the flag of the main thread's open call */

static void on_sigint(int sig, siginfo_t *info, void *context)
{
    /* Python's handler first: it has recorded the signal by the time the kernels stop */
    if (replaced.sa_flags & SA_SIGINFO) {
        if (replaced.sa_sigaction != NULL) replaced.sa_sigaction(sig, info, context);
    } else if (replaced.sa_handler != SIG_DFL && replaced.sa_handler != SIG_IGN) {
        replaced.sa_handler(sig);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    gdn_cancel_flag *f = main_flag;
    if (f != NULL) *f = 1;
}

static int is_ours(const struct sigaction *sa)
{
    return (sa->sa_flags & SA_SIGINFO) && sa->sa_sigaction == on_sigint;
}

/* on_sigint in front of the current handler, unless it is there already or there is no handler
 * to pass the signal to (SIG_DFL: Ctrl-C kills the process; SIG_IGN). Main thread only. */
static void arm(void)
{
    struct sigaction cur;
    if (sigaction(SIGINT, NULL, &cur) != 0) return;
    if (is_ours(&cur)) {
        armed = 1;
        return;
    }
    if (!(cur.sa_flags & SA_SIGINFO) && (cur.sa_handler == SIG_DFL || cur.sa_handler == SIG_IGN))
        return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigint;
    sa.sa_flags = SA_SIGINFO | (cur.sa_flags & (SA_ONSTACK | SA_RESTART));
    sigemptyset(&sa.sa_mask);
    replaced = cur;
    if (sigaction(SIGINT, &sa, NULL) == 0) armed = 1;
}

/* The replaced handler back, if on_sigint is still installed (a handler that Python code set
 * meanwhile, from a signal handler, stays). */
static void disarm(void)
{
    struct sigaction cur;
    if (armed && sigaction(SIGINT, NULL, &cur) == 0 && is_ours(&cur))
        sigaction(SIGINT, &replaced, NULL);
    armed = 0;
}

/* In a fork() child the forking thread is the main thread, and no call is open: a handler the
 * parent's main thread had armed for its call is put back (the child never ends that call). */
static void after_fork_in_child(void)
{
    forked_child = 1;
    main_ident = PyThread_get_thread_ident();
    main_flag = NULL;
    disarm();
}
#else
static void arm(void) {}
static void disarm(void) {}
#endif

/* Opens a call on this thread; the main thread's outermost one watches for Ctrl-C. */
static void call_open(int explicit_call)
{
    if (this_call.depth++ > 0) return;
    if (explicit_call) this_call.failed = 0;
    this_call.cancel = 0;
#if !defined(_WIN32)
    if (on_main_thread()) {
        main_flag = &this_call.cancel;
        arm();
    }
#endif
}

static void call_close(void)
{
    if (this_call.depth == 0 || --this_call.depth > 0) return;
#if !defined(_WIN32)
    if (main_flag == &this_call.cancel) {
        disarm();
        main_flag = NULL;
    }
#endif
}

/* The Ctrl-C flag for this thread's kernel run; NULL: it runs to the end. */
static gdn_cancel_flag *call_flag(void)
{
#if !defined(_WIN32)
    if (main_flag == &this_call.cancel) return &this_call.cancel;
#endif
    return NULL;
}

/* After a SIGINT stopped (or was about to start) a kernel run: Python's handlers run here.
 * -1: one raised (the error is set; the call fails); 1: none raised, run the kernel again. */
static int after_interrupt(void)
{
    int r;
    this_call.cancel = 0;   /* first: a signal during the handler stops the next run */
    NPY_ALLOW_C_API_DEF
    NPY_ALLOW_C_API;
    r = PyErr_CheckSignals();
    if (r == 0) {
        arm();              /* the handler may have set another one (signal.signal) */
        /* this call had not failed (its kernel ran); a failure of a call the handler made, and
         * caught, is not this call's */
        this_call.failed = 0;
    }
    NPY_DISABLE_C_API;
    if (r < 0) {
        this_call.failed = 1;
        /* NumPy would report these flags by calling Python with the error set */
        feclearexcept(FE_ALL_EXCEPT);
        return -1;
    }
    return 1;
}

/* Whether this inner-loop call is to return at once: an earlier one of the same gufunc call left
 * an error set (NumPy goes on calling the inner loop; the results are dropped anyway). */
static int skip_loop(void)
{
    if (!this_call.failed) return 0;
    if (this_call.depth > 0) return 1;   /* an explicit call: failed was cleared when it opened */
    int pending;
    NPY_ALLOW_C_API_DEF
    NPY_ALLOW_C_API;
    pending = PyErr_Occurred() != NULL;
    NPY_DISABLE_C_API;
    if (!pending) this_call.failed = 0;   /* a new bare gufunc call */
    return pending;
}

/* One kernel call: forward or backward (the other NULL), float64 or float32. */
typedef struct {
    gdn_fwd_call *fwd;
    gdn_bwd_call *bwd;
    int f64;
} kernel_job;

static void run(const kernel_job *job, void *ws)
{
    if (job->fwd != NULL) {
        job->fwd->ws = ws;
        (job->f64 ? gdn_forward_f64 : gdn_forward_f32)(job->fwd);
    } else {
        job->bwd->ws = ws;
        (job->f64 ? gdn_backward_f64 : gdn_backward_f32)(job->bwd);
    }
}

/* Runs a kernel over nt threads' workspace of len items of `is` bytes each (NULL workspace: error
 * set), as the main thread's call asks: stopped by Ctrl-C, then dropped (a handler raised) or run
 * again to its end, once, this time not stopped (signals then are handled when it ends: a stream
 * of SIGINTs whose handler does not raise cannot keep a call from finishing). `inplace`: S_0 is
 * S_T's memory, a second run would start from a half-updated state, so it is never stopped.
 * sz is the call's sizes (its cancel flag is set here). */
static void run_with_workspace(int nt, size_t len, size_t is, int inplace, gdn_sizes *sz,
                               const kernel_job *job)
{
    void *ws = alloc_workspace(nt, len, is);
    if (ws == NULL) return;
    const int bare = this_call.depth == 0;
    if (bare) call_open(0);
    gdn_cancel_flag *flag = inplace ? NULL : call_flag();
    const int r = GDN_CANCELLED(flag) ? after_interrupt() : 0;   /* during the casts */
    if (r >= 0) {
        sz->cancel = flag;
        run(job, ws);
        if (GDN_CANCELLED(flag) && after_interrupt() == 1) {
            sz->cancel = NULL;
            run(job, ws);
            if (GDN_CANCELLED(flag)) after_interrupt();
        }
    }
    if (bare) call_close();
    gdn_workspace_free(ws);
}

/* ---- the gufunc loops -----------------------------------------------------------------------
 * One loop function per family (forward, backward) serves all of its gufuncs; the loop's data, a
 * loop_kind, names the variant and the dtype. Operands have roles, listed per family in operand
 * order with their core dimensions by letter:
 *   t steps, k keys, v values, n packed sequences, m cu_seqlens entries, c checkpoints.
 * The scalar-gate gufuncs (dims [N, t, k, v, (c)] forward, [N, t, v, k, (c)] backward: the order
 * in which the signature names them) hold one sequence per loop element; the general ones
 * ([N, t, k|v, v|k, n, m, (c)]) a per-key gate, normalize_qk and n packed sequences; the _ckpt ones
 * the checkpoints; the gated_rule ones delta_rule. A scalar gate is a per-key gate with key
 * stride 0; one unpacked sequence: cu_seqlens = {0, T}. */
typedef struct {
    int general, ckpt, rule;
    int f64;   /* float64 items, else float32 */
} loop_kind;

enum { R_DO, R_Q, R_K, R_V, R_A, R_B, R_S0, R_DST, R_SC, R_NQ, R_CU, R_DR, R_CK, R_O, R_ST,
       R_DQ, R_DK, R_DV, R_DA, R_DB, R_DS0, N_ROLES };
enum { ONLY_CKPT = 1, ONLY_RULE = 2 };
#define MAX_OPS 19

typedef struct {
    int role;
    const char *scalar, *general;   /* core dimensions by letter; NULL: no such operand there */
    int only;                       /* ONLY_CKPT / ONLY_RULE: in those variants alone */
} operand_spec;

static const operand_spec fwd_spec[] = {
    {R_Q, "tk", "tk", 0}, {R_K, "tk", "tk", 0}, {R_V, "tv", "tv", 0}, {R_A, "t", "tk", 0},
    {R_B, "t", "t", 0}, {R_S0, "vk", "nvk", 0}, {R_SC, "", "", 0}, {R_NQ, NULL, "", 0},
    {R_CU, NULL, "m", 0}, {R_DR, NULL, "", ONLY_RULE},
    {R_O, "tv", "tv", 0}, {R_ST, "vk", "nvk", 0}, {R_CK, "cvk", "ncvk", ONLY_CKPT}};
static const operand_spec bwd_spec[] = {
    {R_DO, "tv", "tv", 0}, {R_Q, "tk", "tk", 0}, {R_K, "tk", "tk", 0}, {R_V, "tv", "tv", 0},
    {R_A, "t", "tk", 0}, {R_B, "t", "t", 0}, {R_S0, "vk", "nvk", 0}, {R_DST, "vk", "nvk", 0},
    {R_SC, "", "", 0}, {R_NQ, NULL, "", 0}, {R_CU, NULL, "m", 0}, {R_DR, NULL, "", ONLY_RULE},
    {R_CK, "cvk", "ncvk", ONLY_CKPT},
    {R_DQ, "tk", "tk", 0}, {R_DK, "tk", "tk", 0}, {R_DV, "tv", "tv", 0}, {R_DA, "t", "tk", 0},
    {R_DB, "t", "t", 0}, {R_DS0, "vk", "nvk", 0}};

/* One loop call's operands by role: their strides, core dimensions and item sizes, the inputs
 * that had to be copied away from an output (tmp, to free). */
typedef struct {
    int pos[N_ROLES];            /* operand index of each role, -1: absent */
    int nops, nin;
    int nd[MAX_OPS], cd[MAX_OPS][4];
    size_t is[MAX_OPS];
    op_strides p[MAX_OPS];
    char *args[MAX_OPS];
    void *tmp[MAX_OPS];
    int64_t one_sequence[2];     /* the scalar-gate gufuncs' cu_seqlens: {0, T} */
} loop_operands;

static const op_strides no_strides = {0};

/* The strides of a role; zeros when the variant has no such operand. */
static const op_strides *at(const loop_operands *L, int role)
{
    return L->pos[role] >= 0 ? &L->p[L->pos[role]] : &no_strides;
}

static void *arg(const loop_operands *L, int role)
{
    return L->pos[role] >= 0 ? L->args[L->pos[role]] : NULL;
}

/* normalize_qk and cu_seqlens: the general gufuncs' operands; the scalar-gate ones have none and
 * run one sequence of all T steps, not normalised. */
static const double zero_f64 = 0;
static const float zero_f32 = 0;
static const void *normalize_qk_of(const loop_operands *L, const loop_kind *kind)
{
    if (kind->general) return arg(L, R_NQ);
    return kind->f64 ? (const void *)&zero_f64 : (const void *)&zero_f32;
}

static const int64_t *cu_seqlens_of(const loop_operands *L, const loop_kind *kind)
{
    return kind->general ? (const int64_t *)arg(L, R_CU) : L->one_sequence;
}

/* Reads a family's operands (spec in operand order, out0 its first output's role) for this
 * loop's kind; letters: the family's order of t, k, v in dims. An input that aliases an output is
 * copied (NumPy passes an exact alias through); with keep_alias, S_0 as S_T's memory stays.
 * -1 with an error set (and the copies made before it freed). */
static int read_operands(loop_operands *L, const operand_spec *spec, int nspec, int out0,
                         const loop_kind *kind, const char *letters, char **args,
                         npy_intp const *steps, npy_intp const *dims, int keep_alias)
{
    const char order[] = {letters[0], letters[1], letters[2], 'n', 'm', kind->general ? 'c' : 0, 0};
    for (int r = 0; r < N_ROLES; r++) L->pos[r] = -1;
    for (int i = 0; i < MAX_OPS; i++) L->tmp[i] = NULL;
    L->nops = L->nin = 0;
    L->one_sequence[0] = 0;
    L->one_sequence[1] = (int64_t)dims[1];
    for (int i = 0; i < nspec; i++) {
        const char *core = kind->general ? spec[i].general : spec[i].scalar;
        if (core == NULL || (spec[i].only == ONLY_CKPT && !kind->ckpt)
            || (spec[i].only == ONLY_RULE && !kind->rule))
            continue;
        const int o = L->nops++;
        L->pos[spec[i].role] = o;
        if (L->pos[out0] < 0) L->nin++;   /* before the first output: an input */
        L->nd[o] = (int)strlen(core);
        for (int d = 0; d < L->nd[o]; d++)   /* 'c' is dims[4] when there are no n, m */
            L->cd[o][d] = core[d] == 'c' && !kind->general ? 4
                          : (int)(strchr(order, core[d]) - order) + 1;
        L->is[o] = spec[i].role == R_CU ? sizeof(int64_t) : kind->f64 ? sizeof(double) : sizeof(float);
        L->args[o] = args[o];
    }
    memset(L->p, 0, sizeof L->p);
    if (operand_strides(L->p, steps, L->nd, L->is, L->nops) < 0) return -1;
    const int keep_in = keep_alias ? L->pos[R_S0] : -1, keep_out = keep_alias ? L->pos[R_ST] : -1;
    if (unalias_inputs(L->args, L->p, L->nd, (const int (*)[4])L->cd, L->is, dims, L->nin, L->nops,
                       keep_in, keep_out, L->tmp) < 0) {
        free_copies(L->tmp, L->nin);
        return -1;
    }
    return 0;
}

/* The strides of the inputs both families read. */
static gdn_in_strides input_strides(const loop_operands *L, const loop_kind *kind)
{
    const op_strides *q = at(L, R_Q), *k = at(L, R_K), *v = at(L, R_V), *a = at(L, R_A);
    const op_strides *s0 = at(L, R_S0), *cu = at(L, R_CU);
    const int g = kind->general;   /* general: S_0 [n, v, k], else [v, k] */
    return (gdn_in_strides){
        .q_n = q->n, .q_t = q->c[0], .q_k = q->c[1], .k_n = k->n, .k_t = k->c[0], .k_k = k->c[1],
        .v_n = v->n, .v_t = v->c[0], .v_v = v->c[1],
        .a_n = a->n, .a_t = a->c[0], .a_k = g ? a->c[1] : 0,   /* a scalar gate: key stride 0 */
        .b_n = at(L, R_B)->n, .b_t = at(L, R_B)->c[0],
        .s0_n = s0->n, .s0_s = g ? s0->c[0] : 0, .s0_v = s0->c[g], .s0_k = s0->c[g + 1],
        .sc_n = at(L, R_SC)->n, .nq_n = at(L, R_NQ)->n, .dr_n = at(L, R_DR)->n,
        .cu_n = cu->n, .cu_m = g ? cu->c[0] : 1};
}

/* The sizes of the call; checks what protects memory: a packed batch's cu_seqlens (its
 * sequences must lie inside t) and enough checkpoints for its longest sequence (-1, error set). */
static int call_sizes(gdn_sizes *sz, const loop_operands *L, const loop_kind *kind,
                      npy_intp const *dims, const char *letters, const gdn_in_strides *in)
{
    const int kpos = (int)(strchr(letters, 'k') - letters) + 1;
    const int vpos = (int)(strchr(letters, 'v') - letters) + 1;
    *sz = (gdn_sizes){.N = dims[0], .T = dims[1], .NS = kind->general ? dims[4] : 1,
                      .Dk = dims[kpos], .Dv = dims[vpos], .max_len = dims[1],
                      .dalpha_summed = !kind->general,
                      /* the chunkwise form: asked for, a gate of one number per token (key stride
                       * 0), and checkpoints (if any) asked for as its chunk states */
                      .chunk = call_chunk > 0 && (!kind->ckpt || call_chunk_states) && in->a_k == 0
                                   ? call_chunk : 0,
                      .chunk_auto = call_chunk_auto};
    sz->chunk_states = kind->ckpt && sz->chunk > 0;
    if (kind->general)
        return check_packed(arg(L, R_CU), in->cu_n, in->cu_m, dims, kind->ckpt, sz);
    if (kind->ckpt) sz->nck = dims[4];
    return kind->ckpt ? check_ckpt_count(dims[4], sz->T, sz) : 0;
}

static void fwd_loop(char **args, npy_intp const *dims, npy_intp const *steps, void *data)
{
    if (skip_loop()) return;
    const loop_kind *kind = data;
    loop_operands L;
    /* S_0 as S_T's memory stays (gated_delta_rule_step(inplace=True)): each state row is read
     * whole before it is written */
    if (read_operands(&L, fwd_spec, sizeof fwd_spec / sizeof fwd_spec[0], R_O, kind, "tkv", args,
                      steps, dims, 1) < 0)
        return;
    const op_strides *o = at(&L, R_O), *sT = at(&L, R_ST), *ck = at(&L, R_CK);
    const int g = kind->general;
    const gdn_fwd_strides st = {
        .in = input_strides(&L, kind),
        .o_n = o->n, .o_t = o->c[0], .o_v = o->c[1],
        .sT_n = sT->n, .sT_s = g ? sT->c[0] : 0, .sT_v = sT->c[g], .sT_k = sT->c[g + 1],
        .ck_n = ck->n, .ck_s = g ? ck->c[0] : 0, .ck_c = ck->c[g], .ck_v = ck->c[g + 1],
        .ck_k = ck->c[g + 2]};
    gdn_sizes sz;
    if (call_sizes(&sz, &L, kind, dims, "tkv", &st.in) == 0) {
        const int nt = team_size(sz.chunk ? gdn_chunk_fwd_items(sz.N * sz.NS, sz.Dv)
                                          : gdn_fwd_items(sz.N * sz.NS, sz.Dv));
        gdn_fwd_call call = {
            .q = arg(&L, R_Q), .k = arg(&L, R_K), .v = arg(&L, R_V), .alpha = arg(&L, R_A),
            .beta = arg(&L, R_B), .S_0 = arg(&L, R_S0), .scale = arg(&L, R_SC),
            .normalize_qk = normalize_qk_of(&L, kind), .delta_rule = arg(&L, R_DR),
            .cu_seqlens = cu_seqlens_of(&L, kind),
            .o = arg(&L, R_O), .S_T = arg(&L, R_ST), .ckpt = arg(&L, R_CK),
            .st = &st, .sz = &sz, .num_threads = nt};
        const kernel_job job = {.fwd = &call, .f64 = kind->f64};
        const size_t wlen = sz.chunk ? gdn_chunk_fwd_workspace_len(&sz)
                                     : gdn_fwd_workspace_len(sz.max_len, sz.Dk, sz.Dv);
        run_with_workspace(nt, wlen, L.is[0],
                           arg(&L, R_S0) == arg(&L, R_ST), &sz, &job);
    }
    free_copies(L.tmp, L.nin);
}

static void bwd_loop(char **args, npy_intp const *dims, npy_intp const *steps, void *data)
{
    if (skip_loop()) return;
    const loop_kind *kind = data;
    loop_operands L;
    if (read_operands(&L, bwd_spec, sizeof bwd_spec / sizeof bwd_spec[0], R_DQ, kind, "tvk",
                      args, steps, dims, 0) < 0)
        return;
    const op_strides *d_o = at(&L, R_DO), *dsT = at(&L, R_DST), *ck = at(&L, R_CK);
    const op_strides *dq = at(&L, R_DQ), *dk = at(&L, R_DK), *dv = at(&L, R_DV);
    const op_strides *da = at(&L, R_DA), *db = at(&L, R_DB), *ds0 = at(&L, R_DS0);
    const int g = kind->general;
    const gdn_bwd_strides st = {
        .in = input_strides(&L, kind),
        .do_n = d_o->n, .do_t = d_o->c[0], .do_v = d_o->c[1],
        .dsT_n = dsT->n, .dsT_s = g ? dsT->c[0] : 0, .dsT_v = dsT->c[g], .dsT_k = dsT->c[g + 1],
        .ck_n = ck->n, .ck_s = g ? ck->c[0] : 0, .ck_c = ck->c[g], .ck_v = ck->c[g + 1],
        .ck_k = ck->c[g + 2],
        .dq_n = dq->n, .dq_t = dq->c[0], .dq_k = dq->c[1],
        .dk_n = dk->n, .dk_t = dk->c[0], .dk_k = dk->c[1],
        .dv_n = dv->n, .dv_t = dv->c[0], .dv_v = dv->c[1],
        .da_n = da->n, .da_t = da->c[0], .da_k = g ? da->c[1] : 0,
        .db_n = db->n, .db_t = db->c[0],
        .ds0_n = ds0->n, .ds0_s = g ? ds0->c[0] : 0, .ds0_v = ds0->c[g], .ds0_k = ds0->c[g + 1]};
    gdn_sizes sz;
    if (call_sizes(&sz, &L, kind, dims, "tvk", &st.in) == 0) {
        const int nt = team_size(sz.chunk ? gdn_chunk_bwd_items(&sz)
                                          : gdn_bwd_items(sz.N * sz.NS, sz.Dv));
        gdn_bwd_call call = {
            .d_o = arg(&L, R_DO), .q = arg(&L, R_Q), .k = arg(&L, R_K), .v = arg(&L, R_V),
            .alpha = arg(&L, R_A), .beta = arg(&L, R_B), .S_0 = arg(&L, R_S0),
            .dS_T = arg(&L, R_DST), .ckpt = arg(&L, R_CK), .scale = arg(&L, R_SC),
            .normalize_qk = normalize_qk_of(&L, kind), .delta_rule = arg(&L, R_DR),
            .cu_seqlens = cu_seqlens_of(&L, kind),
            .dq = arg(&L, R_DQ), .dk = arg(&L, R_DK), .dv = arg(&L, R_DV),
            .dalpha = arg(&L, R_DA), .dbeta = arg(&L, R_DB), .dS_0 = arg(&L, R_DS0),
            .st = &st, .sz = &sz, .num_threads = nt};
        const kernel_job job = {.bwd = &call, .f64 = kind->f64};
        const size_t wlen = sz.chunk ? gdn_chunk_bwd_workspace_len(&sz, gdn_chunk_bwd_team(&sz, nt))
                                     : gdn_bwd_workspace_len(sz.max_len, sz.Dk, sz.Dv);
        run_with_workspace(nt, wlen, L.is[0], 0, &sz, &job);
    }
    free_copies(L.tmp, L.nin);
}

/* The gufunc table: one entry per operation, float32 then float64 loops (NumPy picks the first loop
 * its casting rules allow, so float16 and small ints run in float32, other ints in float64). */
static PyUFuncGenericFunction fwd_funcs[] = {fwd_loop, fwd_loop};
static PyUFuncGenericFunction bwd_funcs[] = {bwd_loop, bwd_loop};
/* each loop's data: the variant (general, ckpt, rule) and the dtype, float32 then float64 */
#define KINDS(general, ckpt, rule) {{general, ckpt, rule, 0}, {general, ckpt, rule, 1}}
static loop_kind scalar_kinds[2] = KINDS(0, 0, 0), scalar_ck_kinds[2] = KINDS(0, 1, 0),
                 general_kinds[2] = KINDS(1, 0, 0), general_ck_kinds[2] = KINDS(1, 1, 0),
                 rule_kinds[2] = KINDS(1, 0, 1), rule_ck_kinds[2] = KINDS(1, 1, 1);
#undef KINDS
static void *scalar_data[] = {&scalar_kinds[0], &scalar_kinds[1]};
static void *scalar_ck_data[] = {&scalar_ck_kinds[0], &scalar_ck_kinds[1]};
static void *general_data[] = {&general_kinds[0], &general_kinds[1]};
static void *general_ck_data[] = {&general_ck_kinds[0], &general_ck_kinds[1]};
static void *rule_data[] = {&rule_kinds[0], &rule_kinds[1]};
static void *rule_ck_data[] = {&rule_ck_kinds[0], &rule_ck_kinds[1]};
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
/* the _ckpt variants: one more float operand (the forward's last output, the backward's last
 * input, just before the outputs) */
static const char fwd_ck_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF,
                                    TD, TD, TD, TD, TD, TD, TD, TD, TD, TD};
static const char bwd_ck_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TF,
                                    TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TD};
static const char gen_fwd_ck_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF,
                                        TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD};
static const char gen_bwd_ck_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF, TF, TF, TF, TF,
                                        TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD, TD, TD, TD, TD};
/* the gated_rule variants: delta_rule (float) after cu_seqlens */
static const char rule_fwd_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF,
                                      TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD};
static const char rule_bwd_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF, TF, TF, TF, TF,
                                      TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD, TD, TD, TD, TD};
static const char rule_fwd_ck_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF, TF,
                                         TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD, TD};
static const char rule_bwd_ck_types[] = {TF, TF, TF, TF, TF, TF, TF, TF, TF, TF, TI, TF, TF, TF, TF, TF, TF, TF, TF,
                                         TD, TD, TD, TD, TD, TD, TD, TD, TD, TD, TI, TD, TD, TD, TD, TD, TD, TD, TD};
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
    void **data;   /* the loops' loop_kind */
} gufunc_descriptor;

static const gufunc_descriptor gufuncs[] = {
    {"gated_delta_rule_fwd", fwd_funcs, fwd_types, 7, 2,
     "(t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k)",
     "gated_delta_rule_fwd(q, k, v, alpha, beta, S_0, scale, /, out=None, **kwargs) -> (o, S_T)\n\n"
     "Gated delta rule forward, one (sequence, head) per loop element.\n"
     "Signature (t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k); float32 and float64 loops.\n"
     "S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T;  o_t = scale S_t q_t.\n"
     "Yang, Kautz, Hatamizadeh, Gated Delta Networks, ICLR 2025. See gdn_ext.ufuncs.", scalar_data},
    {"gated_delta_rule_bwd", bwd_funcs, bwd_types, 9, 6,
     "(t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),()->(t,k),(t,k),(t,v),(t),(t),(v,k)",
     "gated_delta_rule_bwd(do, q, k, v, alpha, beta, S_0, dS_T, scale, /, out=None, **kwargs)\n"
     "    -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "Backward over time of gated_delta_rule_fwd, with states recomputed from checkpoints.\n"
     "Signature (t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),()->(t,k),(t,k),(t,v),(t),(t),(v,k).\n"
     "See gdn_ext.ufuncs.", scalar_data},
    {"gated_delta_rule_general_fwd", fwd_funcs, gen_fwd_types, 9, 2,
     "(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m)->(t,v),(n,v,k)",
     "gated_delta_rule_general_fwd(q, k, v, alpha, beta, S_0, scale, normalize_qk, cu_seqlens, /,\n"
     "    out=None, **kwargs) -> (o, S_T)\n\n"
     "Forward with a per-key gate alpha [t, k], optional in-kernel q/k L2 normalisation\n"
     "(normalize_qk != 0) and n sequences packed along t (cu_seqlens int64 [n + 1]).\n"
     "See gdn_ext.ufuncs.", general_data},
    {"gated_delta_rule_general_bwd", bwd_funcs, gen_bwd_types, 11, 6,
     "(t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m)->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)",
     "gated_delta_rule_general_bwd(do, q, k, v, alpha, beta, S_0, dS_T, scale, normalize_qk,\n"
     "    cu_seqlens, /, out=None, **kwargs) -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "Backward of gated_delta_rule_general_fwd. See gdn_ext.ufuncs.", general_data},
    {"gated_delta_rule_fwd_ckpt", fwd_funcs, fwd_ck_types, 7, 3,
     "(t,k),(t,k),(t,v),(t),(t),(v,k),()->(t,v),(v,k),(c,v,k)",
     "gated_delta_rule_fwd_ckpt(q, k, v, alpha, beta, S_0, scale, /, out=None, **kwargs)\n"
     "    -> (o, S_T, checkpoints)\n\n"
     "gated_delta_rule_fwd that also writes the states before steps 0, C, 2C, ...\n"
     "(C = checkpoint_interval(t)) into checkpoints [c, v, k], c >= checkpoint_count(t): pass\n"
     "out= (c is not an input dimension). See gdn_ext.ufuncs.", scalar_ck_data},
    {"gated_delta_rule_bwd_ckpt", bwd_funcs, bwd_ck_types, 10, 6,
     "(t,v),(t,k),(t,k),(t,v),(t),(t),(v,k),(v,k),(),(c,v,k)->(t,k),(t,k),(t,v),(t),(t),(v,k)",
     "gated_delta_rule_bwd_ckpt(do, q, k, v, alpha, beta, S_0, dS_T, scale, checkpoints, /,\n"
     "    out=None, **kwargs) -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "gated_delta_rule_bwd with the forward's checkpoints (gated_delta_rule_fwd_ckpt over the\n"
     "same inputs) instead of its own checkpoint pass. See gdn_ext.ufuncs.", scalar_ck_data},
    {"gated_delta_rule_general_fwd_ckpt", fwd_funcs, gen_fwd_ck_types, 9, 3,
     "(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m)->(t,v),(n,v,k),(n,c,v,k)",
     "gated_delta_rule_general_fwd_ckpt(q, k, v, alpha, beta, S_0, scale, normalize_qk,\n"
     "    cu_seqlens, /, out=None, **kwargs) -> (o, S_T, checkpoints)\n\n"
     "gated_delta_rule_general_fwd that also writes each sequence's checkpoints [n, c, v, k].\n"
     "See gdn_ext.ufuncs.", general_ck_data},
    {"gated_delta_rule_general_bwd_ckpt", bwd_funcs, gen_bwd_ck_types, 12, 6,
     "(t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m),(n,c,v,k)"
     "->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)",
     "gated_delta_rule_general_bwd_ckpt(do, q, k, v, alpha, beta, S_0, dS_T, scale,\n"
     "    normalize_qk, cu_seqlens, checkpoints, /, out=None, **kwargs)\n"
     "    -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "gated_delta_rule_general_bwd with the forward's checkpoints. See gdn_ext.ufuncs.", general_ck_data},
    {"gated_rule_fwd", fwd_funcs, rule_fwd_types, 10, 2,
     "(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m),()->(t,v),(n,v,k)",
     "gated_rule_fwd(q, k, v, alpha, beta, S_0, scale, normalize_qk, cu_seqlens, delta_rule, /,\n"
     "    out=None, **kwargs) -> (o, S_T)\n\n"
     "gated_delta_rule_general_fwd with one more input: delta_rule != 0 writes the delta rule's\n"
     "u_t = beta_t (v_t - S_{t-1} D_t k_t), delta_rule == 0 linear attention's u_t = beta_t v_t\n"
     "(the rule family: linear attention, GLA / Mamba2 gates, DeltaNet, Gated DeltaNet).\n"
     "See gdn_ext.ufuncs.", rule_data},
    {"gated_rule_bwd", bwd_funcs, rule_bwd_types, 12, 6,
     "(t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m),()->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)",
     "gated_rule_bwd(do, q, k, v, alpha, beta, S_0, dS_T, scale, normalize_qk, cu_seqlens,\n"
     "    delta_rule, /, out=None, **kwargs) -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "Backward of gated_rule_fwd. See gdn_ext.ufuncs.", rule_data},
    {"gated_rule_fwd_ckpt", fwd_funcs, rule_fwd_ck_types, 10, 3,
     "(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(),(),(m),()->(t,v),(n,v,k),(n,c,v,k)",
     "gated_rule_fwd_ckpt(q, k, v, alpha, beta, S_0, scale, normalize_qk, cu_seqlens, delta_rule,\n"
     "    /, out=None, **kwargs) -> (o, S_T, checkpoints)\n\n"
     "gated_rule_fwd that also writes each sequence's checkpoints. See gdn_ext.ufuncs.",
     rule_ck_data},
    {"gated_rule_bwd_ckpt", bwd_funcs, rule_bwd_ck_types, 13, 6,
     "(t,v),(t,k),(t,k),(t,v),(t,k),(t),(n,v,k),(n,v,k),(),(),(m),(),(n,c,v,k)"
     "->(t,k),(t,k),(t,v),(t,k),(t),(n,v,k)",
     "gated_rule_bwd_ckpt(do, q, k, v, alpha, beta, S_0, dS_T, scale, normalize_qk, cu_seqlens,\n"
     "    delta_rule, checkpoints, /, out=None, **kwargs) -> (dq, dk, dv, dalpha, dbeta, dS_0)\n\n"
     "gated_rule_bwd with the forward's checkpoints. See gdn_ext.ufuncs.", rule_ck_data},
};

static PyObject *py_openmp_enabled(PyObject *self, PyObject *noargs)
{
    return PyBool_FromLong(gdn_openmp_enabled());
}

static PyObject *py_isa(PyObject *self, PyObject *noargs)
{
    return PyUnicode_FromString(gdn_isa());
}

/* A thread count argument, 0 .. INT_MAX (0: OpenMP's default); -1 with an error set if not. */
static int thread_arg(PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n < 0 || n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "num_threads must be between 0 and INT_MAX");
        return -1;
    }
    return (int)n;
}

static PyObject *py_set_call_threads(PyObject *self, PyObject *arg)
{
    const int n = thread_arg(arg);
    if (n < 0) return NULL;
    int prev = call_threads;
    call_threads = n;
    return PyLong_FromLong(prev);
}

/* _call_begin(n, chunk=0, auto=False, states=False): a call of the checked API starts on this
 * thread, on n threads (0: default), with the chunkwise form's chunk size (0: the recurrence),
 * which with auto each (sequence, head) pair takes only where it suits it (gdn.h); states: the
 * _ckpt gufuncs' checkpoints are the chunk form's states */
static PyObject *py_call_begin(PyObject *self, PyObject *args)
{
    PyObject *threads;
    Py_ssize_t chunk = 0;
    int autochoice = 0, states = 0;
    if (!PyArg_ParseTuple(args, "O|npp", &threads, &chunk, &autochoice, &states)) return NULL;
    const int n = thread_arg(threads);
    if (n < 0) return NULL;
    if (chunk < 0 || chunk > GDN_CHUNK_MAX) {
        PyErr_Format(PyExc_ValueError, "chunk_size must be between 1 and %d (0: the recurrence)",
                     GDN_CHUNK_MAX);
        return NULL;
    }
    const int d = this_call.depth;
    if (d < (int)(sizeof this_call.saved_threads / sizeof(int))) {
        this_call.saved_threads[d] = call_threads;
        this_call.saved_chunk[d] = call_chunk;
        this_call.saved_auto[d] = call_chunk_auto;
        this_call.saved_states[d] = call_chunk_states;
    }
    call_threads = n;
    call_chunk = (ptrdiff_t)chunk;
    call_chunk_auto = autochoice;
    call_chunk_states = states;
    call_open(1);
    Py_RETURN_NONE;
}

/* _call_end(): it ended (a no-op when none is open) */
static PyObject *py_call_end(PyObject *self, PyObject *unused)
{
    if (this_call.depth > 0) {
        const int d = this_call.depth - 1;
        if (d < (int)(sizeof this_call.saved_threads / sizeof(int))) {
            call_threads = this_call.saved_threads[d];
            call_chunk = this_call.saved_chunk[d];
            call_chunk_auto = this_call.saved_auto[d];
            call_chunk_states = this_call.saved_states[d];
        }
        call_close();
    }
    Py_RETURN_NONE;
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

static PyObject *py_checkpoint_count(PyObject *self, PyObject *arg)
{
    Py_ssize_t T = PyLong_AsSsize_t(arg);
    if (T == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromSsize_t(gdn_checkpoint_count(T));
}

static PyObject *py_chunk_checkpoint_count(PyObject *self, PyObject *args)
{
    Py_ssize_t T, C, Dk, Dv;
    if (!PyArg_ParseTuple(args, "nnnn", &T, &C, &Dk, &Dv)) return NULL;
    if (T < 0 || C < 1 || C > GDN_CHUNK_MAX || Dk < 0 || Dv < 0) {
        PyErr_SetString(PyExc_ValueError, "chunk_checkpoint_count: T, Dk, Dv >= 0, C in [1, CHUNK_MAX]");
        return NULL;
    }
    return PyLong_FromSsize_t(gdn_chunk_checkpoint_count(T, C, Dk, Dv));
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
    if (forked_child) threads = 1;
    Py_BEGIN_ALLOW_THREADS
    r = gdn_fma_peak(use_double, threads, seconds);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(r);
}

static PyObject *py_mm_rate(PyObject *self, PyObject *args)
{
    int use_double = 0;
    Py_ssize_t m, n, k;
    double seconds = 0.2;
    if (!PyArg_ParseTuple(args, "pnnn|d", &use_double, &m, &n, &k, &seconds)) return NULL;
    if (m < 1 || n < 1 || k < 1 || m > 4096 || n > 4096 || k > 4096 || !(seconds > 0 && seconds < 60)) {
        PyErr_SetString(PyExc_ValueError,
                        "mm_rate: m, n, k must be in [1, 4096], seconds in (0, 60)");
        return NULL;
    }
    double r;
    Py_BEGIN_ALLOW_THREADS
    r = gdn_mm_rate(use_double, m, n, k, seconds);
    Py_END_ALLOW_THREADS
    if (r < 0) return PyErr_NoMemory();
    return PyFloat_FromDouble(r);
}

static PyObject *py_busy_cap(PyObject *self, PyObject *args)
{
    /* _busy_cap() -> cap; _busy_cap(nt, late, total[, nlate]) reports a call first (for tests) */
    int nt = 0, nlate = -1;
    double late = 0, total = 0;
    if (!PyArg_ParseTuple(args, "|iddi", &nt, &late, &total, &nlate)) return NULL;
    if (nt > 0) gdn_note_team(nt, nlate < 0 ? (late > GDN_LATE_S ? nt : 0) : nlate, late, total);
    return PyLong_FromLong(gdn_default_thread_cap());
}

static PyObject *py_forked_child(PyObject *self, PyObject *unused)
{
    return PyBool_FromLong(forked_child);
}

/* ---- the block cache (_block_cache.c) ------------------------------------------------------ */

static PyObject *cache_handler = NULL;   /* the NumPy allocator that uses the cache; never freed */

static PyObject *py_cache_enter(PyObject *self, PyObject *noargs)
{
    return PyDataMem_SetHandler(cache_handler);
}

static PyObject *py_cache_current(PyObject *self, PyObject *noargs)
{
    return PyDataMem_GetHandler();
}

static PyObject *py_cache_exit(PyObject *self, PyObject *previous)
{
    PyObject *mine = PyDataMem_SetHandler(previous == Py_None ? NULL : previous);
    if (mine == NULL) return NULL;
    Py_DECREF(mine);
    Py_RETURN_NONE;
}

static PyObject *py_empty_cache(PyObject *self, PyObject *noargs)
{
    size_t freed;
    Py_BEGIN_ALLOW_THREADS
    freed = gdn_cache_empty();
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(freed);
}

static PyObject *py_set_cache_limit(PyObject *self, PyObject *arg)
{
    const size_t limit = PyLong_AsSize_t(arg);
    if (limit == (size_t)-1 && PyErr_Occurred()) return NULL;
    size_t previous;
    Py_BEGIN_ALLOW_THREADS
    previous = gdn_cache_set_limit(limit);
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(previous);
}

/* For the tests: n rounds of taking two blocks of `bytes`, filling them with this caller's tag,
 * checking them and giving them back, without the GIL, so that callers on several threads race
 * for the same cached blocks. Returns the rounds whose blocks another caller had written. */
static PyObject *py_cache_churn(PyObject *self, PyObject *args)
{
    Py_ssize_t n, bytes;
    unsigned int tag;
    if (!PyArg_ParseTuple(args, "nnI", &n, &bytes, &tag)) return NULL;
    if (n < 0 || bytes < (Py_ssize_t)sizeof(unsigned int)) {
        PyErr_SetString(PyExc_ValueError, "_cache_churn: n >= 0 and bytes >= 4");
        return NULL;
    }
    Py_ssize_t bad = 0, failed = 0;
    const size_t words = (size_t)bytes / sizeof(unsigned int);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < n && !failed; r++) {
        unsigned int *a = gdn_cache_alloc((size_t)bytes, 0);   /* [words] */
        unsigned int *b = gdn_cache_alloc((size_t)bytes, 0);   /* [words] */
        if (a == NULL || b == NULL) failed = 1;
        else {
            for (size_t i = 0; i < words; i += 512) a[i] = b[i] = tag;
            int wrong = a == b;
            for (size_t i = 0; i < words; i += 512) wrong |= a[i] != tag || b[i] != tag;
            bad += wrong;
        }
        gdn_cache_free(a);
        gdn_cache_free(b);
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    return PyLong_FromSsize_t(bad);
}

/* x as a C-contiguous, aligned float32 / float64 array (1: float64, 0: float32); -1: not one. */
static int screen_kind(PyObject *x)
{
    if (!PyArray_Check(x)) return -1;
    PyArrayObject *a = (PyArrayObject *)x;
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || PyArray_ISBYTESWAPPED(a)) return -1;
    if (PyArray_TYPE(a) == NPY_DOUBLE) return 1;
    if (PyArray_TYPE(a) == NPY_FLOAT) return 0;
    return -1;
}

static void screen_range(PyObject *x, int kind, double *lo, double *hi)
{
    PyArrayObject *a = (PyArrayObject *)x;
    if (kind) gdn_range_f64((const double *)PyArray_DATA(a), PyArray_SIZE(a), lo, hi);
    else gdn_range_f32((const float *)PyArray_DATA(a), PyArray_SIZE(a), lo, hi);
}

/* _value_screen(beta, gate, k or None): the value checks' numbers in one pass, or None when an
 * argument is not a C-contiguous float32 / float64 array (the caller computes them with NumPy) */
static PyObject *py_value_screen(PyObject *self, PyObject *args)
{
    PyObject *beta, *gate, *k;
    if (!PyArg_ParseTuple(args, "OOO", &beta, &gate, &k)) return NULL;
    const int kb = screen_kind(beta), kg = screen_kind(gate), kk = k == Py_None ? 0 : screen_kind(k);
    if (kb < 0 || kg < 0 || kk < 0) Py_RETURN_NONE;
    double blo, bhi, glo, ghi;
    screen_range(beta, kb, &blo, &bhi);
    screen_range(gate, kg, &glo, &ghi);
    if (k == Py_None) return Py_BuildValue("(ddddO)", blo, bhi, glo, ghi, Py_None);
    PyArrayObject *a = (PyArrayObject *)k;
    const int nd = PyArray_NDIM(a);
    const ptrdiff_t d = nd > 0 ? (ptrdiff_t)PyArray_DIM(a, nd - 1) : 1;
    const ptrdiff_t m = d > 0 ? (ptrdiff_t)PyArray_SIZE(a) / d : 0;
    const double ks = kk ? gdn_row_sumsq_max_f64((const double *)PyArray_DATA(a), m, d)
                         : gdn_row_sumsq_max_f32((const float *)PyArray_DATA(a), m, d);
    return Py_BuildValue("(ddddd)", blo, bhi, glo, ghi, ks);
}

static PyObject *py_cache_stats(PyObject *self, PyObject *noargs)
{
    size_t cached, limit;
    gdn_cache_stats(&cached, &limit);
    return Py_BuildValue("(nn)", (Py_ssize_t)cached, (Py_ssize_t)limit);
}

static PyMethodDef methods[] = {
    {"_forked_child", py_forked_child, METH_NOARGS,
     "_forked_child() -> bool: whether this process is a fork() child (calls then run on one "
     "thread)."},
    {"_busy_cap", py_busy_cap, METH_VARARGS,
     "_busy_cap([nt, late_s, total_s[, n_late]]) -> the cap on default threads (0: none), after\n"
     "reporting a call whose last of nt threads started late_s after its start, n_late of them\n"
     "(default: all when late_s is over 0.5 ms) later than 0.5 ms, and which took total_s."},
    {"fma_peak", py_fma_peak, METH_VARARGS,
     "fma_peak(float64: bool, threads: int, seconds=0.2) -> GFLOP/s: the multiply-add ceiling of\n"
     "the kernels' instruction set (isa()) on `threads` threads (0: OpenMP's default), from\n"
     "independent vector FMA chains; a multiply-add counts 2 floating-point operations."},
    {"mm_rate", py_mm_rate, METH_VARARGS,
     "mm_rate(float64: bool, m: int, n: int, k: int, seconds=0.2) -> GFLOP/s of the chunk form's\n"
     "matrix product C[m, n] += A[m, k] B[k, n] (the kernels' own inner loops, instruction set\n"
     "isa(), one thread), m, n, k in [1, 4096]; a multiply-add counts 2 floating-point operations."},
    {"openmp_enabled", py_openmp_enabled, METH_NOARGS,
     "openmp_enabled() -> bool: whether this build runs the (sequence, head) loop with OpenMP."},
    {"isa", py_isa, METH_NOARGS,
     "isa() -> 'generic' | 'avx2' | 'avx512': the instruction set the kernels were picked for."},
    {"_set_call_threads", py_set_call_threads, METH_O,
     "_set_call_threads(n) -> previous: threads for gufunc calls from this OS thread (0: default)."},
    {"_call_begin", py_call_begin, METH_VARARGS,
     "_call_begin(n, chunk=0, auto=False, states=False): a checked call starts on this thread,\n"
     "on n threads (0: default), in the chunkwise form with chunks of `chunk` tokens (0: the\n"
     "recurrence), with auto only for the (sequence, head) pairs it suits, and with states the\n"
     "_ckpt gufuncs' checkpoints as the chunk form's states; it spans\n"
     "the gufunc call's casts and inner loops and, on the main thread, watches for Ctrl-C.\n"
     "Pair with _call_end() in a finally clause."},
    {"_call_end", py_call_end, METH_NOARGS, "_call_end(): the call started by _call_begin ended."},
    {"_threads_for", py_threads_for, METH_O,
     "_threads_for(N) -> threads a call over N (sequence, head) pairs would use now."},
    {"checkpoint_interval", py_checkpoint_interval, METH_O,
     "checkpoint_interval(T) -> C: the backward keeps the state every C = ceil(sqrt(T)) steps."},
    {"checkpoint_count", py_checkpoint_count, METH_O,
     "checkpoint_count(T) -> ceil(T / C): the states a forward hands to the backward."},
    {"_chunk_checkpoint_count", py_chunk_checkpoint_count, METH_VARARGS,
     "_chunk_checkpoint_count(T, C, Dk, Dv) -> the states the chunk form hands its backward for a\n"
     "T-token sequence in chunks of C: ceil(NT / R), R = gdn_chunk_segment (NT = ceil(T / C))."},
    {"bwd_workspace_len", py_bwd_workspace_len, METH_VARARGS,
     "bwd_workspace_len(T, Dk, Dv) -> elements of backward workspace per thread."},
    {"_cache_enter", py_cache_enter, METH_NOARGS,
     "_cache_enter() -> previous: NumPy arrays made on this context from now on use gdn_ext's\n"
     "block cache; pass the result to _cache_exit to put the previous allocator back."},
    {"_cache_current", py_cache_current, METH_NOARGS,
     "_cache_current() -> the NumPy allocator arrays made on this context now get."},
    {"_cache_exit", py_cache_exit, METH_O,
     "_cache_exit(previous): makes `previous` (from _cache_current) the allocator again."},
    {"_empty_cache", py_empty_cache, METH_NOARGS,
     "_empty_cache() -> bytes: frees every block the cache keeps."},
    {"_set_cache_limit", py_set_cache_limit, METH_O,
     "_set_cache_limit(nbytes) -> previous limit: the most bytes the cache keeps (0: none)."},
    {"_cache_churn", py_cache_churn, METH_VARARGS,
     "_cache_churn(n, bytes, tag) -> rounds that found another caller's writes (tests only)."},
    {"_value_screen", py_value_screen, METH_VARARGS,
     "_value_screen(beta, gate, k or None) -> (min, max of beta, min, max of gate, the largest\n"
     "||row||^2 of k over its last axis, or None), NaN ignored (NaN where all are), or None when\n"
     "an argument is not a C-contiguous float32 / float64 array."},
    {"_cache_stats", py_cache_stats, METH_NOARGS,
     "_cache_stats() -> (cached bytes, limit)."},
    {NULL, NULL, 0, NULL}};

/* Multi-phase initialisation (PEP 489): PyInit returns the definition and core_exec fills the
 * module. Module-level C state is shared safely between Python threads: the per-call thread
 * request is thread-local, the busy-machine cap is read and written atomically, and the
 * instruction set is chosen once (gdn_init is idempotent). */
static int core_exec(PyObject *m)
{
    if (_import_array() < 0 || _import_umath() < 0) return -1;
    gdn_init();
    /* Python runs signal handlers on its main thread: Ctrl-C interrupts that thread's calls */
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main ? PyObject_GetAttrString(main, "ident") : NULL;
    Py_XDECREF(threading);
    Py_XDECREF(main);
    if (ident == NULL) return -1;
    main_ident = PyLong_AsUnsignedLong(ident);
    Py_DECREF(ident);
    if (main_ident == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (cache_handler == NULL && (cache_handler = gdn_cache_handler()) == NULL) return -1;
#if !defined(_WIN32)
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, after_fork_in_child) == 0) registered = 1;
#endif
    for (size_t i = 0; i < sizeof(gufuncs) / sizeof(gufuncs[0]); i++) {
        const gufunc_descriptor *d = &gufuncs[i];
        PyObject *f = PyUFunc_FromFuncAndDataAndSignature(
            d->funcs, d->data, (char *)d->types, 2, d->nin, d->nout,
            PyUFunc_None, d->name, d->doc,
            0, d->signature);
        if (f == NULL || PyModule_AddObject(m, d->name, f) < 0) {
            Py_XDECREF(f);
            return -1;
        }
    }
    /* auto's thresholds (gdn.h), which the documentation and the tests quote */
    if (PyModule_AddIntConstant(m, "CHUNK_AUTO_MIN_LEN", GDN_CHUNK_AUTO_MIN_LEN) < 0
        || PyModule_AddIntConstant(m, "CHUNK_MAX", GDN_CHUNK_MAX) < 0)
        return -1;
    PyObject *bk2 = PyFloat_FromDouble(GDN_CHUNK_AUTO_MAX_BK2);
    if (bk2 == NULL || PyModule_AddObject(m, "CHUNK_AUTO_MAX_BETA_K2", bk2) < 0) {
        Py_XDECREF(bk2);
        return -1;
    }
    /* the build's copy of gdn_ext/_constants.py's L2_EPS (setup.py passes it), for a test */
    PyObject *eps = PyFloat_FromDouble(GDN_L2_EPS);
    if (eps == NULL || PyModule_AddObject(m, "L2_EPS", eps) < 0) {
        Py_XDECREF(eps);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, (void *)core_exec},
#if PY_VERSION_HEX >= 0x030C0000
    /* NumPy itself loads in the main interpreter only */
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, .m_name = "gdn_ext._core",
    .m_doc = "C kernels of gdn_ext: the gated delta rule as NumPy generalized ufuncs.",
    .m_size = 0, .m_methods = methods, .m_slots = slots};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&moduledef); }
