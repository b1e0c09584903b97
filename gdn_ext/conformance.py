"""A conformance suite for any gated delta rule implementation, checked against gdn_ext in float64.

From Python::

    report = gdn_ext.conformance.run(fn, convention="fla")
    assert report.passed

or from the command line (gdn_ext.apps.conformance)::

    python -m gdn_ext conformance MODULE:FUNCTION [--convention fla|transformers|gdn_ext]
                                                  [--dtype float32] [--device cpu] [--json FILE]

The target takes flash-linear-attention's ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule`` signature (``fla``), transformers' fallbacks' (``transformers``:
no scale, no packing), or gdn_ext.torch's (``gdn_ext``). Each case builds inputs in float64, rounds
them to the target's dtype, runs the target on its device (and its backward, when it has one) and
the reference (gdn_ext's C kernels, float64, CPU) on the same rounded values, and compares the
output, the final state and every gradient: the largest absolute error and the largest error
relative to the reference's largest value, against a tolerance set by the target's dtype.

The cases cover bug kinds seen in public reports on such kernels: lengths around chunk sizes,
strong and zero decays, beta at 0, 1 and in (1, 2), initial states honoured and final states in
the right layout, a split sequence (prefill, then decode) equal to one call, packed sequences
with lengths 0 and 1, grouped value heads, per-key decays, q/k L2 normalisation (the epsilon
inside the root), all-zero and tiny rows, head dimensions that are not multiples of 16, a long
sequence, half-precision inputs, and repeatable gradients. A case that needs a feature the target
lacks (judged from its signature: ``cu_seqlens``, ``gk``, ``allow_neg_eigval``) is skipped, and
the report says so.

Math: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464), section 3.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from typing import Callable, Dict, List, Optional

import numpy as np

from . import gated_delta_rule, gated_delta_rule_backward

__all__ = ["run", "Report", "CASES", "TOLERANCES"]

# largest error relative to the reference's largest value, by the dtype the target computes in
TOLERANCES = {"float64": 1e-9, "float32": 2e-4, "bfloat16": 5e-2, "float16": 1e-2}


@dataclasses.dataclass
class Case:
    """One conformance case: inputs in gdn_ext's layout (float64), made by make(rng)."""
    name: str
    what: str
    make: Callable
    needs: frozenset = frozenset()
    split: Optional[int] = None       # prefill up to this step, then the rest from its state
    dtype: Optional[str] = None       # inputs in this dtype whatever --dtype says
    repeat: bool = False              # the gradients of two runs must be equal bitwise


def _inputs(rng, B=2, T=20, H=2, G=1, K=16, V=16, g_lo=-1.0, g_hi=-0.01, per_key=False,
            beta=(0.05, 0.95), state=True, normalize=True, cu=None):
    HV = H * G
    N = B if cu is None else len(cu) - 1
    x = dict(q=rng.standard_normal((B, T, H, K)), k=rng.standard_normal((B, T, H, K)),
             v=rng.standard_normal((B, T, HV, V)),
             beta=rng.uniform(*beta, (B, T, HV)),
             g=rng.uniform(g_lo, g_hi, (B, T, HV)))
    if not normalize:
        x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
    if per_key:
        x["gk"] = rng.uniform(g_lo, g_hi, (B, T, HV, K))
    x["initial_state"] = rng.standard_normal((N, HV, V, K)) if state else None
    x["normalize"] = normalize
    x["cu_seqlens"] = None if cu is None else np.asarray(cu, np.int64)
    return x


def _strong_decays(rng):
    x = _inputs(rng, T=65)
    x["g"][:, 10:20] = -70.0            # alpha = e^-70: the state is wiped
    x["g"][:, 30:40] = 0.0              # no decay at all
    return x


def _zero_rows(rng):
    x = _inputs(rng, T=24)
    for n in ("q", "k", "v"):
        x[n][:, 5:9] = 0.0              # padding tokens
    x["k"][:, 12:14] *= 1e-4            # tiny keys: the epsilon inside the root matters
    x["q"][:, 12:14] *= 1e-4
    return x


