/*
 * gdn.h -- the gated delta rule recurrence and its backward pass over time, in plain C.
 *
 * No Python in here: csrc/_core.c registers these kernels as NumPy generalized ufuncs.
 *
 * Dimension legend (used in every shape comment):
 *   N   loop elements of one call (the gufunc's loop dimension: batch x heads)
 *   NS  sequences packed end to end in one loop element (cu_seqlens; 1 when not packed)
 *   T   time steps of one loop element (of one sequence when NS = 1)
 *   Dk  key / query width (columns of the state)
 *   Dv  value width (rows of the state)
 *   C   checkpoint interval of the backward pass
 *
 * Math (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, section 3), with the gate
 * D_t = diag(alpha_t) (alpha_t [Dk]; the scalar gate repeats one value):
 *   p_t = S_{t-1} D_t k_t
 *   u_t = beta_t (v_t - p_t)          (delta_rule != 0, the default)
 *   u_t = beta_t v_t                  (delta_rule == 0: linear attention's write, gated or not)
 *   S_t = S_{t-1} D_t + u_t k_t^T
 *   o_t = scale S_t q_t
 * optionally with q_t, k_t replaced by x / sqrt(sum x^2 + 1e-6) (normalize_qk).
 *
 * Strides are in elements (not bytes) and may be zero, negative or non-contiguous.
 */
#ifndef GDN_H
#define GDN_H

#include <stddef.h>
#include <stdint.h>

/* x86-64 with GCC or clang: the kernels are also compiled for AVX2 and AVX-512 and picked at run
 * time. */
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define GDN_X86_DISPATCH 1
#else
#define GDN_X86_DISPATCH 0
#endif

/* Pick the instruction set (call once, before any kernel); its name: "generic", "avx2", "avx512".
 * GDN_EXT_ISA may ask for a lower level than the CPU's best. */
void gdn_init(void);
const char *gdn_isa(void);

/* Subnormal numbers: the kernels run with the CPU's flush-to-zero and denormals-are-zero modes on
 * (x86-64: MXCSR bits FTZ | DAZ; AArch64: FPCR.FZ, which does both), so a state decaying towards
 * zero never lingers in subnormals, which many CPUs compute 10-100 times slower. The modes belong
 * to a thread: every thread that runs kernel code turns them on with gdn_flush_begin() and puts
 * back what it had with gdn_flush_end() before it leaves (the caller's and OpenMP's pool threads,
 * shared with other libraries, keep IEEE arithmetic). Elsewhere: no-ops, IEEE subnormals. */
typedef unsigned gdn_fpmode;
gdn_fpmode gdn_flush_begin(void);          /* returns the calling thread's previous modes */
void gdn_flush_end(gdn_fpmode previous);   /* the exception flags raised meanwhile stay */
int gdn_flush_supported(void);             /* 1 where the modes exist (x86-64, AArch64) */

/* Per-operand strides, in elements. "n" is the stride between the N loop elements, "s" between the
 * NS sequences of one packed (varlen) loop element; the other letters name the core axis they step
 * along. A scalar gate is a per-key gate with a_k = 0. The inputs that both passes read: */
typedef struct {
    ptrdiff_t q_n, q_t, q_k;                 /* q      [N, T, Dk]     */
    ptrdiff_t k_n, k_t, k_k;                 /* k      [N, T, Dk]     */
    ptrdiff_t v_n, v_t, v_v;                 /* v      [N, T, Dv]     */
    ptrdiff_t a_n, a_t, a_k;                 /* alpha  [N, T, Dk]     */
    ptrdiff_t b_n, b_t;                      /* beta   [N, T]         */
    ptrdiff_t s0_n, s0_s, s0_v, s0_k;        /* S_0    [N, NS, Dv, Dk] */
    ptrdiff_t sc_n;                          /* scale  [N]            */
    ptrdiff_t nq_n;                          /* normalize_qk [N]      */
    ptrdiff_t dr_n;                          /* delta_rule [N]        */
    ptrdiff_t cu_n, cu_m;                    /* cu_seqlens [N, NS + 1] */
} gdn_in_strides;

