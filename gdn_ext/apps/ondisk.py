"""``python -m gdn_ext ondisk``: the gated delta rule over a batch larger than memory, from a
chunked on-disk array (zarr) through gdn_ext.dask, with a progress bar.

Writes random q, k, v, beta, g of the asked size into a zarr store (chunk by chunk: the whole
batch is never in memory), runs ``gdn_ext.dask.gated_delta_rule`` lazily over them, streams the
outputs o and S_T back to the store with dask's progress bar, and checks one chunk against a
plain NumPy call. Needs dask and zarr: ``pip install -e ".[ondisk]"`` (in a clone).
"""
import os
import tempfile
import time

import numpy as np

from . import _cli
from ._cli import positive_int


def run(store, B, T, H, D, chunk, threads, workers, dtype="float32"):
    """Create the inputs in `store`, compute o and S_T into it; returns (seconds, the largest
    difference of the first chunk to one NumPy call)."""
    import dask
    import dask.array as da
    from dask.diagnostics import ProgressBar

    import gdn_ext
    import gdn_ext.dask as gd

    shapes = {"q": (B, T, H, D), "k": (B, T, H, D), "v": (B, T, H, D), "beta": (B, T, H),
              "g": (B, T, H)}

    def make(name, shape, seed):
        chunks = (chunk,) + shape[1:]

        def block(block_info=None):
            loc = block_info[None]["array-location"][0]
            rng = np.random.default_rng([seed, loc[0]])
            size = (loc[1] - loc[0],) + shape[1:]
            if name == "beta":
                return rng.uniform(0, 1, size).astype(dtype)
            if name == "g":
                return np.log(rng.uniform(0.9, 1, size)).astype(dtype)
            x = rng.standard_normal(size).astype(dtype)
            return x / np.linalg.norm(x, axis=-1, keepdims=True) if name == "k" else x

        return da.map_blocks(block, chunks=da.core.normalize_chunks(chunks, shape), dtype=dtype)

    with dask.config.set(scheduler="threads", num_workers=workers):
        for seed, (name, shape) in enumerate(shapes.items()):
            make(name, shape, seed).to_zarr(store, component=name, overwrite=True)
        x = {n: da.from_zarr(store, component=n) for n in shapes}
        o, S = gd.gated_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                                   scale=D ** -0.5, normalize_qk=True, num_threads=threads)
        t0 = time.perf_counter()
        with ProgressBar():          # one pass: each chunk is read, computed, written, dropped
            dask.compute(o.to_zarr(store, component="o", overwrite=True, compute=False),
                         S.to_zarr(store, component="S_T", overwrite=True, compute=False))
        seconds = time.perf_counter() - t0
    first = {n: np.asarray(da.from_zarr(store, component=n)[:chunk]) for n in shapes}
    o1, S1 = gdn_ext.gated_delta_rule(first["q"], first["k"], first["v"], beta=first["beta"],
                                      g=first["g"], scale=D ** -0.5, normalize_qk=True)
    stored_o = np.asarray(da.from_zarr(store, component="o")[:chunk])
    stored_S = np.asarray(da.from_zarr(store, component="S_T")[:chunk])
    diff = max(float(np.abs(stored_o - o1).max()), float(np.abs(stored_S - S1).max()))
    return seconds, diff


def build_parser():
    """The argparse parser of ``python -m gdn_ext ondisk``."""
    ap = _cli.parser("python -m gdn_ext ondisk", __doc__)
    ap.add_argument("--store", metavar="DIR", default=None,
                    help="zarr directory, kept afterwards (default: a temporary one, deleted at "
                         "the end)")
    _cli.add_shape(ap, 64, 512, 64)
    ap.add_argument("--chunk", type=positive_int, default=8,
                    help="sequences per chunk (at most --batch)")
    ap.add_argument("--threads", type=positive_int, default=1, help="kernel threads per dask task")
    ap.add_argument("--workers", type=positive_int, default=None,
                    help="dask threads (default: the number of CPUs, os.cpu_count())")
    return ap


def main(argv=None):
    """Command line; returns 0 when the checked chunk equals the NumPy call."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.workers is None:
        a.workers = os.cpu_count() or 1
    try:
        import dask  # noqa: F401
        import zarr  # noqa: F401
    except ImportError:
        ap.error('needs dask and zarr: pip install -e ".[ondisk]" (in a clone)')
    if a.store is not None and os.path.exists(a.store) and not os.path.isdir(a.store):
        ap.error(f"--store {a.store} is a file, not a zarr directory")
    if a.chunk > a.batch:
        a.chunk = a.batch
    B, T, H, D = a.batch, a.seq_len, a.heads, a.head_dim
    gb = 4 * B * T * H * (4 * D + 2) / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        store = a.store or os.path.join(tmp, "gdn.zarr")
        print(f"batch of {B} sequences x {T} tokens x {H} heads of {D}: {gb:.2f} GB of float32 "
              f"inputs and outputs in {store}, {-(-B // a.chunk)} chunk"
              f"{'s' if B > a.chunk else ''} of {a.chunk}")
        seconds, diff = run(store, B, T, H, D, a.chunk, a.threads, a.workers)
    tokens = B * T
    print(f"{seconds:.1f} s, {tokens / seconds:,.0f} tokens/s; first chunk against one NumPy "
          f"call: largest difference {diff:.1e}")
    return 0 if diff == 0 else 1