CASES: List[Case] = [
    Case("T=1", "a single step (decoding)", lambda r: _inputs(r, T=1)),
    Case("T=63", "one step short of a chunk of 64", lambda r: _inputs(r, T=63)),
    Case("T=64", "exactly one chunk of 64", lambda r: _inputs(r, T=64)),
    Case("T=65", "one step into a second chunk", lambda r: _inputs(r, T=65)),
    Case("T=127", "one short of two chunks", lambda r: _inputs(r, T=127, B=1)),
    Case("T=129", "one into a third chunk", lambda r: _inputs(r, T=129, B=1)),
    Case("strong decay", "g down to -70 and g = 0 on some steps, T = 65", _strong_decays),
    Case("g=0", "no decay at all (DeltaNet)", lambda r: _inputs(r, g_lo=0.0, g_hi=0.0)),
    Case("beta 0 and 1", "beta exactly 0 and 1",
         lambda r: {**_inputs(r), "beta": r.integers(0, 2, (2, 20, 2)).astype(float)}),
    Case("beta in (1,2)", "beta above 1 (negative eigenvalues)",
         lambda r: _inputs(r, beta=(1.05, 1.95)), needs=frozenset({"neg_eigval"})),
    Case("no initial state", "zeros as S_0", lambda r: _inputs(r, state=False)),
    Case("initial state", "S_0 honoured, S_T in the target's layout", lambda r: _inputs(r, T=9)),
    Case("prefill+decode", "a split call, the state carried, equals one call",
         lambda r: _inputs(r, T=30), split=27),
    Case("packed", "packed sequences of lengths 0, 1, 4, 0, 7 (cu_seqlens)",
         lambda r: _inputs(r, B=1, T=12, cu=[0, 0, 1, 5, 5, 12]), needs=frozenset({"varlen"})),
    Case("grouped heads", "HV = 4 value heads over H = 2 query/key heads",
         lambda r: _inputs(r, H=2, G=2, T=17)),
    Case("per-key decay", "a per-key-channel log decay gk",
         lambda r: _inputs(r, per_key=True, T=17), needs=frozenset({"gk"})),
    Case("no L2 norm", "q, k as given (unit keys)", lambda r: _inputs(r, normalize=False)),
    Case("zero rows", "all-zero and tiny q, k, v rows (padding; epsilon inside the root)",
         _zero_rows),
    Case("K=17, V=13", "head dimensions that are not multiples of 16",
         lambda r: _inputs(r, K=17, V=13)),
    Case("long", "T = 2048 (drift)", lambda r: _inputs(r, B=1, H=1, T=2048, K=16, V=16,
                                                           g_lo=-0.05, g_hi=-0.001)),
    Case("bfloat16", "bfloat16 inputs", lambda r: _inputs(r, T=33), dtype="bfloat16",
         needs=frozenset({"half"})),
    Case("float16", "float16 inputs", lambda r: _inputs(r, T=33), dtype="float16",
         needs=frozenset({"half"})),
    Case("repeatable", "two runs give bitwise equal gradients", lambda r: _inputs(r, T=40),
         repeat=True),
]


