"""``python -m gdn_ext demo``: a small forward / backward demo of the C kernels.

Runs the gated delta rule on random inputs, checks it against the NumPy reference loop, and
prints how long the C forward and backward took."""
import time

import numpy as np

import gdn_ext
from gdn_ext import reference
from . import _cli
from ._cli import non_negative_int, positive_int


def build_parser():
    """The argparse parser of ``python -m gdn_ext demo``."""
    ap = _cli.parser("python -m gdn_ext demo", __doc__)
    _cli.add_shape(ap, 2, 2048, 64)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="the dtype of the inputs and of the computation")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="OpenMP threads (default: OpenMP's default thread count)")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random inputs")
    return ap


def main(argv=None):
    """Command line of ``python -m gdn_ext demo``; returns 0."""
    a = build_parser().parse_args(argv)

    rng = np.random.default_rng(a.seed)
    B, T, H, D = a.batch, a.seq_len, a.heads, a.head_dim
    dt = np.dtype(a.dtype)
    q = rng.standard_normal((B, T, H, D)).astype(dt)
    k = rng.standard_normal((B, T, H, D))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dt)  # unit keys, as the paper's layer
    v = rng.standard_normal((B, T, H, D)).astype(dt)
    beta = rng.uniform(0, 1, (B, T, H)).astype(dt)
    alpha = rng.uniform(0.9, 1, (B, T, H)).astype(dt)
    scale = D ** -0.5

    print(f"gdn_ext {gdn_ext.__version__}: OpenMP {'on' if gdn_ext.openmp_enabled() else 'off'}; "
          f"B={B} T={T} H={H} Dk=Dv={D} {dt}")
    t0 = time.perf_counter()
    o, S_T = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=alpha, scale=scale,
                                      num_threads=a.threads)
    t1 = time.perf_counter()
    grads = gdn_ext.gated_delta_rule_backward(np.ones_like(o), q, k, v, beta=beta, alpha=alpha,
                                              scale=scale, num_threads=a.threads)
    t2 = time.perf_counter()
    flops = 7 * B * T * H * D * D
    print(f"forward  {1e3 * (t1 - t0):8.2f} ms  {B * T / (t1 - t0):12,.0f} tokens/s  "
          f"{flops / (t1 - t0) / 1e9:6.2f} GFLOP/s (7 Dk Dv per token and head)")
    print(f"backward {1e3 * (t2 - t1):8.2f} ms  ({(t2 - t1) / (t1 - t0):.1f}x the forward)")
    print(f"o {o.shape}, S_T {S_T.shape}, |dq| = {np.linalg.norm(grads.dq):.4g}")

    n = min(T, 64)   # the NumPy reference loop is slow: check a prefix
    o_ref, _ = reference.gated_delta_rule(q[:1, :n].astype(np.float64), k[:1, :n], v[:1, :n],
                                          beta=beta[:1, :n], alpha=alpha[:1, :n], scale=scale)
    err = np.max(np.abs(o[:1, :n] - o_ref)) / np.max(np.abs(o_ref))
    print(f"agreement with the NumPy reference on {n} steps: max relative error {err:.2e}")
    return 0


if __name__ == "__main__":
    main()
