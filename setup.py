"""Build gdn_ext._core: the C kernels (csrc/gdn_kernels.c) and their NumPy glue (csrc/_core.c).

OpenMP flags are added only when a probe program compiles and links with them; otherwise the
kernels run serially and gdn_ext.openmp_enabled() returns False. No fast-math flags (they can
flush subnormals to zero for the whole process) and no tuning for the build machine's CPU (wheels
must run anywhere: the AVX2 / AVX-512 kernels are picked at run time).
"""
import ast
import os
import shlex
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


HERE = os.path.dirname(os.path.abspath(__file__))


def shared_constants():
    """The numbers of gdn_ext/_constants.py (NAME = literal), for the C build as -DGDN_NAME=..."""
    with open(os.path.join(HERE, "gdn_ext", "_constants.py")) as f:
        tree = ast.parse(f.read())
    return {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}


def _compiles(compiler, cflags, ldflags):
    """Whether PROBE compiles and links with the given flags, and with the user's CFLAGS /
    LDFLAGS (a sanitizer or coverage build must link its runtime into the probe too, or the
    probe fails for that reason and OpenMP would be turned off)."""
    user_c = shlex.split(os.environ.get("CFLAGS", ""))
    user_l = user_c + shlex.split(os.environ.get("LDFLAGS", ""))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(PROBE)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=user_c + cflags)
            compiler.link_executable(objs, os.path.join(tmp, "probe"),
                                     extra_postargs=user_l + ldflags)
        except Exception:
            return False
    return True


def openmp_flags(compiler):
    """(compile flags, link flags) that give OpenMP with this compiler, or None."""
    if compiler.compiler_type == "msvc":
        candidates = [(["/openmp"], [])]
    else:
        # GCC and Clang; then Apple Clang with Homebrew's libomp (CFLAGS / LDFLAGS point at it)
        candidates = [(["-fopenmp"], ["-fopenmp"]), (["-Xpreprocessor", "-fopenmp"], ["-lomp"])]
    if os.environ.get("GDN_EXT_NO_OPENMP") == "1":
        return None
    return next((c for c in candidates if _compiles(compiler, *c)), None)


class BuildExt(build_ext):
    def build_extensions(self):
        if self.compiler.compiler_type == "msvc":
            base = ["/O2"]
        else:
            # -ffp-contract=fast: let the AVX2 / AVX-512 builds fuse a*b+c into FMA (ISO C mode
            # turns contraction off); one rounding instead of two, same on every run
            base = ["-O3", "-std=c11", "-ffp-contract=fast"]
        openmp = openmp_flags(self.compiler)
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


if __name__ == "__main__":   # setuptools runs this file as __main__; tests import its helpers
    setup(
        ext_modules=[
            Extension(
                "gdn_ext._core",
                sources=["csrc/_core.c", "csrc/_block_cache.c", "csrc/gdn_kernels.c", "csrc/gdn_kernels_avx2.c",
                         "csrc/gdn_kernels_avx512.c"],
                depends=["csrc/gdn.h", "csrc/_block_cache.h", "csrc/gdn_recurrent.inc", "csrc/gdn_chunk.inc",
                         "csrc/gdn_chunk_team.inc", "csrc/gdn_instances.inc",
                         "gdn_ext/_constants.py"],
                include_dirs=[np.get_include(), "csrc"],
                define_macros=[("GDN_" + name, repr(value))
                               for name, value in shared_constants().items()],
            )
        ],
        cmdclass={"build_ext": BuildExt},
    )