def _features(fn, convention):
    """The optional features of the target, from its signature and convention."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    feats = set()
    if convention != "transformers" and "cu_seqlens" in params:
        feats.add("varlen")
    if "gk" in params or convention == "gdn_ext":
        feats.add("gk")
    if "allow_neg_eigval" in params or convention == "gdn_ext":
        feats.add("neg_eigval")
    feats.add("half")                    # every convention takes float16 / bfloat16 tensors
    return feats


def _reference(x, t, do, dS, scale):
    """gdn_ext in float64 on the inputs x (already rounded to the target's dtype)."""
    g = x["g"] if "gk" not in x else x["g"][..., None] + x["gk"]
    kw = dict(beta=x["beta"], g=g, initial_state=x["initial_state"], scale=scale,
              normalize_qk=x["normalize"], cu_seqlens=x["cu_seqlens"], check_values=False)
    o, S = gated_delta_rule(x["q"], x["k"], x["v"], **kw)
    grads = gated_delta_rule_backward(do, x["q"], x["k"], x["v"], dS_T=dS, **kw)
    out = dict(o=o, final_state=S, q=grads.dq, k=grads.dk, v=grads.dv, beta=grads.dbeta,
               initial_state=grads.d_initial_state)
    if "gk" in x:
        out["gk"] = grads.dg
        out["g"] = grads.dg.sum(-1)
    else:
        out["g"] = grads.dg
    return out


def _call_target(fn, convention, t, torch, scale, initial_state):
    """Run the target on torch tensors t (its dtype and device) -> (o, S_T in gdn_ext's
    [N, HV, V, K] layout)."""
    if convention == "gdn_ext":
        g = t["g"] if "gk" not in t else t["g"][..., None] + t["gk"]
        return _checked_result(
            fn(t["q"], t["k"], t["v"], beta=t["beta"], g=g, initial_state=initial_state,
               scale=scale, normalize_qk=t["normalize"], cu_seqlens=t["cu_seqlens"]), torch)
    s0 = None if initial_state is None else initial_state.transpose(-1, -2)
    kw = dict(g=t["g"], beta=t["beta"], initial_state=s0, output_final_state=True,
              use_qk_l2norm_in_kernel=t["normalize"])
    if convention == "fla":
        kw["scale"] = scale
        if t["cu_seqlens"] is not None:
            kw["cu_seqlens"] = t["cu_seqlens"]
    if "gk" in t:
        kw["gk"] = t["gk"]
    return _checked_result(fn(t["q"], t["k"], t["v"], **kw), torch, transpose=True)


def _checked_result(out, torch, transpose=False):
    """The target's (o, final_state), both tensors; ValueError with what came back otherwise."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"the target must return (o, final_state); got {type(out).__name__}"
                         + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    o, S = out
    for name, x in (("o", o), ("final_state", S)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"the target returned {type(x).__name__} as {name} (asked for "
                             f"output_final_state=True); expected a tensor")
    return o, (S.transpose(-1, -2) if transpose else S)


def _to_torch(x, dtype, device, torch):
    t = {}
    for n, a in x.items():
        if isinstance(a, np.ndarray) and n != "cu_seqlens":
            t[n] = torch.tensor(a, dtype=getattr(torch, dtype), device=device,
                                requires_grad=True)
        elif n == "cu_seqlens" and a is not None:
            t[n] = torch.tensor(a, dtype=torch.long, device=device)
        else:
            t[n] = a
    return t


_NO_GRADS_HINT = "pass forward_only=True (--forward-only) to check a forward-only kernel"


def _run_case(case, fn, convention, dtype, device, torch, rng, forward_only=False):
    """{quantity: (max abs error, max relative error)} and notes for one case. Without
    forward_only, a target that gives no gradients fails (the "backward" quantity)."""
    x = case.make(rng)
    dt = case.dtype or dtype
    K = x["q"].shape[-1]
    scale = K ** -0.5
    t = _to_torch(x, dt, device, torch)
    # the reference sees exactly the rounded values the target sees
    xr = {n: (t[n].detach().double().cpu().numpy() if isinstance(x[n], np.ndarray)
              and n != "cu_seqlens" else x[n]) for n in x}

    def target_run():
        if case.split is None:
            return _call_target(fn, convention, t, torch, scale, t["initial_state"])
        a, seq = case.split, ("q", "k", "v", "beta", "g", "gk")   # the [B, T, ...] inputs
        first = {n: (v[:, :a] if n in seq else v) for n, v in t.items()}
        second = {n: (v[:, a:] if n in seq else v) for n, v in t.items()}
        o1, S1 = _call_target(fn, convention, first, torch, scale, t["initial_state"])
        o2, S2 = _call_target(fn, convention, second, torch, scale, S1)
        return torch.cat([o1, o2], 1), S2

    o, S = target_run()
    gen = np.random.default_rng(1)
    do = gen.standard_normal(tuple(o.shape))
    dS = gen.standard_normal(tuple(S.shape))
    ref = _reference(xr, t, do, dS, scale)
    got = {"o": o, "final_state": S}
    notes = []
    if forward_only:
        notes.append("forward only: gradients not checked")
    elif o.requires_grad or S.requires_grad:
        loss = (o.double() * torch.tensor(do, device=o.device)).sum() + \
            (S.double() * torch.tensor(dS, device=S.device)).sum()
        leaves = [n for n in ("q", "k", "v", "beta", "g", "gk", "initial_state")
                  if isinstance(t.get(n), torch.Tensor)]
        try:
            grads = torch.autograd.grad(loss, [t[n] for n in leaves], allow_unused=True)
        except NotImplementedError as exc:     # a forward-only kernel, not declared as one
            grads = None
            got["backward"] = None
            notes.append(f"no backward ({str(exc)[:40]}...); {_NO_GRADS_HINT}")
        except Exception as exc:               # the forward is still compared and reported
            grads = None
            got["backward"] = None
            notes.append(f"backward raised {type(exc).__name__}: {str(exc)[:70]}")
        for n, gr in zip(leaves, grads or ()):
            got[n] = gr
        if case.repeat and grads is not None:
            o2, S2 = target_run()
            loss2 = (o2.double() * torch.tensor(do, device=o.device)).sum() + \
                (S2.double() * torch.tensor(dS, device=S.device)).sum()
            grads2 = torch.autograd.grad(loss2, [t[n] for n in leaves], allow_unused=True)
            same = all((a is None and b is None) or bool(torch.equal(a, b))
                       for a, b in zip(grads, grads2))
            notes.append("gradients repeat bitwise" if same else "gradients differ between runs")
            if not same:
                got["repeat"] = None
    else:   # detached outputs: a backward that never reaches the inputs must not pass
        got["backward"] = None
        notes.append(f"no gradients: the target's outputs do not require grad; {_NO_GRADS_HINT}")
    errors, missing = {}, []
    for n, a in got.items():
        if n in ("repeat", "backward"):
            errors[n] = (math.inf, math.inf)
            continue
        b = ref["o" if n == "o" else n]
        if n not in ("o", "final_state") and np.abs(b).max(initial=0) > 0 and \
                (a is None or not bool(a.detach().ne(0).any())):
            missing.append(n)                    # the reference's gradient is not zero
        if a is None:
            errors[n] = (math.inf, math.inf) if np.abs(b).max(initial=0) > 0 else (0.0, 0.0)
            continue
        a = a.detach().double().cpu().numpy()
        if a.shape != b.shape:
            raise ValueError(f"{n}: shape {list(a.shape)}, expected {list(b.shape)}")
        err = float(np.abs(a - b).max(initial=0)) if np.all(np.isfinite(a)) else math.inf
        scale_b = float(np.abs(b).max(initial=0))
        errors[n] = (err, err / scale_b if scale_b > 0 else (0.0 if err == 0 else math.inf))
    if missing:
        notes.append(f"no gradient (None or all zeros) for {', '.join(missing)}")
    return errors, notes, dt


@dataclasses.dataclass
class Report:
    """The results: one row per case: status "pass" (output, final state and gradients within
    tolerance), "fwd" (output and final state within tolerance, gradients not checked: only in a
    run with forward_only=True), "FAIL" (an error above tolerance, or no gradients from a target
    not declared forward-only), "error" (the target raised) or "skip" (a feature the target
    lacks). forward_only: the run checked the forward only."""
    target: str
    convention: str
    dtype: str
    rows: List[Dict]
    forward_only: bool = False

    @property
    def passed(self) -> bool:
        """Every case passed or was skipped, and at least one was checked (a report of skips
        alone certifies nothing)."""
        return (all(r["status"] in ("pass", "fwd", "skip") for r in self.rows)
                and any(r["status"] in ("pass", "fwd") for r in self.rows))

    def header(self) -> str:
        return (f"conformance of {self.target} ({self.convention} convention, {self.dtype}"
                f"{', forward only: gradients not checked' if self.forward_only else ''}) "
                f"against gdn_ext in float64\n"
                f"{'case':<18}{'status':<7}{'tol':>8}  {'worst quantity':<16}{'abs err':>10}"
                f"{'rel err':>10}  notes")

    @staticmethod
    def line(r) -> str:
        """One row: the quantity with the largest relative error, and the notes."""
        if r["status"] in ("skip", "error"):
            return f"{r['case']:<18}{r['status']:<7}{'':>8}  {'':<16}{'':>10}{'':>10}  {r['note']}"
        name, (ab, rel) = max(r["errors"].items(), key=lambda kv: kv[1][1])
        return (f"{r['case']:<18}{r['status']:<7}{r['tol']:>8.0e}  {name:<16}{ab:>10.1e}"
                f"{rel:>10.1e}  {r['note']}")

    def table(self) -> str:
        lines = [self.header()] + [self.line(r) for r in self.rows]
        n_fail = sum(r["status"] in ("FAIL", "error") for r in self.rows)
        n_skip = sum(r["status"] == "skip" for r in self.rows)
        n_fwd = sum(r["status"] == "fwd" for r in self.rows)
        lines.append(f"{len(self.rows) - n_fail - n_skip} passed"
                     + (f" ({n_fwd} on the forward only: gradients not checked)" if n_fwd else "")
                     + f", {n_fail} failed, {n_skip} skipped")
        return "\n".join(lines)


def run(fn, convention="fla", dtype="float32", device="cpu", cases=None, progress=False,
        name=None, on_row=None, forward_only=False) -> Report:
    """Run the suite on ``fn``; returns a :class:`Report` (``report.passed``,
    ``report.table()``, ``report.rows``); ``on_row(row)`` is called as each case ends;
    ``progress``: a progress bar on stderr (tqdm) when stderr is a terminal. Needs torch.

    Every case compares the gradients of all inputs too: a target whose outputs carry no
    gradients (detached, or a backward that raises NotImplementedError) fails, unless
    ``forward_only=True`` says it is a forward-only kernel, in which case only the output and the
    final state are compared (status "fwd"), the report says so, and the cases that only test
    gradients are skipped. Raises ValueError for an unknown convention or dtype, TypeError for a
    target that is not callable."""
    import torch
    if convention not in ("fla", "transformers", "gdn_ext"):
        raise ValueError(f"convention must be fla, transformers or gdn_ext; got {convention!r}")
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCES)}; got {dtype!r}")
    if not callable(fn):
        raise TypeError(f"the target must be callable; got {type(fn).__name__}")
    if device != "cpu":
        dev = torch.device(device)           # ValueError for a bad name
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this torch has no CUDA device")
    feats = _features(fn, convention)
    if cases is None:
        cases = CASES
    else:
        by_name = {c.name: c for c in CASES}
        if isinstance(cases, (Case, str)):
            cases = [cases]
        try:
            cases = [by_name[c] if isinstance(c, str) else c for c in cases]
        except KeyError as exc:
            raise ValueError(f"unknown case {exc}; the cases are {list(by_name)}") from None
        if not all(isinstance(c, Case) for c in cases):
            raise TypeError("cases must be Case objects or case names")
    it = cases
    if progress:
        try:
            from tqdm import tqdm
            it = tqdm(cases, unit="case", file=sys.stderr, disable=None)   # terminals only
        except ImportError:
            pass
    rows = []

    def emit(row):
        rows.append(row)
        if on_row:
            on_row(row)
    for i, case in enumerate(it):
        row = {"case": case.name, "what": case.what}
        missing = case.needs - feats
        if missing:
            row.update(status="skip", note=f"target lacks {', '.join(sorted(missing))}")
            emit(row)
            continue
        if case.repeat and forward_only:
            row.update(status="skip", note="forward only: this case compares gradients")
            emit(row)
            continue
        try:
            errors, notes, dt = _run_case(case, fn, convention, dtype, device, torch,
                                          np.random.default_rng(100 + i), forward_only)
        except Exception as exc:   # a crash of the target is a finding, reported per case
            row.update(status="error", note=f"{type(exc).__name__}: {exc}"[:120])
            emit(row)
            continue
        tol = TOLERANCES[dt]
        ok = all(rel <= tol for _, rel in errors.values())
        status = "FAIL" if not ok else "fwd" if forward_only else "pass"
        row.update(status=status, tol=tol, errors=errors, note="; ".join(notes))
        emit(row)
    return Report(name or getattr(fn, "__qualname__", repr(fn)), convention, dtype, rows,
                  forward_only)
