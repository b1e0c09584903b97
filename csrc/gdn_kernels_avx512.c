/*
 * gdn_kernels_avx512.c -- the kernel pair compiled for AVX512; chosen at run time by
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
/* Loops GCC vectorises itself (the backward's row blocks, Dk long) may use zmm or ymm: zmm measured
 * 7-13 % faster for the backward on the Intel device, ymm 10 % faster on an AMD EPYC (whose
 * multiply-add units are 256 bits wide). The default is zmm; -DGDN_AVX512_AUTO_WIDTH=256 picks ymm.
 * The forward's strips use zmm explicitly (GDN_VEC_BYTES) either way. */
#if !defined(GDN_AVX512_AUTO_WIDTH) || GDN_AVX512_AUTO_WIDTH == 512
#pragma GCC target("avx512f,avx512vl,avx2,fma,prefer-vector-width=512")
#else
#pragma GCC target("avx512f,avx512vl,avx2,fma,prefer-vector-width=256")
#endif
#define GDN_VEC_BYTES 64   /* one zmm register */
#define GDN_FWD_NV_MAX 4   /* strip registers: see gdn.h (AVX-512 has 32 of them) */
#define GDN_ISA avx512
#include "gdn_instances.inc"
#else
typedef int gdn_kernels_avx512_is_empty; /* not x86-64 GCC/clang: only the portable instance */
#endif
