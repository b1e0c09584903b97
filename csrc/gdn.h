/*
 * gdn.h -- the gated delta rule recurrence and its backward pass over time, in plain C.
 *
 * No Python in here: csrc/_core.c registers these kernels as NumPy generalized ufuncs.
 *
 * Dimension legend (used in every shape comment):
 *   N   independent (sequence, head) pairs in one call (the gufunc's loop dimension)
 *   T   time steps of one sequence
 *   Dk  key / query width (columns of the state)
 *   Dv  value width (rows of the state)
 *   C   checkpoint interval of the backward pass
 *
 * Math (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, section 3):
 *   p_t = alpha_t S_{t-1} k_t
 *   u_t = beta_t (v_t - p_t)
 *   S_t = alpha_t S_{t-1} + u_t k_t^T
 *   o_t = scale S_t q_t
 *
 * Strides are in elements (not bytes) and may be zero, negative or non-contiguous.
 */
#ifndef GDN_H
#define GDN_H

#include <stddef.h>

/* Per-operand strides of the forward pass, in elements. "n" is the stride between the N
 * (sequence, head) pairs; the other letters name the core axis they step along. */
typedef struct {
    ptrdiff_t q_n, q_t, q_k;       /* q      [N, T, Dk]  */
    ptrdiff_t k_n, k_t, k_k;       /* k      [N, T, Dk]  */
    ptrdiff_t v_n, v_t, v_v;       /* v      [N, T, Dv]  */
    ptrdiff_t a_n, a_t;            /* alpha  [N, T]      */
    ptrdiff_t b_n, b_t;            /* beta   [N, T]      */
    ptrdiff_t s0_n, s0_v, s0_k;    /* S_0    [N, Dv, Dk] */
    ptrdiff_t sc_n;                /* scale  [N]         */
    ptrdiff_t o_n, o_t, o_v;       /* o      [N, T, Dv]  */
    ptrdiff_t sT_n, sT_v, sT_k;    /* S_T    [N, Dv, Dk] */
} gdn_fwd_strides;

/* Per-operand strides of the backward pass, in elements. */
typedef struct {
    ptrdiff_t do_n, do_t, do_v;    /* do     [N, T, Dv]  */
    ptrdiff_t q_n, q_t, q_k;       /* q      [N, T, Dk]  */
    ptrdiff_t k_n, k_t, k_k;       /* k      [N, T, Dk]  */
    ptrdiff_t v_n, v_t, v_v;       /* v      [N, T, Dv]  */
    ptrdiff_t a_n, a_t;            /* alpha  [N, T]      */
    ptrdiff_t b_n, b_t;            /* beta   [N, T]      */
    ptrdiff_t s0_n, s0_v, s0_k;    /* S_0    [N, Dv, Dk] */
    ptrdiff_t dsT_n, dsT_v, dsT_k; /* dS_T   [N, Dv, Dk] */
    ptrdiff_t sc_n;                /* scale  [N]         */
    ptrdiff_t dq_n, dq_t, dq_k;    /* dq     [N, T, Dk]  */
    ptrdiff_t dk_n, dk_t, dk_k;    /* dk     [N, T, Dk]  */
    ptrdiff_t dv_n, dv_t, dv_v;    /* dv     [N, T, Dv]  */
    ptrdiff_t da_n, da_t;          /* dalpha [N, T]      */
    ptrdiff_t db_n, db_t;          /* dbeta  [N, T]      */
    ptrdiff_t ds0_n, ds0_v, ds0_k; /* dS_0   [N, Dv, Dk] */
} gdn_bwd_strides;

/* Checkpoint interval C of the backward pass: ceil(sqrt(T)), which minimises the
 * (ceil(T/C) + C + 2) states held per (sequence, head): checkpoints, a segment, and G. */
ptrdiff_t gdn_checkpoint_interval(ptrdiff_t T);

/* Workspace, in elements, that one thread needs for one (sequence, head); SIZE_MAX if that
 * would overflow size_t. */
size_t gdn_fwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv);
size_t gdn_bwd_workspace_len(ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv);

/* Threads a parallel loop over N pairs uses: min(N, num_threads or OpenMP's default,
 * GDN_MAX_OVERSUBSCRIBE * processors, OpenMP's thread limit). */
#define GDN_MAX_OVERSUBSCRIBE 4
int gdn_threads_for(ptrdiff_t N, int num_threads);
int gdn_openmp_enabled(void);

/*
 * Forward over N independent (sequence, head) pairs, in parallel over the pairs.
 * ws: nthreads * gdn_fwd_workspace_len(T, Dk, Dv) elements, nthreads = gdn_threads_for(N, num_threads).
 */
void gdn_forward_f64(double *o, double *S_T,
                     const double *q, const double *k, const double *v,
                     const double *alpha, const double *beta, const double *S_0,
                     const double *scale, const gdn_fwd_strides *st,
                     ptrdiff_t N, ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv,
                     int num_threads, double *ws);
void gdn_forward_f32(float *o, float *S_T,
                     const float *q, const float *k, const float *v,
                     const float *alpha, const float *beta, const float *S_0,
                     const float *scale, const gdn_fwd_strides *st,
                     ptrdiff_t N, ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv,
                     int num_threads, float *ws);

/*
 * Backward (BPTT) over N pairs: given do = dL/do and dS_T = dL/dS_T, the gradients with respect to
 * every input. States are recomputed from checkpoints every C steps; nothing of size T*Dk*Dv is held.
 * ws: nthreads * gdn_bwd_workspace_len(T, Dk, Dv) elements.
 */
void gdn_backward_f64(double *dq, double *dk, double *dv, double *dalpha, double *dbeta,
                      double *dS_0,
                      const double *d_o, const double *q, const double *k, const double *v,
                      const double *alpha, const double *beta, const double *S_0,
                      const double *dS_T, const double *scale, const gdn_bwd_strides *st,
                      ptrdiff_t N, ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv,
                      int num_threads, double *ws);
void gdn_backward_f32(float *dq, float *dk, float *dv, float *dalpha, float *dbeta,
                      float *dS_0,
                      const float *d_o, const float *q, const float *k, const float *v,
                      const float *alpha, const float *beta, const float *S_0,
                      const float *dS_T, const float *scale, const gdn_bwd_strides *st,
                      ptrdiff_t N, ptrdiff_t T, ptrdiff_t Dk, ptrdiff_t Dv,
                      int num_threads, float *ws);

#endif /* GDN_H */