/* The forward's: its inputs, then its outputs. */
typedef struct {
    gdn_in_strides in;
    ptrdiff_t o_n, o_t, o_v;                 /* o      [N, T, Dv]     */
    ptrdiff_t sT_n, sT_s, sT_v, sT_k;        /* S_T    [N, NS, Dv, Dk] */
    ptrdiff_t ck_n, ck_s, ck_c, ck_v, ck_k;  /* checkpoints [N, NS, NCK, Dv, Dk] (optional) */
} gdn_fwd_strides;

/* The backward's: the shared inputs, its own inputs, its outputs. */
typedef struct {
    gdn_in_strides in;
    ptrdiff_t do_n, do_t, do_v;              /* do     [N, T, Dv]     */
    ptrdiff_t dsT_n, dsT_s, dsT_v, dsT_k;    /* dS_T   [N, NS, Dv, Dk] */
    ptrdiff_t ck_n, ck_s, ck_c, ck_v, ck_k;  /* checkpoints [N, NS, NCK, Dv, Dk] (optional) */
    ptrdiff_t dq_n, dq_t, dq_k;              /* dq     [N, T, Dk]     */
    ptrdiff_t dk_n, dk_t, dk_k;              /* dk     [N, T, Dk]     */
    ptrdiff_t dv_n, dv_t, dv_v;              /* dv     [N, T, Dv]     */
    ptrdiff_t da_n, da_t, da_k;              /* dalpha [N, T, Dk] ([N, T] when summed) */
    ptrdiff_t db_n, db_t;                    /* dbeta  [N, T]         */
    ptrdiff_t ds0_n, ds0_s, ds0_v, ds0_k;    /* dS_0   [N, NS, Dv, Dk] */
} gdn_bwd_strides;

/* Cancellation of one call (Ctrl-C): a flag of the caller's that its SIGINT handler sets. The
 * kernels poll it between blocks of tokens (forward) and segments (backward) and return early,
 * leaving the outputs half-written: the caller must drop them (or run the call again). Each call
 * has its own flag, so one call's cancellation never cuts another short; NULL: runs to the end. */
#include <signal.h>
typedef volatile sig_atomic_t gdn_cancel_flag;
#define GDN_CANCELLED(flag) ((flag) != NULL && *(flag) != 0)

/* Sizes of one call: N loop elements, each T tokens holding NS packed sequences whose boundaries
 * are cu_seqlens (NS = 1, cu_seqlens = {0, T} for an unpacked batch). */
typedef struct {
    ptrdiff_t N, T, NS, Dk, Dv;
    ptrdiff_t max_len;   /* the longest packed sequence (cu_seqlens already checked) */
    int dalpha_summed;   /* scalar gate: the backward writes dalpha[t] = sum_j dalpha[t, j] */
    ptrdiff_t chunk;     /* > 0: the chunkwise form with chunks of this many tokens (scalar gate,
                          * no checkpoints; see gdn_chunk_part_len); 0: the recurrence */
    int chunk_auto;      /* with chunk > 0: per pair, the chunkwise form only where it suits */
    int chunk_states;    /* with chunk > 0: ckpt holds the chunk form's states (see below) */
    ptrdiff_t nck;       /* the ckpt operand's slots per pair (its c axis); 0: no ckpt */
    gdn_cancel_flag *cancel;   /* this call's Ctrl-C flag, NULL: none (see GDN_CANCELLED) */
} gdn_sizes;

/* State rows updated together by the backward kernel (its state rows are padded to a multiple). */
#define GDN_ROWS 4
/* Per-pair options of the kernels (a bit set): q, k L2-normalised; the write without the delta
 * rule's correction (u_t = beta_t v_t). */
#define GDN_OPT_NORMALIZE 1
#define GDN_OPT_LINEAR 2
/* Value rows of one strip of the backward (its state rows are padded to a multiple): a strip of G
 * and of one segment's states stays in L1 / L2 while it walks back through the segment. */
