/*
 * gdn_kernels.c -- what the kernels share (sizes, thread counts, cu_seqlens checks) and the run-time
 * choice of instruction set: the kernel pair (gdn_recurrent.inc) is compiled three times on x86-64
 * -- portable, AVX2 + FMA, AVX-512 -- and gdn_forward_f32 & co. call the best one the CPU has.
 * Legend of dimension letters: see gdn.h.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gdn.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- flush-to-zero / denormals-are-zero (see gdn.h) --------------------------------------- */
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#define GDN_FLUSH_BITS 0x8040u   /* MXCSR: FTZ (bit 15) | DAZ (bit 6) */
static unsigned gdn_fpmode_get(void) { return _mm_getcsr(); }
static void gdn_fpmode_set(unsigned m) { _mm_setcsr(m); }
#elif defined(__aarch64__) && defined(__GNUC__)
#define GDN_FLUSH_BITS (1u << 24)   /* FPCR.FZ: subnormal inputs and results are zero */
static unsigned gdn_fpmode_get(void)
{
    uint64_t r;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(r));
    return (unsigned)r;
}
static void gdn_fpmode_set(unsigned m)
{
    uint64_t r = m;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(r));
}
#else
#define GDN_FLUSH_BITS 0u   /* no portable way: IEEE subnormals, and their cost */
static unsigned gdn_fpmode_get(void) { return 0; }
static void gdn_fpmode_set(unsigned m) { (void)m; }
#endif

int gdn_flush_supported(void) { return GDN_FLUSH_BITS != 0; }

gdn_fpmode gdn_flush_begin(void)
{
    const unsigned m = gdn_fpmode_get();
    if ((m & GDN_FLUSH_BITS) != GDN_FLUSH_BITS) gdn_fpmode_set(m | GDN_FLUSH_BITS);
    return m;
}

void gdn_flush_end(gdn_fpmode previous)
{
    /* only the mode bits: MXCSR also holds the exception flags the kernel raised */
    const unsigned m = gdn_fpmode_get();
    const unsigned want = (m & ~GDN_FLUSH_BITS) | (previous & GDN_FLUSH_BITS);
    if (want != m) gdn_fpmode_set(want);
}

#include <time.h>
double gdn_now(void)
{
#ifdef _OPENMP
    return omp_get_wtime();
#else
    return (double)clock() / CLOCKS_PER_SEC;
#endif
}

ptrdiff_t gdn_checkpoint_interval(ptrdiff_t T)
{
    ptrdiff_t C = 1;
    while (C * C < T) C++;
    return C;
}

ptrdiff_t gdn_checkpoint_count(ptrdiff_t T)
{
    return T > 0 ? (T + gdn_checkpoint_interval(T) - 1) / gdn_checkpoint_interval(T) : 0;
}

/* a * b + c in size_t, or SIZE_MAX when it would overflow */
static size_t mul_add(size_t a, size_t b, size_t c)
{
    if (b != 0 && a > (SIZE_MAX - c) / b) return SIZE_MAX;
    return a * b + c;
}

/* n rounded up to whole cache lines of elements, plus the alignment slack; SIZE_MAX stays */
static size_t with_slack(size_t n)
{
    if (n > SIZE_MAX - 2 * GDN_SCRATCH_SLACK) return SIZE_MAX;
    return (n + GDN_SCRATCH_SLACK - 1) / GDN_SCRATCH_SLACK * GDN_SCRATCH_SLACK + GDN_SCRATCH_SLACK;
}

ptrdiff_t gdn_fwd_block(ptrdiff_t T) { return T < 1 ? 1 : T < GDN_FWD_BLOCK ? T : GDN_FWD_BLOCK; }

size_t gdn_fwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    /* S^T (value columns padded to the widest strip, DvX) + a time block of k, alpha, alpha k,
     * alpha q [TB, Dk], k.q, beta [TB], v and o [TB, DvX] + q_t [Dk] + v_t, r, w [DvX] (short
     * sequences, which use S^T's room for the untransposed state) */
    const size_t DvX = ((size_t)Dv + GDN_FWD_COLS_MAX - 1) / GDN_FWD_COLS_MAX * GDN_FWD_COLS_MAX;
    const size_t TB = (size_t)gdn_fwd_block(T);
    size_t n = mul_add(DvX + 4 * TB + 1, (size_t)Dk, 2 * TB);
    n = mul_add(2 * TB + 3, DvX, n);
    return with_slack(n);
}

