"""Beyond one process: gdn_ext.dask (bitwise equal to one NumPy call on every scheduler),
gdn_ext.threads(n), pickling, and torch DistributedDataParallel (gloo, 2 processes)."""
import os
import pickle
import sys
import threading
import warnings

import numpy as np
import pytest

import gdn_ext
from gdn_ext import ufuncs

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
import gdn_ext.dask as gd  # noqa: E402


def _inputs(rng, B=4, T=20, H=2, G=2, Dk=5, Dv=3, dtype=np.float32, per_key=False):
    HV = H * G
    k = rng.standard_normal((B, T, H, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)   # unit keys: beta ||k||^2 <= 1
    x = dict(q=rng.standard_normal((B, T, H, Dk)), k=k,
             v=rng.standard_normal((B, T, HV, Dv)), beta=rng.uniform(0, 1, (B, T, HV)),
             g=np.log(rng.uniform(0.5, 1, (B, T, HV, Dk) if per_key else (B, T, HV))),
             initial_state=rng.standard_normal((B, HV, Dv, Dk)))
    return {n: a.astype(dtype) for n, a in x.items()}, G


def _chunked(x, G, b=2, h=1):
    """Chunks of b sequences and h query/key heads (h G value heads)."""
    c = {}
    for n, a in x.items():
        if n in ("q", "k"):
            chunks = (b, -1, h, -1)
        elif n == "initial_state":
            chunks = (b, h * G, -1, -1)
        else:
            chunks = (b, -1, h * G) + (-1,) * (a.ndim - 3)
        c[n] = da.from_array(a, chunks=chunks)
    return c


def _split(x):
    kw = dict(x)
    return (kw.pop("q"), kw.pop("k"), kw.pop("v")), kw


SCHEDULERS = ["sync", "threads"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_dask_equals_one_numpy_call(dtype, per_key, scheduler):
    """Forward and backward, grouped heads (G = 2), q/k normalisation, a Python-float scale
    (float32 stays float32): bitwise equal to one NumPy call."""
    x, G = _inputs(np.random.default_rng(0), dtype=dtype, per_key=per_key)
    args, kw = _split(x)
    opts = dict(scale=0.5, normalize_qk=True)
    o, S = gdn_ext.gated_delta_rule(*args, **kw, **opts)
    grads = gdn_ext.gated_delta_rule_backward(o, *args, **kw, **opts)
    cargs, ckw = _split(_chunked(x, G))
    o_d, S_d = gd.gated_delta_rule(*cargs, **ckw, **opts, num_threads=2)
    assert o_d.dtype == dtype and S_d.dtype == dtype           # chosen up front, as computed
    do = da.from_array(o, chunks=cargs[2].chunks)
    g_d = gd.gated_delta_rule_backward(do, *cargs, **ckw, **opts)
    with dask.config.set(scheduler=scheduler):
        got = dask.compute(o_d, S_d, *g_d)
    for a, b in zip(got, (o, S) + tuple(grads)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert type(g_d).__name__ == "GatedDeltaRuleGradsG"


def test_dask_on_a_process_cluster():
    distributed = pytest.importorskip("distributed")
    x, G = _inputs(np.random.default_rng(1))
    args, kw = _split(x)
    o, S = gdn_ext.gated_delta_rule(*args, **kw)
    cargs, ckw = _split(_chunked(x, G))
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        o_d, S_d = client.compute(gd.gated_delta_rule(*cargs, **ckw), sync=True)
    np.testing.assert_array_equal(o_d, o)
    np.testing.assert_array_equal(S_d, S)


def test_dask_rule_family_and_no_state():
    x, G = _inputs(np.random.default_rng(2), dtype=np.float64)
    x.pop("initial_state")
    args, kw = _split(x)
    o, S = gdn_ext.gated_delta_rule(*args, **kw, delta_rule=False)
    cargs, ckw = _split(_chunked(x, G))
    o_d, S_d = dask.compute(*gd.gated_delta_rule(*cargs, **ckw, delta_rule=False))
    np.testing.assert_array_equal(o_d, o)
    np.testing.assert_array_equal(S_d, S)


def test_dask_refuses_bad_chunks():
    x, G = _inputs(np.random.default_rng(3))
    c = _chunked(x, G)
    args, kw = _split(c)
    with pytest.raises(ValueError, match=r"q is chunked along axis 1 \(T\)"):
        gd.gated_delta_rule(args[0].rechunk({1: 5}), *args[1:], **kw)
    bad_v = da.from_array(x["v"], chunks=(2, -1, 1, -1))       # half a group per chunk
    with pytest.raises(ValueError, match="whole groups"):
        gd.gated_delta_rule(args[0], args[1], bad_v, **kw)
    with pytest.raises(ValueError, match="exactly one of alpha"):
        gd.gated_delta_rule(*args, beta=kw["beta"])
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, HV\]"):
        gd.gated_delta_rule(*args, beta=kw["beta"][:, :, :2], g=kw["g"])


SHAPE_ERRORS = {                  # name -> a wrong shape (the rest as _inputs makes them)
    "k": (4, 20, 2, 4), "v": (4, 19, 4, 3), "beta": (4, 20, 3), "g": (4, 20, 4, 4),
    "initial_state": (4, 4, 3, 6),
}


@pytest.mark.parametrize("name", sorted(SHAPE_ERRORS))
@pytest.mark.parametrize("lazy", [False, True])
def test_dask_shape_errors_are_the_numpy_apis(name, lazy):
    """One set of shape rules: gdn_ext.dask raises the NumPy API's error, word for word, for
    dask and NumPy arguments alike."""
    x, G = _inputs(np.random.default_rng(4))
    x[name] = np.zeros(SHAPE_ERRORS[name], np.float32)
    c = _chunked(x, G) if lazy else x
    (q, k, v), kw = _split(x)
    with pytest.raises(ValueError) as want:
        gdn_ext.gated_delta_rule(q, k, v, **kw)
    (q, k, v), kw = _split(c)
    with pytest.raises(ValueError) as got:
        gd.gated_delta_rule(q, k, v, **kw)
    assert str(got.value) == str(want.value)


def test_threads_context_manager():
    """threads(n) sets the count for calls in its block, in this thread only; num_threads= and
    an inner threads() win; the previous value comes back, also after an error."""
    from gdn_ext._threads import thread_count
    assert thread_count(None) == 0
    seen = {}
    with gdn_ext.threads(3):
        assert thread_count(None) == 3
        assert thread_count(2) == 2
        with gdn_ext.threads(1):
            assert thread_count(None) == 1
        with gdn_ext.threads(None):
            assert thread_count(None) == 0
        t = threading.Thread(target=lambda: seen.setdefault("other", thread_count(None)))
        t.start()
        t.join()
        assert thread_count(None) == 3
    assert seen["other"] == 0
    with pytest.raises(RuntimeError):
        with gdn_ext.threads(2):
            raise RuntimeError
    assert thread_count(None) == 0
    with pytest.raises(ValueError):
        with gdn_ext.threads(0):
            pass
    # the results do not depend on it
    x, _ = _inputs(np.random.default_rng(4), B=8, T=64)
    args, kw = _split(x)
    with gdn_ext.threads(1):
        o1, _ = gdn_ext.gated_delta_rule(*args, **kw)
    o2, _ = gdn_ext.gated_delta_rule(*args, **kw)
    np.testing.assert_array_equal(o1, o2)


def test_pickling_round_trips():
    for name in ufuncs.__all__:
        assert pickle.loads(pickle.dumps(getattr(ufuncs, name))) is getattr(ufuncs, name)
    p = gdn_ext.GatedDeltaNetParams.init(8, 4, 4, n_heads=2)
    p2 = pickle.loads(pickle.dumps(p))
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(p, p2))
    x, _ = _inputs(np.random.default_rng(5), dtype=np.float64)
    args, kw = _split(x)
    o, S = gdn_ext.gated_delta_rule(*args, **kw)
    for grads in (gdn_ext.gated_delta_rule_backward(o, *args, **kw),
                  gdn_ext.layer.gated_deltanet_backward(np.ones((2, 3, 8)),
                                                         np.ones((2, 3, 8)), None, p),
                  gdn_ext.gated_delta_rule_step(args[0][:, 0], args[1][:, 0], args[2][:, 0],
                                                beta=kw["beta"][:, 0], g=kw["g"][:, 0],
                                                state=None)):
        back = pickle.loads(pickle.dumps(grads))
        assert type(back) is type(grads) and back._fields == grads._fields


# ---- torch DistributedDataParallel ---------------------------------------------------------------

DDP = r"""
import os, sys
import torch, torch.distributed as dist
import gdn_ext.torch as gt

def model_and_data():
    torch.manual_seed(0)
    layer = gt.GatedDeltaNet(16, 2, 2, 4, 4).double()
    x = torch.randn(4, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return layer, x

def grads(layer, x):
    layer.zero_grad()
    y, _ = layer(x)
    (y.square().mean()).backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}

def worker(rank, world, path):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    layer, x = model_and_data()
    ddp = torch.nn.parallel.DistributedDataParallel(layer)
    half = x.shape[0] // world
    ddp.zero_grad()
    y, _ = ddp(x[rank * half:(rank + 1) * half])
    (y.square().mean()).backward()              # DDP averages the two halves' gradients
    if rank == 0:
        whole = grads(model_and_data()[0], x)
        err = max(float((p.grad - whole[n]).abs().max() / whole[n].abs().max().clamp_min(1e-30))
                  for n, p in layer.named_parameters())
        print("max relative difference", err, flush=True)
    dist.barrier()                              # both ranks done before the group goes away
    dist.destroy_process_group()
    sys.stdout.flush()
    # skip interpreter teardown: in fresh environments a rank sometimes aborted there
    # ("terminate called without an active exception", gloo's threads), after the work was done
    os._exit(0)

if __name__ == "__main__":
    import tempfile
    path = os.path.join(tempfile.mkdtemp(), "rendezvous")
    torch.multiprocessing.spawn(worker, args=(2, path), nprocs=2, join=True)
"""


def test_ddp_two_processes_equal_one(tmp_path):
    """Two processes, half the batch each (gloo): DDP's averaged gradients equal one process's
    on the whole batch."""
    pytest.importorskip("torch")
    from helpers import run_python
    script = tmp_path / "ddp.py"                 # spawn re-imports the worker from a file
    script.write_text(DDP)
    out = run_python(None, args=[str(script)], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    err = float(out.stdout.split("max relative difference")[1])
    assert err < 1e-12, out.stdout


def test_ondisk_example_runs():
    """The README's worked example (python -m gdn_ext ondisk), small: zarr in, zarr out, the
    first chunk equal to one NumPy call."""
    pytest.importorskip("zarr")
    from helpers import run_python
    out = run_python(None, args=["-m", "gdn_ext", "ondisk", "--batch", "12", "--seq-len", "40",
                                 "--heads", "2", "--head-dim", "8", "--chunk", "5"], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "largest difference 0.0e+00" in out.stdout


def _readme_dask_recipe():
    """The dask recipe of the user guide's scaling page (skipped where docs/ is not shipped,
    as in the sdist)."""
    import pathlib
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "scaling.md"
    if not page.exists():
        pytest.skip("docs/ is not shipped with the sdist")
    text = page.read_text()
    start = text.index("```python\nimport dask.array as da, gdn_ext.dask as gd")
    return text[start:].split("\n", 1)[1].split("```", 1)[0]


def test_readme_dask_recipe_runs_as_written(tmp_path, monkeypatch):
    """The recipe runs, and its inputs are ones gdn_ext does not warn about (gdn_ext.dask checks
    the values of each chunk when it is computed)."""
    pytest.importorskip("zarr")
    code = _readme_dask_recipe()
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="README")
        warnings.filterwarnings("error", message=".*check_values=False")
        exec(compile(code, "README.md", "exec"), {"__name__": "README"})
    assert (tmp_path / "o.zarr").exists()
    # the same recipe fed beta in [-1, 0] (as it once did) warns, at the recipe's line
    bad = code.replace('"beta": (0, 1)', '"beta": (-1, 0)')
    assert bad != code
    with pytest.warns(UserWarning, match=r"beta has values outside \[0, 2\] in a dask chunk") as w:
        exec(compile(bad, "README.md", "exec"), {"__name__": "README"})
    assert any(r.filename == "README.md" and "beta has values" in str(r.message) for r in w)


def test_numpy_inputs_join_chunked_dask_ones():
    """NumPy gates, state and do next to chunked q, k, v take their chunks: same numbers."""
    x, G = _inputs(np.random.default_rng(6), dtype=np.float64)
    args, kw = _split(x)
    o, S = gdn_ext.gated_delta_rule(*args, **kw)
    qc = da.from_array(x["q"], chunks=(2, -1, 1, -1))
    kc = da.from_array(x["k"], chunks=(2, -1, 1, -1))
    o_d, S_d = dask.compute(*gd.gated_delta_rule(qc, kc, x["v"], **kw))
    np.testing.assert_array_equal(o_d, o)
    g = gdn_ext.gated_delta_rule_backward(o, *args, **kw)
    g_d = dask.compute(*gd.gated_delta_rule_backward(o, qc, kc, x["v"], **kw))
    for a, b in zip(g_d, g):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="casts safely"):
        gd.gated_delta_rule(x["q"].astype(np.longdouble), *args[1:], **kw)


def test_threads_object_is_reusable_and_checked_when_made():
    from gdn_ext._threads import thread_count
    cm = gdn_ext.threads(2)
    with cm:
        with cm:
            assert thread_count(None) == 2
        assert thread_count(None) == 2
    with cm:
        assert thread_count(None) == 2
    assert thread_count(None) == 0
    with pytest.raises(ValueError):
        gdn_ext.threads(0)
