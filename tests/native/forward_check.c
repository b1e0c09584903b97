/*
 * forward_check.c -- the portable kernel build (the one aarch64 and other non-x86 CPUs run)
 * against a naive loop, without Python: compiled for another architecture and run under an
 * emulator by tests/test_package.py (qemu-aarch64), to check the vector-extension code there.
 * Exit status 0 when the largest error is within float32 rounding.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "gdn.h"

enum { T = 37, DK = 24, DV = 19 };

int main(void)
{
    gdn_init();
    static float q[T][DK], k[T][DK], v[T][DV], alpha[T], beta[T], S0[DV][DK];
    static float o[T][DV], ST[DV][DK];
    static double S[DV][DK], ref[T][DV];
    unsigned x = 12345;
#define RND() ((x = x * 1103515245u + 12345u), ((x >> 8) & 0xffff) / 65536.0f - 0.5f)
    for (int t = 0; t < T; t++) {
        float n = 0;
        for (int j = 0; j < DK; j++) { q[t][j] = RND(); k[t][j] = RND(); n += k[t][j] * k[t][j]; }
        for (int j = 0; j < DK; j++) k[t][j] /= sqrtf(n);
        for (int i = 0; i < DV; i++) v[t][i] = RND();
        alpha[t] = 0.75f + 0.5f * RND();
        beta[t] = 0.5f + RND();
    }
    for (int i = 0; i < DV; i++)
        for (int j = 0; j < DK; j++) S[i][j] = S0[i][j] = RND();
    /* the naive recurrence in double */
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < DV; i++) {
            double p = 0;
            for (int j = 0; j < DK; j++) p += alpha[t] * S[i][j] * k[t][j];
            const double u = beta[t] * (v[t][i] - p);
            double r = 0;
            for (int j = 0; j < DK; j++) {
                S[i][j] = alpha[t] * S[i][j] + u * k[t][j];
                r += S[i][j] * q[t][j];
            }
            ref[t][i] = r;
        }
    }
    const gdn_fwd_strides st = {
        .q_t = DK, .q_k = 1, .k_t = DK, .k_k = 1, .v_t = DV, .v_v = 1, .a_t = 1, .a_k = 0,
        .b_t = 1, .s0_v = DK, .s0_k = 1, .cu_m = 1, .o_t = DV, .o_v = 1, .sT_v = DK, .sT_k = 1};
    const gdn_sizes sz = {.N = 1, .T = T, .NS = 1, .Dk = DK, .Dv = DV, .max_len = T};
    const float scale = 1, normalize = 0;
    const int64_t cu[2] = {0, T};
    float *ws = calloc(gdn_fwd_workspace_len(T, DK, DV), sizeof(float));
    gdn_forward_f32(&o[0][0], &ST[0][0], NULL, &q[0][0], &k[0][0], &v[0][0], alpha, beta,
                    &S0[0][0], &scale, &normalize, NULL, cu, &st, &sz, 1, ws);
    double err = 0;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < DV; i++) err = fmax(err, fabs(o[t][i] - ref[t][i]));
    for (int i = 0; i < DV; i++)
        for (int j = 0; j < DK; j++) err = fmax(err, fabs(ST[i][j] - S[i][j]));
    printf("isa %s, largest error %.3g\n", gdn_isa(), err);
    free(ws);
    return err < 1e-4 ? 0 : 1;
}
