/*
 * gdn_kernels.c -- the gated delta rule kernels for float and double (see gdn.h for the legend).
 * The kernel pair is written once in gdn_recurrent.inc and instantiated here per precision.
 */
#include <fenv.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "gdn.h"

#ifdef _OPENMP
#include <omp.h>
#define GDN_THREAD_ID() omp_get_thread_num()
#else
#define GDN_THREAD_ID() 0
#endif

/* Vectorise reductions over Dk without -ffast-math: "omp simd" licenses reordering in that loop
 * only, so results still do not depend on the thread count. */
#if defined(_OPENMP) || defined(GDN_OPENMP_SIMD)
#define GDN_PRAGMA(x) _Pragma(#x)
#define GDN_SIMD_SUM(acc) GDN_PRAGMA(omp simd reduction(+ : acc))
#define GDN_SIMD GDN_PRAGMA(omp simd)
#else
#define GDN_SIMD_SUM(acc)
#define GDN_SIMD
#endif

ptrdiff_t gdn_checkpoint_interval(ptrdiff_t T)
{
    ptrdiff_t C = 1;
    while (C * C < T) C++;
    return C;
}

/* a * b + c in size_t, or SIZE_MAX when it would overflow */
static size_t mul_add(size_t a, size_t b, size_t c)
{
    if (b != 0 && a > (SIZE_MAX - c) / b) return SIZE_MAX;
    return a * b + c;
}

size_t gdn_fwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    (void)T;
    /* S + q_t, k_t, alpha_t, alpha_t k_t */
    return mul_add((size_t)Dv + 4, (size_t)Dk, 0);
}

size_t gdn_bwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    const ptrdiff_t C = gdn_checkpoint_interval(T);
    const ptrdiff_t nseg = T > 0 ? (T + C - 1) / C : 0;
    /* checkpoints + (C + 1) segment states + G, (v - p) per step + do_t, seven Dk vectors */
    size_t states = mul_add((size_t)(nseg + C + 2), (size_t)Dv, 0);
    size_t vectors = mul_add((size_t)C + 1, (size_t)Dv, 7 * (size_t)Dk);
    if (states == SIZE_MAX || vectors == SIZE_MAX) return SIZE_MAX;
    return mul_add(states, (size_t)Dk, vectors);
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

int gdn_openmp_enabled(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Floating-point exceptions raised in worker threads are invisible to NumPy, which reads the
 * calling thread's flags after the loop: each (sequence, head) collects its own, and the union is
 * raised again on the calling thread, so warnings do not depend on the thread count. */
#define GDN_FE_FLAGS (FE_DIVBYZERO | FE_OVERFLOW | FE_INVALID | FE_UNDERFLOW)

#define GDN_L2_EPS 1e-6   /* q, k normalisation: x / sqrt(sum x^2 + eps) */

#define REAL double
#define SFX(name) name##_f64
#define GDN_SQRT sqrt
#include "gdn_recurrent.inc"
#undef REAL
#undef SFX
#undef GDN_SQRT

#define REAL float
#define SFX(name) name##_f32
#define GDN_SQRT sqrtf
#include "gdn_recurrent.inc"
#undef REAL
#undef SFX
#undef GDN_SQRT