/* n rounded up to whole cache lines of elements */
static size_t lines(size_t n)
{
    if (n > SIZE_MAX - GDN_SCRATCH_SLACK) return SIZE_MAX;
    return (n + GDN_SCRATCH_SLACK - 1) / GDN_SCRATCH_SLACK * GDN_SCRATCH_SLACK;
}

/* the backward's padded state sizes: value rows to whole strips, key rows to whole vectors */
static size_t bwd_rows(ptrdiff_t Dv)
{
    return ((size_t)Dv + GDN_BWD_ROWS - 1) / GDN_BWD_ROWS * GDN_BWD_ROWS;
}
static size_t bwd_keys(ptrdiff_t Dk)
{
    return ((size_t)Dk + GDN_BWD_KPAD - 1) / GDN_BWD_KPAD * GDN_BWD_KPAD;
}

size_t gdn_bwd_pair_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    const size_t C = (size_t)gdn_checkpoint_interval(T);
    const size_t nseg = T > 0 ? ((size_t)T + C - 1) / C : 0;
    const size_t DvP = bwd_rows(Dv), K = bwd_keys(Dk), nstr = DvP / GDN_BWD_ROWS;
    const size_t NP = 3 * K + 2;
    /* checkpoints and G [DvP, K]; the strips' summed and separate partial sums [C, NP]; a
     * segment's q, k, alpha, alpha k [C, K], norms, beta [C], v, do [C, DvP] */
    size_t n = mul_add(nseg + 1, DvP, 0);
    n = mul_add(n, K, 0);
    n = mul_add(mul_add(nstr + 1, NP, 0), C, n);
    n = mul_add(C, 4 * K + 3 + 2 * DvP, n);
    return lines(n);
}

size_t gdn_bwd_thread_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    const size_t C = (size_t)gdn_checkpoint_interval(T);
    const size_t R = GDN_BWD_ROWS, K = bwd_keys(Dk);
    /* the checkpoint pass's forward workspace; a strip's S_{t-1} [C, R, K] and v - p [C, R],
     * four K vectors */
    size_t fwd = gdn_fwd_workspace_len(T, Dk, Dv);
    if (fwd == SIZE_MAX) return SIZE_MAX;
    size_t n = mul_add(mul_add(C, R, 0), K + 1, 4 * K);
    return lines(mul_add(1, n, fwd - GDN_SCRATCH_SLACK));
}

size_t gdn_bwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    size_t p = gdn_bwd_pair_len(T, Dk, Dv), t = gdn_bwd_thread_len(T, Dk, Dv);
    if (p == SIZE_MAX || t == SIZE_MAX || p > SIZE_MAX - t - GDN_SCRATCH_SLACK) return SIZE_MAX;
    return p + t + GDN_SCRATCH_SLACK;
}

ptrdiff_t gdn_bwd_items(ptrdiff_t npairs, ptrdiff_t Dv)
{
    return npairs * (Dv > 0 ? (Dv + GDN_BWD_ROWS - 1) / GDN_BWD_ROWS : 1);
}

ptrdiff_t gdn_fwd_items(ptrdiff_t npairs, ptrdiff_t Dv)
{
    /* an upper bound: strips of at least GDN_FWD_COLS_MIN value rows */
    return npairs * (Dv > 0 ? (Dv + GDN_FWD_COLS_MIN - 1) / GDN_FWD_COLS_MIN : 1);
}

int gdn_check_cu_seqlens(const int64_t *cu, ptrdiff_t cu_n, ptrdiff_t cu_m, ptrdiff_t N,
                         ptrdiff_t NS, ptrdiff_t T, ptrdiff_t *max_len)
{
    ptrdiff_t longest = 0;
    for (ptrdiff_t n = 0; n < N; n++) {
        const int64_t *c = cu + n * cu_n;
        if (c[0] != 0) return -1;
        if (c[NS * cu_m] != T) return -3;
        for (ptrdiff_t s = 0; s < NS; s++) {
            const int64_t len = c[(s + 1) * cu_m] - c[s * cu_m];
            if (len < 0) return -2;
            if (len > longest) longest = (ptrdiff_t)len;
        }
    }
    *max_len = longest;
    return 0;
}

