"""Shared input generators and comparisons for the tests."""
import numpy as np

from gdn_ext.apps.check import central_differences  # noqa: F401  (the tests' finite differences)

ARGS = ("q", "k", "v", "beta", "alpha", "initial_state")


def warns_unstable():
    """pytest.warns for the value check's warning that beta ||k||^2 exceeds 2 (the delta rule's
    stable range): for tests whose inputs are meant to lie outside it."""
    import pytest
    return pytest.warns(UserWarning, match=r"beta \* \|\|k\|\|\^2 is above 2")


def make_inputs(rng, B=2, T=16, H=3, Dk=8, Dv=6, dtype=np.float64, single_head=False,
                unit_keys=True, gate="alpha"):
    """Random well-scaled inputs as a dict of keyword arguments (q, k, v positional by name).

    Keys are unit-norm (as in the paper's layer), so 1 - beta |k|^2 stays in [0, 1]."""
    heads = () if single_head else (H,)
    q = rng.standard_normal((B, T) + heads + (Dk,))
    k = rng.standard_normal((B, T) + heads + (Dk,))
    if unit_keys:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    else:
        k *= 0.5 / np.sqrt(Dk)
    v = rng.standard_normal((B, T) + heads + (Dv,))
    beta = rng.uniform(0.05, 0.95, (B, T) + heads)
    alpha = rng.uniform(0.5, 1.0, (B, T) + heads)
    S0 = rng.standard_normal((B,) + heads + (Dv, Dk))
    out = dict(q=q, k=k, v=v, beta=beta, initial_state=S0)
    if gate == "alpha":
        out["alpha"] = alpha
    else:
        out["g"] = np.log(alpha)
    return {n: (a.astype(dtype) if isinstance(a, np.ndarray) else a) for n, a in out.items()}


def split(inputs):
    """(q, k, v) positional and the rest as keywords."""
    kw = dict(inputs)
    return (kw.pop("q"), kw.pop("k"), kw.pop("v")), kw


def split_in_time(inputs, cut):
    """The inputs of steps [0, cut) (with the initial state) and of [cut, T) (without it: the
    caller carries the state over)."""
    first = {n: (a if n == "initial_state" else a[:, :cut]) for n, a in inputs.items()}
    second = {n: a[:, cut:] for n, a in inputs.items() if n != "initial_state"}
    return first, second


def assert_rel_close(actual, desired, rtol, name=""):
    """max |actual - desired| <= rtol * max |desired| (relative to the array's scale)."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    assert actual.shape == desired.shape, f"{name}: shape {actual.shape} != {desired.shape}"
    scale = max(np.max(np.abs(desired)), 1e-300) if desired.size else 1.0
    err = np.max(np.abs(actual.astype(np.float64) - desired)) if desired.size else 0.0
    assert err <= rtol * scale, f"{name}: max abs error {err:.3e} > {rtol:.1e} * {scale:.3e}"


def run_python(code, env=None, **kwargs):
    """``python -c code`` in a fresh process that imports the same gdn_ext as this one (the
    repository's, an installed wheel's or an unpacked sdist's), with tests/ importable; the
    working directory is tests/, so no other source folder shadows it."""
    import os
    import subprocess
    import sys

    import gdn_ext
    tests = os.path.dirname(os.path.abspath(__file__))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(gdn_ext.__file__)))
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([package_root, tests] + [
        p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if os.name == "posix":
        kwargs.setdefault("preexec_fn", _sigint_default)
    return subprocess.run([sys.executable, *kwargs.pop("args", ["-c", code])], env=env,
                          capture_output=True, text=True, cwd=tests, **kwargs)


def _sigint_default():
    """SIGINT's default disposition in a child (before exec), so that Python installs its Ctrl-C
    handler there: a suite started from a background job (nohup, `cmd &` in a script) has SIGINT
    ignored, children inherit that, and the tests that send SIGINT to a child saw no interrupt."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
