"""Build gdn_ext._core: the C kernels (csrc/gdn_kernels.c) and their NumPy glue (csrc/_core.c).

OpenMP flags are added only when a probe program compiles and links with them; otherwise the
kernels run serially and gdn_ext.openmp_enabled() returns False. No fast-math flags (they can
flush subnormals to zero for the whole process) and no tuning for the build machine's CPU (wheels
must run anywhere: the AVX2 / AVX-512 kernels are picked at run time).
"""
import os
import sys
import tempfile

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PROBE = r"""
#include <omp.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    return n > 0 ? 0 : 1;
}
"""


def _compiles(compiler, cflags, ldflags):
    """Whether PROBE compiles and links with the given flags."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(PROBE)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
            compiler.link_executable(objs, os.path.join(tmp, "probe"), extra_postargs=ldflags)
        except Exception:
            return False
    return True


class BuildExt(build_ext):
    def build_extensions(self):
        if self.compiler.compiler_type == "msvc":
            candidates = [(["/openmp"], [])]
            base = ["/O2"]
        else:
            candidates = [(["-fopenmp"], ["-fopenmp"]), (["-Xpreprocessor", "-fopenmp"], ["-lomp"])]
            # -ffp-contract=fast: let the AVX2 / AVX-512 builds fuse a*b+c into FMA (ISO C mode
            # turns contraction off); one rounding instead of two, same on every run
            base = ["-O3", "-std=c11", "-ffp-contract=fast"]
        openmp = None
        if os.environ.get("GDN_EXT_NO_OPENMP") != "1":
            openmp = next((c for c in candidates if _compiles(self.compiler, *c)), None)
        extra_c, extra_l = list(base), []
        if openmp:
            extra_c += openmp[0]
            extra_l += openmp[1]
        elif self.compiler.compiler_type != "msvc":
            # still vectorise the "omp simd" reductions; no threads
            extra_c += ["-fopenmp-simd", "-DGDN_OPENMP_SIMD"]
        print(f"gdn_ext: OpenMP {'enabled: ' + ' '.join(openmp[0]) if openmp else 'not available'}",
              file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = extra_c + ext.extra_compile_args
            ext.extra_link_args = extra_l + ext.extra_link_args
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "gdn_ext._core",
            sources=["csrc/_core.c", "csrc/gdn_kernels.c", "csrc/gdn_kernels_avx2.c",
                     "csrc/gdn_kernels_avx512.c"],
            depends=["csrc/gdn.h", "csrc/gdn_recurrent.inc", "csrc/gdn_instances.inc"],
            include_dirs=[np.get_include(), "csrc"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
