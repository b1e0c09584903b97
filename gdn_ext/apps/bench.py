"""``python -m gdn_ext bench``: gdn_ext's speed next to its peers, in one process, on the same inputs
and the same number of threads.

Rows (median of ``--repeat`` runs after one warm-up; a run repeats a short call until 2 ms have
passed, and rows whose runs lie more than 1.5 x apart are marked noisy):
- gdn_ext forward, backward and forward + backward, float32 and float64, for every variant of the
  kernels (scalar gate; per-key gate; grouped value heads; packed sequences; q/k normalisation);
- the reference loop written in PyTorch (torch ops per step), forward and autograd backward;
- transformers' ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` (when
  transformers is installed), forward and forward + backward through autograd;
- ``gdn_ext.reference`` (NumPy loop) on a shorter sequence;
- NumPy's matrix product, 1024^3, same dtype and threads: the practical ceiling of the machine's
  multiply-add units.

GFLOP/s counts the forward's 7 * Dk * Dv floating-point operations per token and value head for
every row (backward rows included), so it is a rate of useful work that compares across rows; the
matmul row counts 2 n^3. The last two columns are each row's time per token divided by gdn_ext's
forward (resp. forward + backward) time per token: how many times slower than gdn_ext it is.
A padded batch (real tokens in the first twentieth of each row, then q = k = v = 0, the state
decaying under the gate into the subnormal range) against ordinary inputs of the same shape,
forward and backward, both dtypes, one thread: the ratio shows that subnormal numbers cost no
cliff. Then: backward peak extra memory against PyTorch autograd's, sweeps over T (cost must grow
linearly), Dk = Dv and threads, and one decode step against a full call's per-token time.
``--json FILE`` writes every number, ``--plot FILE.png`` draws them. ``--padded`` runs only the
padded-batch row, ``--scaling 1 2 4 8 16`` only a thread-scaling measurement (parallel efficiency
= speed-up / threads; use ``--repeat`` 5 or more, single runs on a shared machine are noise).
"""
import gc
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc

import numpy as np

import gdn_ext
from gdn_ext import _core, reference
from gdn_ext._threads import busy_cap, default_threads, raw_ufunc_threads
from . import _cli
from ._cli import positive_int

__all__ = ["build_parser", "main", "run"]


class Seconds(float):
    """A median time with its spread: ``spread`` = slowest / fastest of the runs (1.0 for one
    run); ``runs`` how many were timed."""
    spread = 1.0
    runs = 1


NOISY = 1.5   # a row whose runs spread more than this (slowest / fastest) is marked as noise
MIN_SAMPLE_S = 2e-3   # each timed run repeats the call until this much time has passed


def _timeit(fn, repeat):
    """The median over ``repeat`` timed runs after one warm-up, as a :class:`Seconds`. A call
    shorter than MIN_SAMPLE_S is repeated within a run (the run's time per call counts), so that
    tiny sizes are not single-call timer noise."""
    t0 = time.perf_counter()
    fn()                                               # warm-up (and how long one call takes)
    first = time.perf_counter() - t0
    inner = max(1, min(1000, int(MIN_SAMPLE_S / max(first, 1e-9))))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    out = Seconds(statistics.median(times))
    out.spread, out.runs = max(times) / min(times), len(times)
    return out


def _inputs(B, T, H, D, dtype, seed=0, HV=None, per_key=False):
    rng = np.random.default_rng(seed)
    HV = H if HV is None else HV
    q = rng.standard_normal((B, T, H, D)).astype(dtype)
    k = rng.standard_normal((B, T, H, D))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = rng.standard_normal((B, T, HV, D)).astype(dtype)
    beta = rng.uniform(0.1, 0.9, (B, T, HV)).astype(dtype)
    g_shape = (B, T, HV, D) if per_key else (B, T, HV)
    g = np.log(rng.uniform(0.9, 1.0, g_shape)).astype(dtype)
    return dict(q=q, k=k, v=v, beta=beta, g=g)


def _gdn_calls(x, threads, **kw):
    args = (x["q"], x["k"], x["v"])
    rest = dict(beta=x["beta"], g=x["g"], num_threads=threads, **kw)
    o, _ = gdn_ext.gated_delta_rule(*args, **rest)
    do = np.ones_like(o)

    def fwd():
        return gdn_ext.gated_delta_rule(*args, **rest)

    def bwd():
        return gdn_ext.gated_delta_rule_backward(do, *args, **rest)

    def both():
        fwd()
        bwd()
    return fwd, bwd, both


class Table:
    """Rows of (name, seconds, tokens) with their derived rates."""

    def __init__(self, flops_per_token):
        self.rows = []
        self.flops_per_token = flops_per_token

    def add(self, group, name, seconds, tokens, flops=None, peak=None):
        """peak: the multiply-add ceiling (GFLOP/s) of the threads the row ran on, if it is a
        gdn_ext kernel row; its "x peak" column is then GFLOP/s / peak."""
        flops = self.flops_per_token * tokens if flops is None else flops
        gflops = flops / seconds / 1e9
        spread = getattr(seconds, "spread", 1.0)
        self.rows.append(dict(group=group, name=name, seconds=float(seconds), tokens=tokens,
                              tokens_per_s=tokens / seconds, gflops=gflops,
                              fraction_of_peak=None if peak is None else gflops / peak,
                              runs=getattr(seconds, "runs", 1), spread=spread,
                              noisy=spread > NOISY))
        return self.rows[-1]