/* 0: no cap; read and written with OpenMP atomics (calls may come from several Python threads) */
static int busy_cap = 0;
static unsigned busy_calls = 0;

int gdn_default_thread_cap(void)
{
    int cap;
#ifdef _OPENMP
    #pragma omp atomic read
#endif
    cap = busy_cap;
    return cap;
}

void gdn_note_team(int nt, int nlate, double late, double total)
{
    if (nt < 2 || !(total > 0)) return;
    int cap = gdn_default_thread_cap();
    /* a quarter of the call waiting for threads, longer than waking an idle one takes, and more
     * than a quarter of the team late: their cores run other work */
    if (late > 0.25 * total && late > GDN_LATE_S && 4 * nlate > nt)
        cap = nt - nlate > 1 ? nt - nlate : 1;
    else if (late < 0.05 * total && cap != 0 && nt >= cap)   /* on time at the cap: grow */
        cap = 2 * cap >= gdn_num_procs() ? 0 : 2 * cap;
    else
        return;
#ifdef _OPENMP
    #pragma omp atomic write
#endif
    busy_cap = cap;
}

gdn_team_clock gdn_team_start(void)
{
    gdn_team_clock tc = {gdn_now(), 0, 0};
    return tc;
}

void gdn_team_done(int nt, const gdn_team_clock *tc)
{
    if (nt > gdn_num_procs()) return;   /* more threads than processors: late by construction */
    gdn_note_team(nt, tc->nlate, tc->late, gdn_now() - tc->start);
}

int gdn_capped_threads(int nt, int num_threads)
{
    if (num_threads > 0) return nt;   /* asked for: as asked */
    const int cap = gdn_default_thread_cap();
    unsigned calls;
#ifdef _OPENMP
    #pragma omp atomic capture
#endif
    calls = busy_calls++;
    if (cap > 0 && nt > cap) nt = (calls % 8 == 7) ? 2 * cap : cap;   /* 1 call in 8 probes */
    return nt;
}

int gdn_threads_for(ptrdiff_t N, int num_threads)
{
#ifdef _OPENMP
    int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
    /* more threads than GDN_MAX_OVERSUBSCRIBE per processor only cost memory (and thread
     * creation can fail and abort the process); results do not depend on the count */
    const int cap = GDN_MAX_OVERSUBSCRIBE * omp_get_num_procs();
    if (nt > cap) nt = cap;
    if (nt > omp_get_thread_limit()) nt = omp_get_thread_limit();
#else
    int nt = 1;
    (void)num_threads;
#endif
    if (N < nt) nt = (int)N;
    return nt < 1 ? 1 : nt;
}

int gdn_num_procs(void)
{
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

int gdn_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}


/* ---- run-time dispatch -------------------------------------------------------------------- */

/* The kernel instances: gdn_recurrent.inc compiled once per instruction set (gdn_instances.inc
 * names them through SFX; the names are written out here so that grep finds them). */
#define GDN_DECLARE_ISA(isa)                                                                     \
    double gdn_fma_probe_f64_##isa(long iters, double m, double c);                              \
    double gdn_fma_probe_f32_##isa(long iters, float m, float c);                                \
    int gdn_fma_lanes_f64_##isa(void);                                                           \
    int gdn_fma_lanes_f32_##isa(void);                                                           \
    size_t gdn_chunk_ws_f64_##isa(ptrdiff_t C, ptrdiff_t Dk, ptrdiff_t Dv, int bwd, ptrdiff_t nt); \
    size_t gdn_mm_probe_len_f64_##isa(ptrdiff_t m, ptrdiff_t n, ptrdiff_t kd);                    \
    size_t gdn_mm_probe_len_f32_##isa(ptrdiff_t m, ptrdiff_t n, ptrdiff_t kd);                    \
    double gdn_mm_probe_f64_##isa(double *w, ptrdiff_t m, ptrdiff_t n, ptrdiff_t kd, long reps);   \
    double gdn_mm_probe_f32_##isa(float *w, ptrdiff_t m, ptrdiff_t n, ptrdiff_t kd, long reps);
