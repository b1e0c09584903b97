"""The package as a user meets it: scalars and empty key dimensions refused by name, the oracle
importable without the compiled module, the command line, compact results, the build's shared
constants and its OpenMP probe."""
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gdn_ext
from gdn_ext import _constants, _core, reference
from helpers import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _unit(x):
    """keys of norm 1, so that beta ||k||^2 <= 1 (no stability warning)"""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _seq(rng, B=2, T=5, H=2, Dk=4, Dv=3):
    return dict(q=rng.standard_normal((B, T, H, Dk)), k=_unit(rng.standard_normal((B, T, H, Dk))),
                v=rng.standard_normal((B, T, H, Dv)), beta=rng.uniform(0, 1, (B, T, H)),
                alpha=rng.uniform(0.5, 1, (B, T, H)))


def _step(rng, B=2, H=2, Dk=4, Dv=3):
    return dict(q_t=rng.standard_normal((B, H, Dk)), k_t=_unit(rng.standard_normal((B, H, Dk))),
                v_t=rng.standard_normal((B, H, Dv)), beta=rng.uniform(0, 1, (B, H)),
                alpha=rng.uniform(0.5, 1, (B, H)), state=None)


def _single(rng, B=2, T=5, Dk=4, Dv=3):
    return dict(q=rng.standard_normal((B, T, Dk)), k=_unit(rng.standard_normal((B, T, Dk))),
                v=rng.standard_normal((B, T, Dv)), beta=rng.uniform(0, 1, (B, T)),
                alpha=rng.uniform(0.5, 1, (B, T)))


def _call(kind, kw, do=None):
    if kind == "step":
        kw = dict(kw)
        return gdn_ext.gated_delta_rule_step(kw.pop("q_t"), kw.pop("k_t"), kw.pop("v_t"), **kw)
    kw = dict(kw)
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    if kind == "backward":
        do = np.ones(np.shape(v)) if do is None else do
        return gdn_ext.gated_delta_rule_backward(do, q, k, v, **kw)
    return gdn_ext.gated_delta_rule(q, k, v, **kw)


@pytest.mark.parametrize("kind,make", [("forward", _seq), ("backward", _seq), ("step", _step),
                                       ("forward", _single), ("backward", _single)])
def test_scalars_where_arrays_are_required_are_named(kind, make):
    """A 0-d array or Python scalar for any array argument but beta and the gate (which take
    scalars: tests/test_api_forms.py): ValueError naming it, never IndexError (the step API and
    the single-head form added axes to them)."""
    good = make(np.random.default_rng(0))
    for name in [n for n in good if n not in ("state", "beta", "alpha", "g")]:
        for scalar in (0.5, np.float64(0.5), np.array(0.5)):
            bad = dict(good, **{name: scalar})
            with pytest.raises((ValueError, TypeError)) as info:
                _call(kind, bad, do=np.ones(np.shape(good.get("v"))))
            assert name in str(info.value), (name, str(info.value))


@pytest.mark.parametrize("kind", ["forward", "backward", "step"])
@pytest.mark.parametrize("normalize_qk", [False, True])
@pytest.mark.parametrize("gate", ["alpha", "g", "per_key"])
def test_no_key_channels_is_refused_by_name(kind, normalize_qk, gate):
    """Dk = 0 on every path: ValueError naming q (and k), not an IndexError from inside."""
    rng = np.random.default_rng(1)
    good = (_step if kind == "step" else _seq)(rng, Dk=0)
    good["normalize_qk"] = normalize_qk
    a = good.pop("alpha")
    if gate == "per_key":
        good["alpha"] = np.ones(a.shape + (0,))
    else:
        good[gate] = a if gate == "alpha" else np.log(a)
    with pytest.raises(ValueError, match="Dk >= 1") as info:
        _call(kind, good)
    assert "q" in str(info.value)


def test_results_print_compactly():
    """Gradients and step results show shapes and dtypes, not every number."""
    rng = np.random.default_rng(2)
    kw = _seq(rng, B=2, T=64, H=4, Dk=32, Dv=32)
    grads = _call("backward", kw)
    text = repr(grads)
    assert len(text) < 600, text
    assert "dq=array(shape=[2, 64, 4, 32], dtype=float64)" in text
    assert text.startswith("GatedDeltaRuleGrads(")
    o, S = step = _call("step", _step(rng))           # still unpacks as a pair
    assert "StepResult(o=array(shape=[2, 2, 3]" in repr(step) and step.state is S
    assert np.array_equal(grads.dq, grads[0])


