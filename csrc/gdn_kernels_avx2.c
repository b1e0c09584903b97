/*
 * gdn_kernels_avx2.c -- the kernel pair compiled for AVX2 + FMA; chosen at run time by
 * gdn_kernels.c only when the CPU has it (the default build targets plain x86-64).
 */
#include "gdn.h"
#if GDN_X86_DISPATCH
#include <fenv.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#pragma GCC target("avx2,fma")
#define GDN_VEC_BYTES 32   /* one vector register */
#define GDN_FWD_NV_MAX 2   /* strip registers: see gdn.h (AVX2 has 16 of them) */
#define GDN_ISA avx2
#include "gdn_instances.inc"
#else
typedef int gdn_kernels_avx2_is_empty; /* not x86-64 GCC/clang: only the portable instance */
#endif