GDN_DECLARE_ISA(generic)
void gdn_forward_f32_generic(const gdn_fwd_call *call);    /* gdn_kernels.c (portable) */
void gdn_forward_f64_generic(const gdn_fwd_call *call);
void gdn_backward_f32_generic(const gdn_bwd_call *call);
void gdn_backward_f64_generic(const gdn_bwd_call *call);
void gdn_chunk_forward_f32_generic(const gdn_fwd_call *call);
void gdn_chunk_forward_f64_generic(const gdn_fwd_call *call);
void gdn_chunk_backward_f32_generic(const gdn_bwd_call *call);
void gdn_chunk_backward_f64_generic(const gdn_bwd_call *call);
#if GDN_X86_DISPATCH
GDN_DECLARE_ISA(avx2)
GDN_DECLARE_ISA(avx512)
void gdn_forward_f32_avx2(const gdn_fwd_call *call);       /* gdn_kernels_avx2.c */
void gdn_forward_f64_avx2(const gdn_fwd_call *call);
void gdn_backward_f32_avx2(const gdn_bwd_call *call);
void gdn_backward_f64_avx2(const gdn_bwd_call *call);
void gdn_chunk_forward_f32_avx2(const gdn_fwd_call *call);
void gdn_chunk_forward_f64_avx2(const gdn_fwd_call *call);
void gdn_chunk_backward_f32_avx2(const gdn_bwd_call *call);
void gdn_chunk_backward_f64_avx2(const gdn_bwd_call *call);
void gdn_forward_f32_avx512(const gdn_fwd_call *call);     /* gdn_kernels_avx512.c */
void gdn_forward_f64_avx512(const gdn_fwd_call *call);
void gdn_backward_f32_avx512(const gdn_bwd_call *call);
void gdn_backward_f64_avx512(const gdn_bwd_call *call);
void gdn_chunk_forward_f32_avx512(const gdn_fwd_call *call);
void gdn_chunk_forward_f64_avx512(const gdn_fwd_call *call);
void gdn_chunk_backward_f32_avx512(const gdn_bwd_call *call);
void gdn_chunk_backward_f64_avx512(const gdn_bwd_call *call);
#endif

/* The kernels of each level, in the order of isa_names. */
static const struct {
    void (*forward_f32)(const gdn_fwd_call *);
    void (*forward_f64)(const gdn_fwd_call *);
    void (*backward_f32)(const gdn_bwd_call *);
    void (*backward_f64)(const gdn_bwd_call *);
    void (*chunk_forward_f32)(const gdn_fwd_call *);
    void (*chunk_forward_f64)(const gdn_fwd_call *);
    void (*chunk_backward_f32)(const gdn_bwd_call *);
    void (*chunk_backward_f64)(const gdn_bwd_call *);
} kernels[] = {
    {gdn_forward_f32_generic, gdn_forward_f64_generic, gdn_backward_f32_generic,
     gdn_backward_f64_generic, gdn_chunk_forward_f32_generic, gdn_chunk_forward_f64_generic,
     gdn_chunk_backward_f32_generic, gdn_chunk_backward_f64_generic},
#if GDN_X86_DISPATCH
    {gdn_forward_f32_avx2, gdn_forward_f64_avx2, gdn_backward_f32_avx2, gdn_backward_f64_avx2,
     gdn_chunk_forward_f32_avx2, gdn_chunk_forward_f64_avx2, gdn_chunk_backward_f32_avx2,
     gdn_chunk_backward_f64_avx2},
    {gdn_forward_f32_avx512, gdn_forward_f64_avx512, gdn_backward_f32_avx512,
     gdn_backward_f64_avx512, gdn_chunk_forward_f32_avx512, gdn_chunk_forward_f64_avx512,
     gdn_chunk_backward_f32_avx512, gdn_chunk_backward_f64_avx512},
#endif
};

static int isa_level = 0;   /* 0 portable, 1 AVX2 + FMA, 2 AVX-512; set once by gdn_init */
static const char *const isa_names[] = {"generic", "avx2", "avx512"};