#ifndef GDN_BWD_ROWS
#define GDN_BWD_ROWS 16
#endif
/* The backward's key rows are padded to a multiple of this many elements (zeros), so that they
 * are whole vector registers of every build (16 floats: one zmm). */
#define GDN_BWD_KPAD 16
/* The backward runs its passes on blocks of a strip's rows; a block of two states' rows (G and
 * S_{t-1}) should stay within this many bytes (within L1 with room for the token's vectors). */
#ifndef GDN_BWD_BLOCK_BYTES
#define GDN_BWD_BLOCK_BYTES 24576
#endif
/* The backward runs one pair on every thread (strips in parallel) only when pairs * GDN_BWD_SPLIT
 * <= threads; otherwise one thread per pair. */
#define GDN_BWD_SPLIT 8
/* The forward's strips of the transposed state: NV vector registers of value columns, NV at most
 * GDN_FWD_NV_MAX (set per instruction set) and fewer when a strip of Dk rows would outgrow
 * GDN_FWD_STRIP_BYTES (about L1). GDN_FWD_COLS_MAX: the widest strip of any build, in elements
 * (4 AVX-512 registers of floats), which sizes the workspace. */
#ifndef GDN_FWD_STRIP_BYTES
#define GDN_FWD_STRIP_BYTES 32768
#endif
#define GDN_FWD_COLS_MAX 64
#define GDN_FWD_COLS_MIN 8    /* the fewest (portable build, doubles): bounds the forward's items */
/* Tokens per time block of the forward: their per-token inputs are prepared once per work item and
 * read by every strip. */
#ifndef GDN_FWD_BLOCK
#define GDN_FWD_BLOCK 64
#endif
ptrdiff_t gdn_fwd_block(ptrdiff_t T);   /* min(T, GDN_FWD_BLOCK), at least 1 */
/* Per-thread scratch starts on a cache line; the workspace lengths include the slack for it. */
#define GDN_CACHE_LINE 64
#define GDN_SCRATCH_SLACK 16   /* elements: >= GDN_CACHE_LINE bytes of floats, and a whole line */
/* Sequences of at most this many steps run the forward on the untransposed state (decoding). */
#define GDN_ROWWISE_MAX_T 4

/* Checkpoint interval C of the backward pass: ceil(sqrt(T)), which minimises the
 * (ceil(T/C) + C + 2) states held per (sequence, head): checkpoints, a segment, and G. */
ptrdiff_t gdn_checkpoint_interval(ptrdiff_t T);
/* Checkpoints of a T-step sequence: ceil(T / C), 0 for T = 0 (never falls as T grows). */
ptrdiff_t gdn_checkpoint_count(ptrdiff_t T);

/* Workspace, in elements, that one thread needs for one sequence of at most T tokens; SIZE_MAX
 * if that would overflow size_t. */
size_t gdn_fwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv);
size_t gdn_bwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv);
/* Its two parts: what one (sequence, head) pair holds while its backward runs (checkpoints, G,
 * partial sums, a segment's inputs), and what each thread working on it holds (a strip's states
 * of one segment, the checkpoint pass's forward workspace). Whole cache lines, in elements. */
size_t gdn_bwd_pair_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv);
size_t gdn_bwd_thread_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv);
/* Work items of the backward (pairs times strips of value rows): bounds its useful threads. */
ptrdiff_t gdn_bwd_items(ptrdiff_t npairs, ptrdiff_t Dv);

/* Check every loop element's cu_seqlens (int64 [N, NS + 1]): starts at 0, never decreases, ends at
 * T. Returns 0 and the longest sequence in *max_len, or -1 (bad start), -2 (decreasing) or
 * -3 (bad end). */
int gdn_check_cu_seqlens(const int64_t *cu, ptrdiff_t cu_n, ptrdiff_t cu_m, ptrdiff_t N,
                         ptrdiff_t NS, ptrdiff_t T, ptrdiff_t *max_len);

/* Threads a parallel loop over n items uses: min(n, num_threads or OpenMP's default,
 * GDN_MAX_OVERSUBSCRIBE * processors, OpenMP's thread limit). */
