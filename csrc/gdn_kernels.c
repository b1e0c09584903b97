/*
 * gdn_kernels.c -- the gated delta rule kernels for float and double (see gdn.h for the legend).
 * The kernel pair is written once in gdn_recurrent.inc and instantiated here per precision.
 */
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

size_t gdn_fwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    (void)T;
    return (size_t)(Dv * Dk + 2 * Dk);
}

size_t gdn_bwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv)
{
    const ptrdiff_t C = gdn_checkpoint_interval(T);
    const ptrdiff_t nseg = T > 0 ? (T + C - 1) / C : 0;
    /* checkpoints + segment states + (v - p) per step + G + four Dk vectors + one Dv vector */
    return (size_t)((nseg + C + 2) * Dv * Dk + C * Dv + 4 * Dk + Dv);
}

int gdn_threads_for(ptrdiff_t N, int num_threads)
{
#ifdef _OPENMP
    int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
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

#define REAL double
#define SFX(name) name##_f64
#include "gdn_recurrent.inc"
#undef REAL
#undef SFX

#define REAL float
#define SFX(name) name##_f32
#include "gdn_recurrent.inc"
#undef REAL
#undef SFX
