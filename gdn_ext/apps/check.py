"""``python -m gdn_ext check``: every gradient of the layer, checked two ways in float64.

1. Central finite differences, element by element: (L(w + h) - L(w - h)) / 2h with h = 1e-6.
2. When PyTorch is installed: torch autograd of the same layer written in torch ops
   (:func:`torch_gated_deltanet_forward`, the reference layer in torch ops).

L = sum(y * dy) + sum(S_T * dS_T) for random dy, dS_T, so every output and the final state count.
Prints a table of the largest relative errors, max|got - want| / max|want|, and returns non-zero
when one exceeds its tolerance.
"""
import sys

import numpy as np

from ..layer import GatedDeltaNetParams, gated_deltanet_backward, gated_deltanet_forward
from . import _cli
from ._cli import non_negative_int

__all__ = ["torch_gated_deltanet_forward", "layer_gradients", "central_differences",
           "finite_difference_gradients", "torch_gradients", "run", "main"]

FD_TOL = 1e-6      # central differences in float64 with h = 1e-6: truncation + rounding ~1e-9
TORCH_TOL = 1e-10  # same math, different summation order


def torch_gated_deltanet_forward(x, S, params, normalize_qk=False, scale=1.0):
    """The Gated DeltaNet layer in torch ops (autograd computes its backward), with heads.

    x [B, T, D], S [B, H, Dv, Dk] (torch tensors), params: dict name -> tensor with the fields of
    GatedDeltaNetParams. Returns (y, S_T)."""
    import torch

    from ..torch import reference_gated_delta_rule

    def rmsnorm(x, w, eps=1e-6):
        return w * x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)

    B, T, D = x.shape
    H = params["Wg_state"].shape[1]
    h = rmsnorm(x, params["norm_weight"])
    q = (h @ params["Wq"]).reshape(B, T, H, -1)
    k = (h @ params["Wk"]).reshape(B, T, H, -1)
    v = (h @ params["Wv"]).reshape(B, T, H, -1)
    gate = torch.sigmoid(h @ params["Wg_state"])
    eta = torch.sigmoid(h @ params["Weta"])
    # the reference loop, in torch ops (gate_memory, batch_matvec, batch_outer per step)
    O, S_T = reference_gated_delta_rule(q, k, v, beta=eta, alpha=gate, initial_state=S,
                                        scale=scale, normalize_qk=normalize_qk)
    return x + O.reshape(B, T, -1) @ params["Wo"], S_T


def _problem(seed, B=2, T=6, D=8, H=2, Dk=3, Dv=4):
    rng = np.random.default_rng(seed)
    params = GatedDeltaNetParams.init(D, Dk, Dv, n_heads=H, seed=seed, dtype=np.float64)
    x = rng.standard_normal((B, T, D))
    S = 0.3 * rng.standard_normal((B, H, Dv, Dk))
    dy = rng.standard_normal((B, T, D))
    dS_T = rng.standard_normal((B, H, Dv, Dk))
    return x, S, params, dy, dS_T


def layer_gradients(x, S, params, dy, dS_T, normalize_qk, scale):
    """gdn_ext's gradients as a dict name -> array (x, S and every weight)."""
    dx, dS, dparams = gated_deltanet_backward(dy, x, S, params, dS_T, normalize_qk=normalize_qk,
                                              scale=scale)
    return {"x": dx, "S": dS, **{n: a for n, a in dparams}}


def central_differences(loss, inputs, h=1e-6):
    """d loss / d inputs[name] for every array of the dict ``inputs``, element by element:
    (loss(x + h) - loss(x - h)) / 2h, in float64. ``loss`` takes a dict like ``inputs``."""
    grads = {}
    for name, x in inputs.items():
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            num[idx] = (loss(dict(inputs, **{name: plus}))
                        - loss(dict(inputs, **{name: minus}))) / (2 * h)
        grads[name] = num
    return grads


def finite_difference_gradients(x, S, params, dy, dS_T, normalize_qk, scale, h=1e-6):
    """The same gradients by central differences of L = sum(y dy) + sum(S_T dS_T)."""
    names = [name for name, _ in params]

    def loss(d):
        p = GatedDeltaNetParams(**{name: d[name] for name in names})
        y, S_T = gated_deltanet_forward(d["x"], d["S"], p, normalize_qk=normalize_qk, scale=scale)
        return np.sum(y * dy) + np.sum(S_T * dS_T)

    return central_differences(loss, {"x": x, "S": S, **dict(params)}, h)


def torch_gradients(x, S, params, dy, dS_T, normalize_qk, scale):
    """The same gradients by torch autograd of torch_gated_deltanet_forward."""
    import torch
    leaves = {"x": x, "S": S, **dict(params)}
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in leaves.items()}
    y, S_T = torch_gated_deltanet_forward(t["x"], t["S"], {n: t[n] for n, _ in params},
                                          normalize_qk=normalize_qk, scale=scale)
    loss = (y * torch.tensor(dy)).sum() + (S_T * torch.tensor(dS_T)).sum()
    loss.backward()
    return {n: v.grad.numpy() for n, v in t.items()}


def _rel(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


def run(seed=0, use_torch=None, out=None):
    """Check every gradient; print the table to ``out`` (default stdout); return True when all
    are within tolerance. use_torch: None means "when importable"."""
    out = sys.stdout if out is None else out
    if use_torch is None:
        try:
            import torch  # noqa: F401
            use_torch = True
        except ImportError:
            use_torch = False
    ok = True
    print(f"{'layer':<22}{'gradient':<13}{'vs finite diff.':>17}{'vs torch':>14}", file=out)
    for normalize_qk, scale in ((False, 1.0), (True, 0.5)):
        x, S, params, dy, dS_T = _problem(seed)
        got = layer_gradients(x, S, params, dy, dS_T, normalize_qk, scale)
        fd = finite_difference_gradients(x, S, params, dy, dS_T, normalize_qk, scale)
        tg = torch_gradients(x, S, params, dy, dS_T, normalize_qk, scale) if use_torch else None
        label = f"normalize_qk={normalize_qk}"
        for name in got:
            e_fd = _rel(got[name], fd[name])
            e_t = _rel(got[name], tg[name]) if tg is not None else None
            bad = e_fd > FD_TOL or (e_t is not None and e_t > TORCH_TOL)
            ok &= not bad
            t_col = f"{e_t:14.2e}" if e_t is not None else f"{'(no torch)':>14}"
            print(f"{label:<22}{name:<13}{e_fd:17.2e}{t_col}{'  FAIL' if bad else ''}", file=out)
    print(f"tolerances: finite differences {FD_TOL:g}, torch {TORCH_TOL:g} -> "
          f"{'all gradients OK' if ok else 'GRADIENT CHECK FAILED'}", file=out)
    return ok


def build_parser():
    """The argparse parser of ``python -m gdn_ext check``."""
    ap = _cli.parser("python -m gdn_ext check", __doc__)
    ap.add_argument("--seed", type=non_negative_int, default=0,
                    help="seed of the random layer, input and output gradients")
    ap.add_argument("--no-torch", action="store_true",
                    help="skip the comparison with PyTorch autograd, which otherwise runs when "
                         "torch is installed")
    return ap


def main(argv=None):
    """Command line of ``python -m gdn_ext check``; returns 0 when every gradient is within
    tolerance, 1 otherwise."""
    a = build_parser().parse_args(argv)
    return 0 if run(seed=a.seed, use_torch=False if a.no_torch else None) else 1