#define GDN_MAX_OVERSUBSCRIBE 4
/* Below this many state elements touched per call (N * T * Dk * Dv) the loop runs serially. */
#define GDN_PARALLEL_MIN_WORK 65536.0
int gdn_threads_for(ptrdiff_t n, int num_threads);
/* A busy machine: after each parallel call the kernels report how late the last of its nt threads
 * started work (late), how many started later than GDN_LATE_S (nlate) and the call's duration
 * (total). When more than a quarter of the team arrives late and the call waits a quarter of its
 * time for them (their cores run other work), default calls (num_threads 0) use only as many
 * threads as were on time; when they arrive on time the cap doubles again, and a capped call now
 * and then probes with twice the cap. One or two stragglers (a virtual CPU slow to wake) are not
 * a busy machine. Explicit thread counts are left as asked. Results never depend on the thread count. */
void gdn_note_team(int nt, int nlate, double late, double total);
#define GDN_LATE_S 5e-4   /* seconds: later than an idle thread takes to wake */
/* One parallel call's clock: gdn_team_start before the team forks, gdn_arrive (gdn_instances.inc)
 * by each thread as it starts, gdn_team_done after the join (which reports to gdn_note_team unless
 * the team had more threads than processors: late by construction). */
typedef struct {
    double start, late;   /* seconds: the fork; the last thread's start after it */
    int nlate;            /* threads that started later than GDN_LATE_S after the fork */
} gdn_team_clock;
gdn_team_clock gdn_team_start(void);
void gdn_team_done(int nt, const gdn_team_clock *tc);
/* nt threads (from gdn_threads_for) under the busy-machine cap when num_threads is 0 (default). */
int gdn_capped_threads(int nt, int num_threads);
int gdn_default_thread_cap(void);   /* the current cap, 0 for none */
int gdn_num_procs(void);
int gdn_openmp_enabled(void);

/*
 * Checkpoints handed from the forward to the backward (optional, NULL: none): for each pair, the
 * state before steps 0, C, 2C, ... of its sequence (C = gdn_checkpoint_interval of its length),
 * NCK >= ceil(T_max / C(T_max)) of them (the count never falls as T grows). The backward then skips
 * its own checkpoint pass; it trusts them to come from a forward over the same inputs.
 *
 * Forward over N * NS independent (sequence, head) pairs, in parallel over the pairs and the strips
 * of value rows of each state (rows never mix in the forward).
 * cu_seqlens must have passed gdn_check_cu_seqlens, and sz->max_len be its longest sequence.
 * ws: nthreads * gdn_fwd_workspace_len(max_len, Dk, Dv) elements with
 * nthreads = gdn_threads_for(gdn_fwd_items(N * NS, Dv), num_threads) (at least as many as it uses).
 */
ptrdiff_t gdn_fwd_items(ptrdiff_t npairs, ptrdiff_t Dv);
/* One forward call, filled by field name (csrc/_core.c). The arrays hold float for the _f32
 * kernels and double for the _f64 ones; their shapes and strides: gdn_fwd_strides. */
typedef struct {
    /* inputs */
    const void *q, *k, *v, *alpha, *beta, *S_0;
    const void *scale;          /* [N] */
    const void *normalize_qk;   /* [N] nonzero: L2-normalise q_t, k_t; NULL: never */
    const void *delta_rule;     /* [N] 0: u_t = beta_t v_t; NULL: the delta rule everywhere */
    const int64_t *cu_seqlens;  /* [N, NS + 1], checked by gdn_check_cu_seqlens */
    /* outputs */
    void *o, *S_T;
    void *ckpt;                 /* the checkpoints, or NULL: none */
    /* layout, options, work space */
    const gdn_fwd_strides *st;
    const gdn_sizes *sz;
    int num_threads;            /* 0: OpenMP's default */
    void *ws;                   /* see above */
} gdn_fwd_call;
void gdn_forward_f64(const gdn_fwd_call *call);
void gdn_forward_f32(const gdn_fwd_call *call);