def test_shared_constants_reach_the_kernels():
    """The C build's L2 epsilon is _constants.L2_EPS: normalize_qk matches the reference, which
    reads the same constant, on inputs where the epsilon dominates (tiny q, k)."""
    assert _core.L2_EPS == _constants.L2_EPS
    rng = np.random.default_rng(3)
    kw = _seq(rng, Dk=8)
    kw["q"] = kw["q"] * 1e-4
    kw["k"] = kw["k"] * 1e-4
    o, S = gdn_ext.gated_delta_rule(**kw, normalize_qk=True)
    o_ref, S_ref = reference.gated_delta_rule(**kw, normalize_qk=True)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-14)


def _source_copy(tmp_path):
    """The repository's Python sources without any compiled module: a fresh source checkout."""
    dst = tmp_path / "src"
    shutil.copytree(ROOT / "gdn_ext", dst / "gdn_ext",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return dst


def test_reference_imports_without_the_compiled_module(tmp_path):
    """The oracle loads and computes when the kernels are missing; the kernels' names raise an
    ImportError saying how to build, not a circular-import message."""
    src = _source_copy(tmp_path)
    # as in a checkout where gdn_ext is not installed: no editable-install finder
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
            "import numpy as np, gdn_ext.reference as r\n"
            "rng = np.random.default_rng(0)\n"
            "q = rng.standard_normal((1, 3, 2))\n"
            "o, S = r.gated_delta_rule(q, q, q, beta=np.ones((1, 3)), alpha=np.ones((1, 3)))\n"
            "print(o.shape)\n"
            "try:\n"
            "    from gdn_ext import gated_delta_rule\n"
            "except ImportError as e:\n"
            "    print('IMPORTERROR', e)\n"
            "for mod in ('gdn_ext.layer', 'gdn_ext.recurrence', 'gdn_ext.ufuncs'):\n"
            "    try:\n"
            "        __import__(mod)\n"
            "    except ImportError as e:\n"
            "        print(mod, 'pip install -e .' in str(e))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(src)))
    assert out.returncode == 0, out.stderr
    assert "(1, 3, 2)" in out.stdout
    assert "IMPORTERROR" in out.stdout and "pip install -e ." in out.stdout
    assert "circular" not in out.stdout
    for mod in ("gdn_ext.layer", "gdn_ext.recurrence", "gdn_ext.ufuncs"):
        assert f"{mod} True" in out.stdout, out.stdout


def _cli(*args):
    return run_python(None, args=["-m", "gdn_ext", *args])


def test_command_line_lists_commands_and_suggests():
    out = _cli("--help")
    assert out.returncode == 0
    usage = out.stdout.splitlines()[0]
    for cmd in ("check", "demo", "bench", "train"):
        assert cmd in usage
    out = _cli("benhc")
    assert out.returncode == 2 and "did you mean 'bench'" in out.stderr
    out = _cli("demo", "--help")
    assert out.returncode == 0 and "python -m gdn_ext demo" in out.stdout


def test_library_and_applications_apart():
    """No module of the library imports an application; each file opens with what it holds."""
    lib = [p for p in (ROOT / "gdn_ext").rglob("*.py") if "apps" not in p.parts]
    for p in lib:
        text = p.read_text()
        assert "apps" not in "".join(line for line in text.splitlines()
                                     if line.lstrip().startswith(("import ", "from "))), p
    for p in (ROOT / "gdn_ext").rglob("*.py"):
        assert p.read_text().lstrip().startswith('"""'), f"{p} has no opening docstring"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_openmp_probe_uses_the_users_flags(monkeypatch):
    """A coverage build (CFLAGS / LDFLAGS=--coverage) keeps OpenMP: the probe links with the
    user's flags, so it does not fail for a missing runtime and turn OpenMP off."""
    sys.path.insert(0, str(ROOT))
    try:
        import setup as build
    finally:
        sys.path.remove(str(ROOT))
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.sysconfig import customize_compiler
    monkeypatch.setenv("CFLAGS", "--coverage")
    monkeypatch.setenv("LDFLAGS", "--coverage")
    monkeypatch.delenv("GDN_EXT_NO_OPENMP", raising=False)
    cc = new_compiler()
    customize_compiler(cc)
    assert build.openmp_flags(cc) is not None
    assert build.shared_constants()["L2_EPS"] == _constants.L2_EPS


CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")


@pytest.mark.skipif(CROSS is None or QEMU is None,
                    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: "
                           "gcc-aarch64-linux-gnu qemu-user libc6-dev-arm64-cross)")
def test_aarch64_build_uses_neon_and_is_right(tmp_path):
    """Cross-compiled for arm64 as setup.py compiles it, the portable kernels use NEON vector
    multiply-adds (GCC vector extensions), and run right under the emulator."""
    flags = ["-O3", "-std=c11", "-ffp-contract=fast", "-fopenmp-simd", "-DGDN_OPENMP_SIMD",
             f"-DGDN_L2_EPS={_constants.L2_EPS!r}", "-I", str(ROOT / "csrc")]
    srcs = [str(ROOT / "csrc" / f) for f in ("gdn_kernels.c", "gdn_kernels_avx2.c",
                                             "gdn_kernels_avx512.c")]
    asm = tmp_path / "k.s"
    subprocess.run([CROSS, *flags, "-S", srcs[0], "-o", str(asm)], check=True)
    text = asm.read_text()
    assert text.count("fmla\tv") > 50, "no NEON vector multiply-adds in the portable kernels"
    # (the driver at -O1: GCC 12's aarch64 vectoriser has an internal error on its naive loop)
    drv = tmp_path / "drv.o"
    subprocess.run([CROSS, "-O1", "-std=c11", f"-DGDN_L2_EPS={_constants.L2_EPS!r}", "-I",
                    str(ROOT / "csrc"), "-c", str(ROOT / "tests" / "native" / "forward_check.c"),
                    "-o", str(drv)], check=True)
    exe = tmp_path / "check"
    subprocess.run([CROSS, *flags, str(drv), *srcs, "-lm", "-static", "-o", str(exe)], check=True)
    out = subprocess.run([QEMU, str(exe)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "isa generic" in out.stdout


def test_small_public_helpers_check_their_arguments():
    for bad, exc in ((-1, ValueError), (1.5, TypeError), ("7", TypeError), (True, TypeError),
                     (10**30, ValueError)):
        for fn in (gdn_ext.checkpoint_count, gdn_ext.checkpoint_interval):
            with pytest.raises(exc, match="T must"):
                fn(bad)
    assert gdn_ext.checkpoint_count(np.int64(100)) == 10
    with pytest.raises(ValueError, match="x must be an array"):
        gdn_ext.rmsnorm(1.0, 1.0)
    with pytest.raises(ValueError, match=r"weight must have shape \[D\] = \[3\]"):
        gdn_ext.rmsnorm(np.ones((2, 3)), np.ones(4))
    with pytest.raises(ValueError, match="x must be an array"):
        gdn_ext.l2norm(2.0)
    with pytest.raises(TypeError, match="cu_seqlens must be an integer array"):
        gdn_ext.gated_delta_rule(**_seq(np.random.default_rng(0), B=1), cu_seqlens=[0, [1], 5])
    with pytest.raises(TypeError, match="cu_seqlens must be an integer array"):
        gdn_ext.gated_delta_rule(**_seq(np.random.default_rng(0), B=1), cu_seqlens="05")


def test_layer_gradients_print_compactly():
    p = gdn_ext.GatedDeltaNetParams.init(16, 8, 8, n_heads=2, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    y, S = gdn_ext.gated_deltanet_forward(x, None, p)
    grads = gdn_ext.layer.gated_deltanet_backward(np.ones_like(y), x, None, p)
    dx, dS, dparams = grads
    assert repr(grads).startswith("LayerGrads(dx=array(shape=[2, 5, 16], dtype=float64)")
    assert len(repr(grads)) < 400


@pytest.mark.parametrize("args", [["demo", "--seq-len", "0"], ["demo", "--heads", "0"],
                                  ["demo", "--threads", "0"], ["check", "--seed", "-1"]])
def test_commands_refuse_bad_options(args):
    out = _cli(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