void gdn_init(void)
{
    int best = 0;
#if GDN_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
    /* every feature the AVX-512 translation unit is compiled for */
    if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl"))
        best = 2;
#endif
    int level = best;
    /* GDN_EXT_ISA=generic|avx2|avx512 asks for a level the CPU has (tests, comparisons); other
     * values leave the best level, and gdn_ext/_native.py warns about them */
    const char *want = getenv("GDN_EXT_ISA");
    if (want != NULL)
        for (int i = 0; i < 3; i++)
            if (strcmp(want, isa_names[i]) == 0 && i <= best) level = i;
    isa_level = level;
}

const char *gdn_isa(void) { return isa_names[isa_level]; }

/* sz->chunk > 0: the chunkwise form (gdn_chunk.inc), else the recurrence (gdn_recurrent.inc) */
void gdn_forward_f32(const gdn_fwd_call *call)
{
    (call->sz->chunk > 0 ? kernels[isa_level].chunk_forward_f32 : kernels[isa_level].forward_f32)(call);
}
void gdn_forward_f64(const gdn_fwd_call *call)
{
    (call->sz->chunk > 0 ? kernels[isa_level].chunk_forward_f64 : kernels[isa_level].forward_f64)(call);
}
void gdn_backward_f32(const gdn_bwd_call *call)
{
    (call->sz->chunk > 0 ? kernels[isa_level].chunk_backward_f32 : kernels[isa_level].backward_f32)(call);
}
void gdn_backward_f64(const gdn_bwd_call *call)
{
    (call->sz->chunk > 0 ? kernels[isa_level].chunk_backward_f64 : kernels[isa_level].backward_f64)(call);
}

ptrdiff_t gdn_chunk_fwd_items(ptrdiff_t npairs, ptrdiff_t Dv)
{
    return npairs * (Dv > GDN_CHUNK_MIN_STRIP ? (Dv + GDN_CHUNK_MIN_STRIP - 1) / GDN_CHUNK_MIN_STRIP
                                              : 1);
}

ptrdiff_t gdn_chunk_segment(ptrdiff_t NT, ptrdiff_t Dk, ptrdiff_t Dv)
{
    const double DD = (double)((Dk + 2 * GDN_CHUNK_PAD - 1) / GDN_CHUNK_PAD * GDN_CHUNK_PAD)
                      * (double)((Dv + 2 * GDN_CHUNK_PAD - 1) / GDN_CHUNK_PAD * GDN_CHUNK_PAD);
    if ((double)NT * DD <= GDN_CHUNK_KEEP_ELEMENTS) return 1;
    ptrdiff_t R = 1;
    while (R * R < NT) R++;
    return R;
}

ptrdiff_t gdn_chunk_states_held(ptrdiff_t NT, ptrdiff_t Dk, ptrdiff_t Dv, int given)
{
    const ptrdiff_t R = gdn_chunk_segment(NT, Dk, Dv);
    if (given) return R == 1 ? 0 : R;
    return R == 1 ? NT : (NT + R - 1) / R + R;
}

/* ceil(NT / R), but never less than for a shorter sequence (the packed sequences of one call
 * share one axis of slots): past the budget's NT*, at least NT* */
ptrdiff_t gdn_chunk_checkpoint_count(ptrdiff_t T, ptrdiff_t C, ptrdiff_t Dk, ptrdiff_t Dv)
{
    const ptrdiff_t NT = T > 0 ? (T + C - 1) / C : 0, R = gdn_chunk_segment(NT, Dk, Dv);
    if (R == 1) return NT;
    ptrdiff_t keep = NT;   /* the longest NT kept whole: R(keep) == 1 */
    while (keep > 0 && gdn_chunk_segment(keep, Dk, Dv) > 1) keep /= 2;
    while (gdn_chunk_segment(keep + 1, Dk, Dv) == 1) keep++;
    const ptrdiff_t n = (NT + R - 1) / R;
    return n > keep ? n : keep;
}