/*
 * Backward (BPTT) over N * NS pairs: given do = dL/do and dS_T = dL/dS_T, the gradients with respect
 * to every input. States are recomputed from checkpoints every C steps; nothing of size T*Dk*Dv is
 * held. ws: nthreads * gdn_bwd_workspace_len(max_len, Dk, Dv) elements.
 */
typedef struct {
    /* inputs */
    const void *d_o, *q, *k, *v, *alpha, *beta, *S_0, *dS_T;
    const void *ckpt;           /* the forward's checkpoints, or NULL: the backward makes its own */
    const void *scale, *normalize_qk, *delta_rule;   /* as gdn_fwd_call */
    const int64_t *cu_seqlens;
    /* outputs */
    void *dq, *dk, *dv, *dalpha, *dbeta, *dS_0;
    /* layout, options, work space */
    const gdn_bwd_strides *st;
    const gdn_sizes *sz;
    int num_threads;
    void *ws;
} gdn_bwd_call;
void gdn_backward_f64(const gdn_bwd_call *call);
void gdn_backward_f32(const gdn_bwd_call *call);

/*
 * The chunkwise (WY / UT-transform) form of the same forward and backward (csrc/gdn_chunk.inc),
 * chosen by gdn_forward_* / gdn_backward_* when sz->chunk > 0. It reads the gate as one number per
 * token (alpha's key stride must be 0: the caller checks) and neither writes nor reads checkpoints
 * (ckpt must be NULL). The general loops' dalpha [T, Dk] then receives the token's gradient in
 * key 0 and zeros in the other keys (their sum is the gradient).
 * With sz->chunk_auto each (sequence, head) pair takes the chunkwise form only when it suits it
 * (gdn_chunk_suits), else the recurrence: the choice depends on the pair alone, so a sequence
 * packed with others gives what it gives alone. ws: nthreads times
 * gdn_chunk_fwd_workspace_len(sz) / gdn_chunk_bwd_workspace_len(sz) elements; the backward's
 * holds the state entering each of ceil(max_len / C) chunks.
 */
#define GDN_CHUNK_PAD 16   /* buffer widths are padded to this many elements (every build's lanes) */
#define GDN_CHUNK_MAX 256  /* the longest chunk */
/* auto: the chunkwise form for sequences of at least this many tokens (measured: shorter ones
 * pay the per-chunk set-up for little), and, with the delta rule, when beta_t ||k_t||^2 (k_t
 * normalised when asked) stays at most GDN_CHUNK_AUTO_MAX_BK2 at every token: beyond it the UT
 * transform's triangular solve amplifies rounding far past the recurrence's */
#define GDN_CHUNK_AUTO_MIN_LEN 64
#define GDN_CHUNK_AUTO_MAX_BK2 2.0
/* The backward keeps the state entering every chunk while NT chunks' states take at most
 * GDN_CHUNK_KEEP_ELEMENTS elements (padded); beyond that the first state of each segment of
 * R = ceil(sqrt(NT)) chunks, recomputing a segment's states when it gets there. */
#ifndef GDN_CHUNK_KEEP_ELEMENTS
#define GDN_CHUNK_KEEP_ELEMENTS 4194304.0   /* 16 MiB of floats, 32 MiB of doubles per pair */
#endif
ptrdiff_t gdn_chunk_segment(ptrdiff_t NT, ptrdiff_t Dk, ptrdiff_t Dv);   /* R */
/* the states it then holds: NT, or ceil(NT / R) + R; given (the forward's states come in ckpt,
 * sz->chunk_states): none, or one segment's R */
ptrdiff_t gdn_chunk_states_held(ptrdiff_t NT, ptrdiff_t Dk, ptrdiff_t Dv, int given);
/* With sz->chunk_states the forward's ckpt receives, and the backward's reads, the states
 * entering chunks 0, R, 2R, ... of each pair that runs the chunk form (R = gdn_chunk_segment),
 * gdn_chunk_checkpoint_count of them, in the state's layout [Dv, Dk]; the forward writes zeros in
 * every other slot (a shorter packed sequence's last ones; all of a pair that auto gives the
 * recurrence, which makes its own checkpoints in the backward), so ckpt may start uninitialised. */