def _torch_rows(table, x, threads, repeat, torch_T):
    """The reference loop in torch and transformers' fallbacks, same inputs (first torch_T)."""
    try:
        import torch
    except ImportError:
        return
    import gdn_ext.torch as gt
    torch.set_num_threads(threads)
    dt = x["q"].dtype
    T = min(torch_T, x["q"].shape[1])
    B = x["q"].shape[0]
    t = {n: torch.from_numpy(np.ascontiguousarray(a[:, :T])) for n, a in x.items()}
    name = np.dtype(dt).name

    def loop_fwd():
        with torch.no_grad():
            gt.reference_gated_delta_rule(t["q"], t["k"], t["v"], beta=t["beta"], g=t["g"])

    def loop_both():
        leaves = {n: a.clone().requires_grad_() for n, a in t.items()}
        o, S = gt.reference_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"],
                                             beta=leaves["beta"], g=leaves["g"])
        o.sum().backward()

    table.add("torch loop", f"reference loop in torch, forward ({name}, T={T})",
              _timeit(loop_fwd, max(1, repeat // 2)), B * T)
    table.add("torch loop", f"reference loop in torch, fwd+bwd ({name}, T={T})",
              _timeit(loop_both, max(1, repeat // 2)), B * T)
    try:
        import transformers.models.qwen3_next.modeling_qwen3_next as q3
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except ImportError:
        return
    for label, fn in (("chunk", q3.torch_chunk_gated_delta_rule),
                      ("recurrent", q3.torch_recurrent_gated_delta_rule)):
        # (transformers scales q by Dk^-0.5 itself: the same work as gdn_ext's scale)
        def f_fwd(fn=fn):
            with torch.no_grad():
                fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"])

        def f_both(fn=fn):
            leaves = {n: a.clone().requires_grad_() for n, a in t.items()}
            o, _ = fn(leaves["q"], leaves["k"], leaves["v"], g=leaves["g"], beta=leaves["beta"])
            o.sum().backward()
        reps = max(1, repeat // 2) if label == "recurrent" else repeat
        table.add("transformers", f"transformers torch_{label}_gated_delta_rule, forward "
                  f"({name}, T={T})", _timeit(f_fwd, reps), B * T)
        table.add("transformers", f"transformers torch_{label}_gated_delta_rule, fwd+bwd "
                  f"({name}, T={T})", _timeit(f_both, reps), B * T)


def _matmul_gflops(dtype, threads, repeat, n=1024):
    from threadpoolctl import threadpool_limits
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    b = a.T.copy()
    with threadpool_limits(limits=threads, user_api="blas"):
        t = _timeit(lambda: a @ b, repeat)
    return 2 * n ** 3 / t / 1e9


def _backward_memory(B, T, H, D, threads):
    """Peak extra bytes of gdn_ext's backward (tracemalloc, the gradients themselves excluded)
    and the bytes PyTorch autograd saves for the backward of the torch loop and of transformers'
    chunk fallback (saved-tensor hooks), float32."""
    x = _inputs(B, T, H, D, np.float32, seed=1)
    args = (x["q"], x["k"], x["v"])
    o, _ = gdn_ext.gated_delta_rule(*args, beta=x["beta"], g=x["g"], num_threads=threads)
    do = np.ones_like(o)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grads = gdn_ext.gated_delta_rule_backward(do, *args, beta=x["beta"], g=x["g"],
                                                  num_threads=threads)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    out = {"T": T, "gdn_ext_backward_extra_bytes": peak - sum(g.nbytes for g in grads)}
    try:
        import torch
        import gdn_ext.torch as gt
    except ImportError:
        return out

    def saved_bytes(run):
        """Bytes autograd would keep for the backward; counted, not kept (the pack hook returns
        a placeholder, so a 16 GiB graph never sits in memory)."""
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None):
            run()
        return total[0]
    t = {n: torch.from_numpy(a).requires_grad_() for n, a in x.items()}
    out["torch_loop_saved_bytes"] = saved_bytes(lambda: gt.reference_gated_delta_rule(
        t["q"], t["k"], t["v"], beta=t["beta"], g=t["g"]))
    try:
        import transformers.models.qwen3_next.modeling_qwen3_next as q3
        out["transformers_chunk_saved_bytes"] = saved_bytes(lambda: q3.torch_chunk_gated_delta_rule(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"]))
    except ImportError:
        pass
    return out


def thread_scaling(B=4, T=2048, H=16, D=128, thread_counts=(1, 2, 4, 8, 16), repeat=5, log=print):
    """Forward and backward time (float32) of one shape for each thread count: the OpenMP loop's
    parallel efficiency, speed-up / threads."""
    x = _inputs(B, T, H, D, np.float32)
    # the kernels' own loop: the raw gufuncs over B*H (sequence, head) pairs in one call, on
    # [B*H, T, D] inputs with preallocated outputs (no page faults of fresh output arrays)
    kx = {n: np.ascontiguousarray(np.moveaxis(a, 2, 1)).reshape((B * H, T) + a.shape[3:])
          for n, a in x.items()}
    alpha = np.exp(kx["g"])
    S0 = np.zeros((B * H, D, D), np.float32)
    o, S_T = np.empty((B * H, T, D), np.float32), np.empty_like(S0)
    grads = [np.empty_like(kx["q"]), np.empty_like(kx["k"]), np.empty_like(kx["v"]),
             np.empty_like(alpha), np.empty_like(alpha), np.empty_like(S0)]
    from .. import ufuncs

    def kernel_fwd():
        ufuncs.gated_delta_rule_fwd(kx["q"], kx["k"], kx["v"], alpha, kx["beta"], S0, 1.0,
                                    out=(o, S_T))

    def kernel_bwd():
        ufuncs.gated_delta_rule_bwd(o, kx["q"], kx["k"], kx["v"], alpha, kx["beta"], S0, S0, 1.0,
                                    out=tuple(grads))
    rows, base = [], {}
    log(f"thread scaling: B={B} T={T} H={H} Dk=Dv={D} float32 (B*H = {B * H} pairs), kernels "
        f"{_core.isa()}, {os.cpu_count()} CPUs; 'kernel' = the raw gufunc's OpenMP loop, 'api' = "
        f"gated_delta_rule / _backward end to end; % = parallel efficiency (speed-up / threads)")
    for n in thread_counts:
        fwd, bwd, _ = _gdn_calls(x, n)
        with raw_ufunc_threads(n):
            times = dict(kernel_forward=_timeit(kernel_fwd, repeat),
                         kernel_backward=_timeit(kernel_bwd, max(1, repeat // 2)))
        times.update(api_forward=_timeit(fwd, repeat), api_backward=_timeit(bwd, max(1, repeat // 2)))
        row = dict(threads=n)
        for key, t in times.items():
            base.setdefault(key, t * thread_counts[0])
            row[key + "_s"] = t
            row[key + "_efficiency"] = base[key] / t / n
        row["kernel_forward_gflops"] = 7 * D * D * H * B * T / times["kernel_forward"] / 1e9
        rows.append(row)
        log(f"  {n:>3} threads: kernel forward {1e3 * times['kernel_forward']:8.1f} ms "
            f"({row['kernel_forward_gflops']:6.1f} GFLOP/s, {100 * row['kernel_forward_efficiency']:5.1f} %)"
            f", backward {1e3 * times['kernel_backward']:8.1f} ms "
            f"({100 * row['kernel_backward_efficiency']:5.1f} %); api forward "
            f"{100 * row['api_forward_efficiency']:5.1f} %, backward "
            f"{100 * row['api_backward_efficiency']:5.1f} %")
    return dict(shape=dict(B=B, T=T, H=H, Dk=D, Dv=D), isa=_core.isa(), cpus=os.cpu_count(),
                rows=rows)


def run(B=2, T=2048, H=4, D=128, threads=None, repeat=5, torch_T=None, numpy_T=128,
        sweep_T=(256, 1024, 4096, 16384), sweep_D=(64, 128, 256), memory_T=8192, quick=False,
        log=print):
    """Run every measurement; returns a dict (the --json content). Sizes are tokens per sequence
    (T), batch (B), heads (H), head width (Dk = Dv = D)."""
    threads = threads or default_threads()
    torch_T = T if torch_T is None else torch_T
    res = {"machine": dict(platform=platform.platform(), processor=platform.processor(),
                           cpus=os.cpu_count(), isa=_core.isa(), openmp=gdn_ext.openmp_enabled(),
                           numpy=np.__version__, gdn_ext=gdn_ext.__version__),
           "shape": dict(B=B, T=T, H=H, Dk=D, Dv=D), "threads": threads,
           "flop_convention": "7*Dk*Dv per token and value head (the forward's work), every row"}
    log(f"gdn_ext bench: B={B} T={T} H={H} Dk=Dv={D}, {threads} threads, kernels {_core.isa()}, "
        f"median of {repeat} runs of at least {MIN_SAMPLE_S * 1e3:g} ms each; rows whose runs "
        f"spread more than {NOISY} x are marked noisy")
    if quick:
        log("--quick: tiny sizes, a smoke test of the benchmark itself; its times say little of "
            "gdn_ext's speed at real sizes (run without --quick for that)")
    peak = {np.dtype(dt).name: {n: _core.fma_peak(dt == np.float64, n, 0.05 if quick else 0.3)
                                for n in sorted({1, threads})} for dt in (np.float32, np.float64)}
    res["fma_peak_gflops"] = peak
    log("multiply-add ceiling (this CPU, kernels' instruction set, independent FMA chains): "
        + ", ".join(f"{dt} {p[1]:.1f} GFLOP/s on 1 thread, {p[threads]:.1f} on {threads}"
                    for dt, p in peak.items()))
    tables = {}
    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        pk = peak[name]
        table = Table(7 * D * D * H)
        ceiling = _matmul_gflops(dt, threads, repeat)
        x = _inputs(B, T, H, D, dt)
        fwd, bwd, both = _gdn_calls(x, threads)
        t_f = table.add("gdn_ext", f"gdn_ext forward ({name})", _timeit(fwd, repeat), B * T,
                        peak=pk[threads])
        t_b = table.add("gdn_ext", f"gdn_ext backward ({name})", _timeit(bwd, repeat), B * T,
                        peak=pk[threads])
        t_fb = table.add("gdn_ext", f"gdn_ext fwd+bwd ({name})", _timeit(both, repeat), B * T,
                         peak=pk[threads])
        f1, b1, _ = _gdn_calls(x, 1)
        table.add("gdn_ext", f"gdn_ext forward, 1 thread ({name})", _timeit(f1, repeat), B * T,
                  peak=pk[1])
        table.add("gdn_ext", f"gdn_ext backward, 1 thread ({name})", _timeit(b1, repeat), B * T,
                  peak=pk[1])
        variants = {
            "per-key gate": (_inputs(B, T, H, D, dt, per_key=True), {}),
            "grouped heads (HV = 2H)": (_inputs(B, T, H // 2 or 1, D, dt, HV=H), {}),
            "q/k L2 norm": (x, dict(normalize_qk=True)),
            # the rule family: linear attention's write, same kernels (speed must hold)
            "gated linear attention (delta_rule=False)": (x, dict(delta_rule=False)),
        }
        packed = {n: a.reshape((1, B * T) + a.shape[2:]) for n, a in x.items()}
        cu = np.linspace(0, B * T, 2 * B + 1).astype(np.int64)   # 2B sequences of T/2
        variants["packed (cu_seqlens, 2B seqs)"] = (packed, dict(cu_seqlens=cu))
        for label, (xv, kw) in variants.items():
            f2, b2, _ = _gdn_calls(xv, threads, **kw)
            table.add("gdn_ext", f"gdn_ext forward, {label} ({name})", _timeit(f2, repeat), B * T,
                      peak=pk[threads])
            table.add("gdn_ext", f"gdn_ext backward, {label} ({name})", _timeit(b2, repeat), B * T,
                      peak=pk[threads])
        if not quick or dt == np.float32:
            _torch_rows(table, x, threads, repeat, torch_T)
        xs = {n: a[:, :numpy_T] for n, a in x.items()}
        table.add("numpy", f"gdn_ext.reference forward ({name}, T={numpy_T})",
                  _timeit(lambda: reference.gated_delta_rule(xs["q"], xs["k"], xs["v"],
                                                             beta=xs["beta"], g=xs["g"]),
                          max(1, repeat // 2)), B * numpy_T)
        table.add("ceiling", f"numpy matmul 1024^3 ({name})", 2 * 1024 ** 3 / ceiling / 1e9, 0,
                  flops=2 * 1024 ** 3)
        _print_table(table, t_f, t_fb, ceiling, log)
        tables[name] = dict(rows=table.rows, matmul_gflops=ceiling,
                            forward_fraction_of_matmul=t_f["gflops"] / ceiling,
                            forward_fraction_of_peak=t_f["fraction_of_peak"],
                            backward_over_forward=t_b["seconds"] / t_f["seconds"])
    res["tables"] = tables

    log("\nT sweep (float32 forward; cost must grow linearly: time per token stays flat)")
    res["sweep_T"] = []
    for Ts in sweep_T:
        x = _inputs(1 if quick else B, Ts, H, D, np.float32)
        fwd, bwd, _ = _gdn_calls(x, threads)
        tf, tb = _timeit(fwd, repeat), _timeit(bwd, max(1, repeat // 2))
        ntok = x["q"].shape[0] * Ts
        res["sweep_T"].append(dict(T=Ts, tokens=ntok, forward_s=tf, backward_s=tb,
                                   forward_us_per_token=1e6 * tf / ntok,
                                   backward_us_per_token=1e6 * tb / ntok))
        noisy = max(getattr(tf, "spread", 1.0), getattr(tb, "spread", 1.0)) > NOISY
        log(f"  T={Ts:>6}: forward {1e6 * tf / ntok:8.2f} us/token, backward "
            f"{1e6 * tb / ntok:8.2f} us/token" + ("  (noisy)" if noisy else ""))

    sw = res["sweep_T"]
    for a, b in zip(sw, sw[1:]):   # a call's fixed cost cancels: what each added token costs
        ntok = b["tokens"] - a["tokens"]
        df, db = (1e6 * (b[key] - a[key]) / ntok for key in ("forward_s", "backward_s"))
        log(f"  T={a['T']} -> {b['T']}: each added token {df:8.2f} us forward, {db:8.2f} us "
            f"backward (flat across the sweep: linear cost)")

    log("\nDk = Dv sweep (T as above; x peak: GFLOP/s over the multiply-add ceiling of the same "
        "threads)")
    res["sweep_D"] = []
    for dt in (np.float32, np.float64):
        for n in sorted({1, threads}):
            for Ds in sweep_D:
                x = _inputs(B, T, H, Ds, dt)
                fwd, bwd, _ = _gdn_calls(x, n)
                tf, tb = _timeit(fwd, repeat), _timeit(bwd, max(1, repeat // 2))
                gf = 7 * Ds * Ds * H * B * T / tf / 1e9
                frac = gf / peak[np.dtype(dt).name][n]
                res["sweep_D"].append(dict(D=Ds, dtype=np.dtype(dt).name, threads=n, forward_s=tf,
                                           backward_s=tb, forward_gflops=gf,
                                           forward_fraction_of_peak=frac))
                log(f"  {np.dtype(dt).name} {n:>2} thr D={Ds:>4}: forward {1e3 * tf:8.2f} ms "
                    f"({gf:6.1f} GFLOP/s, {frac:4.2f} x peak), backward {1e3 * tb:8.2f} ms "
                    f"({tb / tf:.2f}x)")

    res["padded_batch"] = padded_batch(B, T, H, D, repeat, log=log)

    res["contention"] = contention(B, T, H, D, threads, repeat, busy=1 if quick else None, log=log)

    log(f"\nthread sweep (float32 forward, B={B} T={T} H={H} D={D}; parallel efficiency = "
        f"speed-up / threads)")
    res["sweep_threads"] = []
    x = _inputs(B, T, H, D, np.float32)
    base = None
    for n in range(1, threads + 1):
        fwd, _, _ = _gdn_calls(x, n)
        tf = _timeit(fwd, repeat)
        base = base or tf
        res["sweep_threads"].append(dict(threads=n, forward_s=tf, speedup=base / tf,
                                         efficiency=base / tf / n))
        log(f"  {n:>2} threads: forward {1e3 * tf:8.2f} ms, speed-up {base / tf:5.2f}, "
            f"efficiency {100 * base / tf / n:5.1f} %")

    log("\ndecode: one gated_delta_rule_step (B=1, H=32) vs the per-token time of a full call")
    Hd, Td = 32, (128 if quick else 1024)
    xd = _inputs(1, Td, Hd, D, np.float32)
    full = _timeit(lambda: gdn_ext.gated_delta_rule(xd["q"], xd["k"], xd["v"], beta=xd["beta"],
                                                    g=xd["g"], num_threads=threads), repeat) / Td
    state = np.zeros((1, Hd, D, D), np.float32)
    step = _timeit(lambda: gdn_ext.gated_delta_rule_step(
        xd["q"][:, 0], xd["k"][:, 0], xd["v"][:, 0], beta=xd["beta"][:, 0], g=xd["g"][:, 0],
        state=state, num_threads=threads), max(repeat, 20))
    res["decode"] = dict(H=Hd, D=D, step_s=step, full_call_per_token_s=full, ratio=step / full)
    log(f"  step {1e6 * step:8.1f} us, full call {1e6 * full:8.1f} us/token: ratio {step / full:.2f}")

    mem = _backward_memory(B, memory_T, H, D, threads)
    res["backward_memory"] = mem
    log(f"\nbackward extra memory at T={memory_T} (float32): gdn_ext "
        f"{mem['gdn_ext_backward_extra_bytes'] / 2**20:.1f} MiB")
    for key, label in (("torch_loop_saved_bytes", "reference loop, torch autograd"),
                       ("transformers_chunk_saved_bytes", "transformers chunk, torch autograd")):
        if key in mem:
            log(f"  {label}: {mem[key] / 2**20:.1f} MiB saved for backward "
                f"({mem[key] / max(1, mem['gdn_ext_backward_extra_bytes']):.0f}x gdn_ext)")
    return res


def padded_batch(B, T, H, D, repeat=5, log=print):
    """A padded batch against ordinary inputs of the same shape, one thread, float32 and float64,
    forward and backward: real tokens for t < T / 20, then q = k = v = 0 (right padding). The gate
    (the same for both inputs) takes a state of size 1 down to the dtype's smallest normal number
    halfway through the padding, and is at least 0.55: in IEEE arithmetic the state then stays in
    subnormal numbers (x * alpha rounds back to x once x is a few units of the last place), which
    many CPUs compute 10 to 100 times slower; the kernels flush them to zero. Returns one dict per
    dtype with the times and the padded / ordinary ratios."""
    pad_from = max(1, T // 20)
    out = []
    log(f"\npadded batch against ordinary inputs (B={B} T={T} H={H} Dk=Dv={D}, 1 thread; q = k = "
        f"v = 0 from t = {pad_from}): time, and padded / ordinary")
    for dt in (np.float32, np.float64):
        x = _inputs(B, T, H, D, dt)
        alpha = max(0.55, float(np.finfo(dt).tiny) ** (2 / max(1, T - pad_from)))
        x["g"] = np.full_like(x["g"], np.log(alpha))
        pad = {n: a.copy() for n, a in x.items()}
        for n in ("q", "k", "v"):
            pad[n][:, pad_from:] = 0
        row = dict(dtype=np.dtype(dt).name, pad_from=pad_from, alpha=alpha)
        for label, xs in (("ordinary", x), ("padded", pad)):
            fwd, bwd, _ = _gdn_calls(xs, 1)
            row[label + "_forward_s"] = _timeit(fwd, repeat)
            row[label + "_backward_s"] = _timeit(bwd, max(1, repeat // 2))
        for d in ("forward", "backward"):
            row[d + "_ratio"] = row[f"padded_{d}_s"] / row[f"ordinary_{d}_s"]
            log(f"  {row['dtype']} {d:<8} (alpha {alpha:.3f}): ordinary {1e3 * row[f'ordinary_{d}_s']:8.2f} ms, "
                f"padded {1e3 * row[f'padded_{d}_s']:8.2f} ms: {row[d + '_ratio']:5.2f} x")
        out.append(row)
    return out


def contention(B, T, H, D, threads, repeat, busy=None, log=print):
    """The float32 forward with default threads and with one thread while `busy` processes
    (default: one per CPU) spin on every core: default threads must not be the slower."""
    import subprocess
    busy = os.cpu_count() if busy is None else busy
    x = _inputs(B, T, H, D, np.float32)
    spin = "import time\nt = time.time()\nwhile time.time() - t < 600: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(busy)]
    try:
        time.sleep(0.5)
        t_def = _timeit(_gdn_calls(x, None)[0], repeat)   # default threads (the cap may lower them)
        t_one = _timeit(_gdn_calls(x, 1)[0], repeat)
        cap = busy_cap()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    gf = 7 * D * D * H * B * T / 1e9
    log(f"\ncontention: {busy} busy processes on {os.cpu_count()} CPUs, float32 forward: default "
        f"threads ({threads}; busy-machine cap at the end: {cap or 'none'}) {1e3 * t_def:.2f} ms "
        f"({gf / t_def:.1f} GFLOP/s), 1 thread {1e3 * t_one:.2f} ms ({gf / t_one:.1f} GFLOP/s): "
        f"default / one = {t_def / t_one:.2f} x the time")
    return dict(busy_processes=busy, threads=threads, forward_s=t_def, forward_1thread_s=t_one,
                ratio=t_def / t_one, cap_at_end=cap)


def _target_row(rows, log, target, what, value, bound, unit="x"):
    """One row of the training targets: value against its bound (lower is better unless the bound
    is written as a minimum, ">= b")."""
    at_least = bound.startswith(">=")
    b = float(bound.lstrip("<>= "))
    met = value >= b if at_least else value <= b
    rows.append(dict(target=target, what=what, value=value, bound=bound, unit=unit, met=met))
    log(f"  {target:<3} {what:<68} {value:9.3g} {unit:<3} {bound:<8} {'met' if met else 'NOT met'}")


def training_targets(threads=None, repeat=3, T=2048, BH=4, dims=(64, 128, 256), many_BH=64,
                     few_T=1024, decode=(32, 128, 200), log=print):
    """The training targets as ratios measured in this run (the FMA probe of the same run for
    "x peak"): backward / forward on one thread for both dtypes, Dk = Dv in ``dims``, scalar and
    per-key gates (with the forward's checkpoints handed over, and with its own checkpoint pass);
    the forward with checkpoints / the plain forward; the torch path / the NumPy calls it makes;
    transformers' chunked fallback / gdn_ext (forward + backward); the forward on all threads
    against their FMA peak (B*H = ``many_BH``, Dk = Dv = 128); few pairs (B = 1, H = 4, T =
    ``few_T``) on all threads against one thread; decoding steps (``decode`` = (H, D, steps)).
    Returns a dict with ``rows``: target, what, value, bound, unit, met."""
    threads = threads or default_threads()
    rows = []
    log(f"training targets: T={T}, B*H={BH}, median of {repeat}; all threads = {threads}")
    peak = {(dt, n): _core.fma_peak(dt == np.float64, n, 0.3)
            for dt in (np.float32, np.float64) for n in sorted({1, threads})}

    def calls(x, nt, **kw):   # the recurrence (the chunk form's targets: chunk_targets)
        args = (x["q"], x["k"], x["v"])
        rest = dict(beta=x["beta"], g=x["g"], num_threads=nt, check_values=False,
                    algorithm="recurrent", **kw)
        o, _, ck = gdn_ext.gated_delta_rule(*args, **rest, return_checkpoints=True)
        do = np.ones_like(o)
        return (lambda: gdn_ext.gated_delta_rule(*args, **rest),
                lambda: gdn_ext.gated_delta_rule(*args, **rest, return_checkpoints=True),
                lambda: gdn_ext.gated_delta_rule_backward(do, *args, **rest, checkpoints=ck),
                lambda: gdn_ext.gated_delta_rule_backward(do, *args, **rest))

    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        for D in dims:
            for per_key in (False, True):
                gate = "per-key" if per_key else "scalar"
                x = _inputs(1, T, BH, D, dt, per_key=per_key)
                f, fc, bc, b = (_timeit(fn, repeat) for fn in calls(x, 1))
                tag = f"{name} D={D} {gate}"
                log(f"      {tag}: forward {f * 1e3:.2f} ms = "
                    f"{7 * D * D * BH * T / f / 1e9 / peak[dt, 1]:.2f} x peak (1 thread)")
                _target_row(rows, log, "1", f"backward with checkpoints / forward, {tag}",
                            bc / f, "<= 3.0")
                _target_row(rows, log, "1", f"backward (own checkpoints) / forward, {tag}",
                            b / f, "<= 3.5")
                _target_row(rows, log, "2", f"forward with checkpoints / forward, {tag}",
                            fc / f, "<= 1.1")
    D = 128 if 128 in dims else dims[-1]   # targets 2 to 4: the usual head width
    _torch_targets(rows, log, threads, repeat, T, BH, D)
    for dt in (np.float32, np.float64):
        name = np.dtype(dt).name
        for per_key in (False, True):
            x = _inputs(1, T, many_BH, D, dt, per_key=per_key)
            f, fc, bc, b = (_timeit(fn, repeat) for fn in calls(x, threads))
            gate = "per-key" if per_key else "scalar"
            _target_row(rows, log, "4", f"forward, B*H={many_BH}, {threads} threads, {name} {gate}",
                        7 * D * D * many_BH * T / f / 1e9 / peak[dt, threads], ">= 0.5", "peak")
            _target_row(rows, log, "4", f"backward / forward, B*H={many_BH}, {threads} threads, "
                        f"{name} {gate}", b / f, "<= 3.5")
    x = _inputs(1, few_T, 4, D, np.float32)
    one = _timeit(calls(x, 1)[0], repeat)
    many = _timeit(calls(x, threads)[0], repeat)
    _target_row(rows, log, "4", f"forward B=1 H=4 T={few_T}: 1 thread / {threads} threads",
                one / many, ">= 6", "x")
    _decode_targets(rows, log, threads, *decode)
    return dict(threads=threads, T=T, BH=BH, fma_peak_gflops={
        f"{np.dtype(dt).name} {n} threads": p for (dt, n), p in peak.items()}, rows=rows)


def _ab(fns, repeat):
    """Median seconds of each function, called in alternated rounds (one of each per round), so
    that a drifting machine slows them alike. Python's cyclic garbage collector runs between the
    rounds, never inside a timed call (as in timeit): with torch imported one full collection
    takes milliseconds and would land in whichever call happened to trigger it."""
    for fn in fns:
        fn()                                           # warm-up
    times = [[] for _ in fns]
    enabled = gc.isenabled()
    try:
        for _ in range(repeat):
            gc.collect()
            gc.disable()
            for fn, ts in zip(fns, times):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            gc.enable()
    finally:
        if enabled:
            gc.enable()
        else:
            gc.disable()
    return [statistics.median(ts) for ts in times]


def _torch_training_step(T, H, D, dtype, threads, algorithm="auto"):
    """A function running one training step through gdn_ext.torch (forward, then backward from
    do = 1) on inputs of B = 1, T tokens, H heads of D, made here once."""
    import torch
    import gdn_ext.torch as gt
    x = {n: torch.from_numpy(a).requires_grad_() for n, a in _inputs(1, T, H, D, dtype).items()}
    do = torch.ones_like(x["v"])

    def step():
        for a in x.values():
            a.grad = None
        o, _ = gt.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                                   num_threads=threads, check_values=False, algorithm=algorithm)
        o.backward(do)
    return step


def chunk_targets(threads=None, repeat=5, T=2048, BH=4, D=128, many_BH=64, few=(4096, 8192),
                  log=print):
    """The chunk form's targets, each a ratio measured in this run (alternated rounds): C1 a
    training step through gdn_ext.torch (forward + backward, scalar gate, 1 thread), the
    recurrence's time over the chunk form's, float32 and float64; C2 transformers' chunked
    fallback over gdn_ext.torch ("auto"), forward + backward, on 1 and all threads; P the
    chunk form's large matrix products against the FMA peak (one thread); C3 the
    forward ("auto") against the FMA peak counting the recurrent 7 Dk Dv flops per token, on 1
    thread (B*H = ``BH``) and on default threads (B*H = ``many_BH``); C4 one sequence's speed-up
    on all threads (B = 1, H = 4, T = few[0]) and on 2 (B = H = 1, T = few[1]); C5 the float64
    agreement of the two forms (max relative difference, forward and gradients)."""
    threads = threads or default_threads()
    rows = []
    log(f"chunk-form targets: T={T}, B*H={BH}, D={D}, median of {repeat} alternated rounds; "
        f"all threads = {threads}")
    flops = 7 * D * D * T
    try:
        import torch
        import gdn_ext.torch as gt
    except ImportError:
        torch = None
        log("      (torch is not installed: C1 and C2 skipped)")
    if torch is not None:
        torch.set_num_threads(1)
        for dt in (np.float32, np.float64):
            rec, chk = _ab([_torch_training_step(T, BH, D, dt, 1, "recurrent"),
                            _torch_training_step(T, BH, D, dt, 1, "chunk")], repeat)
            log(f"      {np.dtype(dt).name}: step recurrent {rec * 1e3:.1f} ms, chunk "
                f"{chk * 1e3:.1f} ms")
            _target_row(rows, log, "C1", f"training step recurrent / chunk, 1 thread, "
                        f"{np.dtype(dt).name}", rec / chk, ">= 1.3")
        try:
            import transformers.models.qwen3_next.modeling_qwen3_next as q3
        except ImportError:
            q3 = None
            log("      (transformers is not installed: C2 skipped)")
        x = {n: torch.from_numpy(a).requires_grad_() for n, a in
             _inputs(1, T, BH, D, np.float32).items()}
        for nt in sorted({1, threads}) if q3 is not None else ():
            torch.set_num_threads(nt)

            def ours(nt=nt):
                o, _ = gt.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                                           num_threads=nt, check_values=False)
                o.backward(torch.ones_like(o))

            def theirs():
                o, _ = q3.torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"],
                                                       beta=x["beta"])
                o.backward(torch.ones_like(o))
            a, b = _ab([theirs, ours], max(1, repeat // 2))
            _target_row(rows, log, "C2", f"transformers chunk fwd+bwd / gdn_ext.torch, {nt} thr",
                        a / b, ">= 7" if nt == 1 else ">= 15")
        torch.set_num_threads(threads)
    peak1 = _core.fma_peak(False, 1, 0.3)
    _product_rows(rows, log, D, peak1)
    x = _inputs(1, T, BH, D, np.float32)
    fwd = _gdn_calls(x, 1, check_values=False)[0]
    rec = _gdn_calls(x, 1, check_values=False, algorithm="recurrent")[0]
    t_auto, t_rec = _ab([fwd, rec], repeat)
    log(f"      forward 1 thread: auto {flops * BH / t_auto / 1e9 / peak1:.2f} x peak, recurrent "
        f"{flops * BH / t_rec / 1e9 / peak1:.2f} x peak")
    _target_row(rows, log, "C3", "forward (auto), 1 thread, float32", flops * BH / t_auto / 1e9
                / peak1, ">= 0.75", "peak")
    peak_all = _core.fma_peak(False, threads, 0.3)
    x = _inputs(1, T, many_BH, D, np.float32)
    (t_many,) = _ab([_gdn_calls(x, None, check_values=False)[0]], repeat)
    _target_row(rows, log, "C3", f"forward (auto), B*H={many_BH}, default threads",
                flops * many_BH / t_many / 1e9 / peak_all, ">= 0.5", "peak")
    for (H, T1, nt, bound) in ((4, few[0], threads, ">= 8"), (1, few[1], 2, ">= 1.7")):
        x = _inputs(1, T1, H, D, np.float32)
        one, many = _ab([_gdn_calls(x, 1, check_values=False)[0],
                         _gdn_calls(x, nt, check_values=False)[0]], repeat)
        _target_row(rows, log, "C4", f"forward B=1 H={H} T={T1}: 1 thread / {nt} threads",
                    one / many, bound)
    x = _inputs(1, min(T, 512), 2, min(D, 64), np.float64)
    worst = 0.0
    for alg_pair in (("chunk", "recurrent"),):
        r = [_gdn_calls(x, 1, algorithm=a, check_values=False) for a in alg_pair]
        for fa, fb in ((r[0][0], r[1][0]), (r[0][1], r[1][1])):
            for a, b in zip(fa(), fb()):
                worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)))
    _target_row(rows, log, "C5", "float64 chunk vs recurrent, max relative difference", worst,
                "<= 1e-12", "")
    return dict(threads=threads, T=T, BH=BH, D=D, rows=rows)


def _product_rows(rows, log, D, peak32):
    """The chunk form's two large products per chunk of C tokens (C = the default chunk size):
    Q H ([C, D] by [D, D]) and the state update K^T V' ([D, C] by [C, D]), through the kernels'
    own inner loops on one thread, as fractions of the FMA probe of the same dtype."""
    from gdn_ext._algorithm import DEFAULT_CHUNK_SIZE as C
    for dt, peak in ((np.float32, peak32), (np.float64, _core.fma_peak(True, 1, 0.3))):
        for name, (m, n, k) in (("Q H", (C, D, D)), ("K^T V'", (D, D, C))):
            rate = _core.mm_rate(dt == np.float64, m, n, k, 0.1)
            _target_row(rows, log, "P", f"chunk product {name} {m}x{k} by {k}x{n} / FMA peak, "
                        f"{np.dtype(dt).name}", rate / peak, ">= 0.8", "peak")


def training_throughput(threads=None, heads=(16, 32), T=4096, D=128, repeat=3, log=print):
    """Training speed of one layer: forward + backward through gdn_ext.torch (``"auto"``, scalar
    gate, B = 1, Dk = Dv = D, T tokens, H heads, the shapes of Qwen3.5's linear-attention layers
    for H = 16 and 32), float32 and float64, on ``threads`` threads (None: every core): tokens
    per second, and per second per core (tokens / s / threads). Median of ``repeat`` steps; a
    list of dicts."""
    try:
        import torch
    except ImportError:
        log("      (torch is not installed: the training figure is skipped)")
        return []
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    out = []
    log(f"training one layer (forward + backward, gdn_ext.torch), B=1, T={T}, D={D}, "
        f"{threads} threads, median of {repeat}")
    for dt in (np.float32, np.float64):
        for H in heads:
            (t,) = _ab([_torch_training_step(T, H, D, dt, threads)], repeat)
            name = np.dtype(dt).name
            out.append(dict(dtype=name, H=H, T=T, D=D, threads=threads, seconds=t,
                            tokens_per_s=T / t, tokens_per_s_per_core=T / t / threads))
            log(f"      H={H:<3} {name}: {t * 1e3:8.1f} ms a step, {T / t:9.0f} tokens/s, "
                f"{T / t / threads:9.0f} tokens/s per core")
    return out


def _torch_targets(rows, log, threads, repeat, T, BH, D):
    """Target 2 (torch path against the NumPy calls it makes) and 3 (transformers' chunked
    fallback against gdn_ext), float32, Dk = Dv = D, scalar gate."""
    try:
        import torch
        import gdn_ext.torch as gt
    except ImportError:
        log("      (torch is not installed: targets 2 and 3 skipped)")
        return
    x = _inputs(1, T, BH, D, np.float32)
    t = {n: torch.from_numpy(a) for n, a in x.items()}
    for nt in sorted({1, threads}):
        torch.set_num_threads(nt)
        args = (x["q"], x["k"], x["v"])
        rest = dict(beta=x["beta"], g=x["g"], num_threads=nt, check_values=False,
                    algorithm="recurrent")
        do = np.ones_like(x["v"])

        def numpy_pair():
            o, _, ck = gdn_ext.gated_delta_rule(*args, **rest, return_checkpoints=True)
            gdn_ext.gated_delta_rule_backward(do, *args, **rest, checkpoints=ck)

        # leaves made once and do given, as the NumPy calls get them: the ratio is the torch
        # path's own cost
        leaves = {n: a.clone().requires_grad_() for n, a in t.items()}
        do_t = torch.from_numpy(do)

        def torch_path():
            for a in leaves.values():
                a.grad = None
            o, _ = gt.gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], beta=leaves["beta"],
                                       g=leaves["g"], num_threads=nt, check_values=False,
                                       algorithm="recurrent")
            o.backward(do_t)
        tp = _timeit(torch_path, repeat)
        _target_row(rows, log, "2", f"gdn_ext.torch fwd+bwd / NumPy fwd_ckpt+bwd_ckpt, {nt} thr",
                    tp / _timeit(numpy_pair, repeat), "<= 1.05")
        try:
            import transformers.models.qwen3_next.modeling_qwen3_next as q3
        except ImportError:
            continue

        def hf_both():
            for a in leaves.values():
                a.grad = None
            o, _ = q3.torch_chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"],
                                                   g=leaves["g"], beta=leaves["beta"])
            o.backward(torch.ones_like(o))
        _target_row(rows, log, "3", f"transformers chunk fwd+bwd / gdn_ext.torch fwd+bwd, {nt} thr",
                    _timeit(hf_both, repeat) / tp, ">= 5")
    torch.set_num_threads(threads)


def _decode_targets(rows, log, threads, H=32, D=128, steps=200):
    """Target 5: one decoding step, B = 1, H = 32, Dk = Dv = 128, float32 (ggml's shape)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, D)).astype(np.float32) for _ in range(3))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = np.full((1, H), 0.5, np.float32)
    alpha = np.full((1, H), 0.97, np.float32)
    state = np.zeros((1, H, D, D), np.float32)

    def median_us(fn):
        fn()
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6
    res = {}
    for nt in sorted({1, threads}):
        kw = dict(beta=beta, alpha=alpha, num_threads=nt, check_values=False)
        res[nt, True] = median_us(lambda: gdn_ext.gated_delta_rule_step(
            q, k, v, state=state, inplace=True, **kw))
        res[nt, False] = median_us(lambda: gdn_ext.gated_delta_rule_step(q, k, v, state=state, **kw))
        spare = np.zeros_like(state)
        res[nt, "out"] = median_us(lambda: gdn_ext.gated_delta_rule_step(
            q, k, v, state=state, out=spare, **kw))
    dflt = median_us(lambda: gdn_ext.gated_delta_rule_step(q, k, v, state=state, inplace=True,
                                                           beta=beta, alpha=alpha,
                                                           check_values=False))
    _target_row(rows, log, "5", "decode step in place, 1 thread", res[1, True], "<= 300", "us")
    _target_row(rows, log, "5", "decode step in place, default threads", dflt, "<= 50", "us")
    for nt in sorted({1, threads}):
        _target_row(rows, log, "5", f"decode step returning a new state / in place, {nt} thr",
                    res[nt, False] / res[nt, True], "<= 1.3")
        _target_row(rows, log, "5", f"decode step into out= / in place, {nt} thr",
                    res[nt, "out"] / res[nt, True], "<= 1.3")


def _print_table(table, t_f, t_fb, ceiling, log):
    log(f"\n{'':<74}{'time':>10}{'tokens/s':>12}{'GFLOP/s':>9}{'x peak':>8}{'x matmul':>10}"
        f"{'slower than gdn_ext: fwd':>27}{'f+b':>9}")
    for r in table.rows:
        if r["group"] == "ceiling":
            log(f"{r['name']:<74}{1e3 * r['seconds']:>8.1f}ms{'':>12}{r['gflops']:>9.1f}{'':>8}"
                f"{1.0:>10.2f}")
            continue
        per_tok = r["seconds"] / r["tokens"]
        vs_f = per_tok / (t_f["seconds"] / t_f["tokens"])
        vs_fb = per_tok / (t_fb["seconds"] / t_fb["tokens"])
        fp = "" if r["fraction_of_peak"] is None else f"{r['fraction_of_peak']:.2f}"
        note = f"  noisy: runs {r['spread']:.1f} x apart" if r.get("noisy") else ""
        log(f"{r['name']:<74}{1e3 * r['seconds']:>8.1f}ms{r['tokens_per_s']:>12,.0f}"
            f"{r['gflops']:>9.1f}{fp:>8}{r['gflops'] / ceiling:>10.2f}{vs_f:>26.2f}x{vs_fb:>8.2f}x"
            f"{note}")


def plot(res, path):
    """Draw the T sweep, the thread sweep and the default-shape rows (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw=dict(width_ratios=[1, 1, 1.4]))
    sw = res["sweep_T"]
    axes[0].loglog([s["T"] for s in sw], [s["forward_s"] for s in sw], "o-", label="forward")
    axes[0].loglog([s["T"] for s in sw], [s["backward_s"] for s in sw], "s-", label="backward")
    axes[0].set(xlabel="T (tokens)", ylabel="seconds", title="cost vs T (linear = slope 1)")
    axes[0].legend()
    th = res["sweep_threads"]
    n = [s["threads"] for s in th]
    axes[1].plot(n, [s["speedup"] for s in th], "o-", label="measured")
    axes[1].plot(n, n, "k--", lw=0.8, label="ideal")
    axes[1].set(xlabel="threads", ylabel="forward speed-up", title="OpenMP scaling")
    axes[1].legend()
    rows = res["tables"]["float32"]["rows"]
    names = [r["name"].replace("float32, ", "").replace(" (float32)", "") for r in rows
             if r["group"] != "ceiling"]
    rates = [r["tokens_per_s"] for r in rows if r["group"] != "ceiling"]
    axes[2].barh(range(len(rates)), rates)
    axes[2].set_yticks(range(len(rates)), names, fontsize=6)
    axes[2].set_xscale("log")
    axes[2].set(xlabel="tokens / s (float32)", title="default shape")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser():
    """The argparse parser of ``python -m gdn_ext bench``."""
    ap = _cli.parser("python -m gdn_ext bench", __doc__)
    _cli.add_shape(ap, 2, 2048, 128)
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="threads of every row (default: OpenMP's default thread count)")
    ap.add_argument("--repeat", type=positive_int, default=5,
                    help="timed runs per row, after one warm-up; the median is shown")
    ap.add_argument("--torch-seq-len", type=positive_int, default=None,
                    help="T for the torch rows (default: --seq-len)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, three runs each: a smoke test of the benchmark, not a "
                         "measurement of gdn_ext's speed")
    ap.add_argument("--scaling", type=positive_int, nargs="+", metavar="N", default=None,
                    help="only the thread-scaling run, for these thread counts, e.g. 1 2 4 8 16 "
                         "(default: not run)")
    ap.add_argument("--padded", action="store_true",
                    help="only the padded-batch row (padded against ordinary inputs, 1 thread)")
    ap.add_argument("--targets", action="store_true",
                    help="only the training-step ratios, all measured in one run: backward / "
                         "forward (one thread, both dtypes, Dk = Dv 64, 128, 256, scalar and "
                         "per-key gates), the forward that returns checkpoints / the plain "
                         "forward, the PyTorch path (gdn_ext.torch forward + backward) / the "
                         "NumPy calls it makes, transformers' chunked fallback / gdn_ext, the "
                         "forward on all threads as a fraction of their multiply-add peak, few "
                         "(sequence, head) pairs on one thread / on all threads, and decoding-"
                         "step times, all of the recurrence; then the chunk form's: a training "
                         "step recurrent / chunk, transformers / gdn_ext.torch, the forward "
                         "('auto') as a fraction of the peak, one sequence on all threads / one, "
                         "and the float64 agreement of the two forms; each line ends with a "
                         "reference value and whether the "
                         "measurement is within it; last, one layer's training speed (tokens/s, "
                         "and per core) at Qwen3.5's shapes, H = 16 and 32, D = 128, T = 4096, "
                         "both dtypes (with --quick, tiny sizes)")
    ap.add_argument("--json", metavar="FILE", default=None,
                    help="write every number to FILE as JSON (default: no file)")
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="draw the results to FILE.png (needs matplotlib; default: no plot)")
    return ap


def main(argv=None):
    """Command line of ``python -m gdn_ext bench`` (see the module docstring); returns 0."""
    a = build_parser().parse_args(argv)
    if a.scaling:
        res = thread_scaling(B=a.batch, T=a.seq_len, H=a.heads, D=a.head_dim,
                             thread_counts=tuple(a.scaling), repeat=a.repeat)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if a.targets:
        kw = dict(T=64, BH=2, dims=(16,), many_BH=4, few_T=64, decode=(2, 16, 5),
                  repeat=1) if a.quick else dict(repeat=a.repeat)
        ckw = dict(T=64, BH=2, D=16, many_BH=4, few=(64, 64), repeat=1) if a.quick else dict(
            repeat=a.repeat)
        tkw = dict(heads=(2,), T=64, D=16, repeat=1) if a.quick else dict(repeat=a.repeat)
        res = dict(training_targets=training_targets(a.threads, **kw),
                   chunk_targets=chunk_targets(a.threads, **ckw),
                   training_throughput=training_throughput(a.threads, **tkw))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if a.padded:
        res = dict(padded_batch=padded_batch(a.batch, a.seq_len, a.heads, a.head_dim, a.repeat))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    kw = dict(B=a.batch, T=a.seq_len, H=a.heads, D=a.head_dim, threads=a.threads,
              repeat=a.repeat, torch_T=a.torch_seq_len)
    if a.quick:
        kw.update(B=1, T=64, H=2, D=16, repeat=3, torch_T=32, numpy_T=16, sweep_T=(256, 1024),
                  sweep_D=(8, 16), memory_T=256, quick=True)
    res = run(**kw)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.plot:
        plot(res, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