/* every instance pads to GDN_CHUNK_PAD: the portable one counts for all */
size_t gdn_chunk_part_len(ptrdiff_t C, ptrdiff_t max_len, ptrdiff_t Dk, ptrdiff_t Dv, int bwd,
                          int given)
{
    const ptrdiff_t nt =
        bwd && C > 0 ? gdn_chunk_states_held((max_len + C - 1) / C, Dk, Dv, given) : 0;
    /* the states of nt chunks dominate; refuse sizes whose count would overflow */
    if ((double)nt * (double)(Dk + 2 * GDN_CHUNK_PAD) * (double)(Dv + 2 * GDN_CHUNK_PAD)
        > (double)(SIZE_MAX / 16))
        return SIZE_MAX;
    return lines(gdn_chunk_ws_f64_generic(C, Dk, Dv, bwd, nt));
}

/* the chunk buffers, then (auto) the recurrence's workspace for the pairs that take it */
size_t gdn_chunk_fwd_workspace_len(const gdn_sizes *sz)
{
    const size_t c = gdn_chunk_part_len(sz->chunk, sz->max_len, sz->Dk, sz->Dv, 0, 0);
    const size_t r = sz->chunk_auto ? gdn_fwd_workspace_len(sz->max_len, sz->Dk, sz->Dv) : 0;
    if (c == SIZE_MAX || r == SIZE_MAX || c > SIZE_MAX / 2 - r) return SIZE_MAX;
    return sz->chunk_auto ? c + r : with_slack(c);
}

int gdn_chunk_bwd_team(const gdn_sizes *sz, int nt)
{
    const int parallel = (double)sz->N * (double)sz->T * (double)sz->Dk * (double)sz->Dv
                         >= GDN_PARALLEL_MIN_WORK;
    return parallel && sz->N * sz->NS * GDN_CHUNK_TEAM_MIN <= nt;
}

ptrdiff_t gdn_chunk_bwd_items(const gdn_sizes *sz)
{
    const ptrdiff_t NT = sz->chunk > 0 ? (sz->max_len + sz->chunk - 1) / sz->chunk : 0;
    return sz->N * sz->NS * (NT > 1 ? NT : 1);
}

size_t gdn_chunk_bwd_workspace_len(const gdn_sizes *sz, int team)
{
    /* a team's threads hold one chunk's buffers, no states */
    const size_t c = team ? lines(gdn_chunk_ws_f64_generic(sz->chunk, sz->Dk, sz->Dv, 1, 0))
                          : gdn_chunk_part_len(sz->chunk, sz->max_len, sz->Dk, sz->Dv, 1,
                                               sz->chunk_states);
    size_t r = 0;
    if (sz->chunk_auto) {
        const size_t p = gdn_bwd_pair_len(sz->max_len, sz->Dk, sz->Dv);
        const size_t t = gdn_bwd_thread_len(sz->max_len, sz->Dk, sz->Dv);
        if (p == SIZE_MAX || t == SIZE_MAX || p > SIZE_MAX / 4 - t) return SIZE_MAX;
        r = p + t;
    }
    if (c == SIZE_MAX || c > SIZE_MAX / 2 - r) return SIZE_MAX;
    return with_slack(c + r);
}

#if GDN_X86_DISPATCH
#define GDN_DISPATCH_RET(fn, ...)                                                                \
    (isa_level == 2 ? fn##_avx512(__VA_ARGS__) : isa_level == 1 ? fn##_avx2(__VA_ARGS__)          \
                                                : fn##_generic(__VA_ARGS__))
#else
#define GDN_DISPATCH_RET(fn, ...) fn##_generic(__VA_ARGS__)
#endif

double gdn_fma_peak(int use_double, int num_threads, double seconds)
{
    /* calibrate the iterations on one thread, then time every thread running them at once */
    volatile double mv = 0.999999, cv = 1e-7;   /* unknown to the compiler: no folding */
    const double m = mv, c = cv;
    const int lanes = use_double ? GDN_DISPATCH_RET(gdn_fma_lanes_f64) : GDN_DISPATCH_RET(gdn_fma_lanes_f32);
    long iters = 1000;
    double sink = 0, dt = 0;
    for (;;) {
        const double t0 = gdn_now();
        sink += use_double ? GDN_DISPATCH_RET(gdn_fma_probe_f64, iters, m, c)
                           : GDN_DISPATCH_RET(gdn_fma_probe_f32, iters, (float)m, (float)c);
        dt = gdn_now() - t0;
        if (dt > seconds / 4 || iters > (1L << 40)) break;
        iters *= 4;
    }
    const int nt = gdn_threads_for(num_threads > 0 ? num_threads : 1 << 30, num_threads);
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = gdn_now();
#ifdef _OPENMP
        #pragma omp parallel num_threads(nt) reduction(+ : sink)
#endif
        sink += use_double ? GDN_DISPATCH_RET(gdn_fma_probe_f64, iters, m, c)
                           : GDN_DISPATCH_RET(gdn_fma_probe_f32, iters, (float)m, (float)c);
        dt = gdn_now() - t0;
        const double rate = 2.0 * lanes * (double)iters * nt / dt / 1e9;
        if (rate > best) best = rate;
    }
    return sink == 12345.678 ? -best : best;   /* sink is live; never equal in practice */
}