ptrdiff_t gdn_chunk_checkpoint_count(ptrdiff_t T, ptrdiff_t C, ptrdiff_t Dk, ptrdiff_t Dv);
/* The chunk forward's work items: pairs times strips of value columns, at least
 * GDN_CHUNK_MIN_STRIP columns each (every strip recomputes the chunk's Q K^T, K K^T and UT
 * transform: narrower ones would spend more on that than they gain). Preparing those once per
 * chunk on any thread, for the strips to share, ran 0.93 x the time on the 2-core Zen 4 but
 * 1.15-1.3 x on the 16-core Xeon (2 to 16 threads): each chunk's prepared matrices then
 * cross cores, and the strips of a pair wait for one another. */
#define GDN_CHUNK_MIN_STRIP 32
ptrdiff_t gdn_chunk_fwd_items(ptrdiff_t npairs, ptrdiff_t Dv);
/* the chunk buffers of one thread, whole cache lines (bwd: the backward's, for max_len tokens;
 * given: as gdn_chunk_states_held) */
size_t gdn_chunk_part_len(ptrdiff_t C, ptrdiff_t max_len, ptrdiff_t Dk, ptrdiff_t Dv, int bwd,
                          int given);
size_t gdn_chunk_fwd_workspace_len(const gdn_sizes *sz);
/* The backward runs pairs one after another, each on the whole team of nt threads, when there
 * are GDN_CHUNK_TEAM_MIN threads or more per pair (and the call is not tiny): the walk over dH by
 * strips of value columns, then the chunks in parallel; its states then live in memory of its
 * own (calloc), and the threads' workspace holds no states. Otherwise one thread per pair. Either
 * way the same bits. The team does about 1.6 x the work (the walk recomputes what the chunks
 * then recompute again) and touches fresh memory for every chunk's states: on 2 threads one pair
 * ran 1.5 x slower than on one. (As the recurrent backward's GDN_BWD_SPLIT.) */
#define GDN_CHUNK_TEAM_MIN 8   /* 16-core Xeon: one pair on 16 threads 1.3 x faster than one thread;
                                * 4 pairs on 16, 2.1 x slower than one thread per pair */
int gdn_chunk_bwd_team(const gdn_sizes *sz, int nt);
size_t gdn_chunk_bwd_workspace_len(const gdn_sizes *sz, int team);
ptrdiff_t gdn_chunk_bwd_items(const gdn_sizes *sz);   /* work items: pairs times chunks */

/* The multiply-add ceiling of the instruction set the kernels use: GFLOP/s (a multiply-add counts
 * 2) of independent vector FMA chains on num_threads threads (0: OpenMP's default), float32 or
 * float64, timed over about `seconds`. What the bench divides kernel rates by. */
double gdn_fma_peak(int use_double, int num_threads, double seconds);
/* The rate of the chunk form's own matrix product, Cm [m, n] += Am [m, kd] Bm [kd, n] with the
 * chunk buffers' layouts, on the calling thread: GFLOP/s (2 m n kd a product), timed over about
 * `seconds`; -1 without memory. Beside gdn_fma_peak: how close the inner loops come to it. */
double gdn_mm_rate(int use_double, ptrdiff_t m, ptrdiff_t n, ptrdiff_t kd, double seconds);
double gdn_now(void);   /* seconds, wall clock */

/* The value checks' screen (gdn_ext._checks.value_messages): lo, hi <- the least and the largest
 * of x [n] ignoring NaN (both NaN when every element is, or n = 0), as NumPy's fmin / fmax
 * reduce; and the largest sum of squares of a row of x [m, d] (row-major), rows whose sum is NaN
 * ignored, summed in double (exact squares; NaN when every row's is). */
void gdn_range_f64(const double *x, ptrdiff_t n, double *lo, double *hi);
void gdn_range_f32(const float *x, ptrdiff_t n, double *lo, double *hi);
double gdn_row_sumsq_max_f64(const double *x, ptrdiff_t m, ptrdiff_t d);
double gdn_row_sumsq_max_f32(const float *x, ptrdiff_t m, ptrdiff_t d);

#endif /* GDN_H */