double gdn_mm_rate(int use_double, ptrdiff_t m, ptrdiff_t n, ptrdiff_t kd, double seconds)
{
    /* as gdn_fma_peak: calibrate the repetitions, then the best of three timings */
    const size_t len = use_double ? GDN_DISPATCH_RET(gdn_mm_probe_len_f64, m, n, kd)
                                  : GDN_DISPATCH_RET(gdn_mm_probe_len_f32, m, n, kd);
    const size_t es = use_double ? sizeof(double) : sizeof(float);
    void *block = malloc(len * es + 64);
    if (block == NULL) return -1;
    void *w = (void *)(((uintptr_t)block + 63) / 64 * 64);   /* whole vectors from the start */
    double sink = 0, best = 0;
    long reps = 1;
    for (int timed = 0; timed < 3;) {
        const double t0 = gdn_now();
        sink += use_double ? GDN_DISPATCH_RET(gdn_mm_probe_f64, (double *)w, m, n, kd, reps)
                           : GDN_DISPATCH_RET(gdn_mm_probe_f32, (float *)w, m, n, kd, reps);
        const double dt = gdn_now() - t0;
        if (dt < seconds / 4 && reps < (1L << 40)) {
            reps *= 4;
            continue;
        }
        const double rate = 2.0 * (double)m * (double)n * (double)kd * (double)reps / dt / 1e9;
        if (rate > best) best = rate;
        timed++;
    }
    free(block);
    return sink == 12345.678 ? -best : best;   /* sink is live; never equal in practice */
}

/* ---- the value checks' screen (gdn.h) ----------------------------------------------------- */
#define GDN_RANGE(NAME, T)                                                                       \
    void NAME(const T *x, ptrdiff_t n, double *lo, double *hi)                                   \
    {                                                                                            \
        double a = 0, b = 0;                                                                     \
        int seen = 0;                                                                            \
        for (ptrdiff_t i = 0; i < n; i++) {                                                      \
            const double v = (double)x[i];                                                       \
            if (v != v) continue;                                                                \
            if (!seen || v < a) a = v;                                                           \
            if (!seen || v > b) b = v;                                                           \
            seen = 1;                                                                            \
        }                                                                                        \
        *lo = seen ? a : (double)NAN;                                                            \
        *hi = seen ? b : (double)NAN;                                                            \
    }
GDN_RANGE(gdn_range_f64, double)
GDN_RANGE(gdn_range_f32, float)

#define GDN_ROW_SUMSQ_MAX(NAME, T)                                                               \
    double NAME(const T *x, ptrdiff_t m, ptrdiff_t d)                                            \
    {                                                                                            \
        double best = (double)NAN;                                                               \
        for (ptrdiff_t r = 0; r < m; r++) {                                                      \
            double s = 0;                                                                        \
            for (ptrdiff_t j = 0; j < d; j++) s += (double)x[r * d + j] * (double)x[r * d + j];  \
            if (s == s && !(s <= best)) best = s;   /* NaN rows skipped; best NaN: none yet */   \
        }                                                                                        \
        return best;                                                                             \
    }
GDN_ROW_SUMSQ_MAX(gdn_row_sumsq_max_f64, double)
GDN_ROW_SUMSQ_MAX(gdn_row_sumsq_max_f32, float)

/* ---- the portable instance ---------------------------------------------------------------- */
#define GDN_VEC_BYTES 16   /* one vector register */
#define GDN_FWD_NV_MAX 4
#define GDN_ISA generic
#include "gdn_instances.inc"
