"""``python -m gdn_ext conformance MODULE:FUNCTION``: the conformance suite of
:mod:`gdn_ext.conformance` run on a gated delta rule implementation from the command line: a table
of every case, optionally its JSON; exit status 1 when a case fails."""
import dataclasses
import importlib
import json
import math

from gdn_ext import conformance
from gdn_ext.conformance import TOLERANCES, Report, run
from . import _cli

__all__ = ["build_parser", "main"]


def _finite(x):
    """JSON without Infinity / NaN (strict parsers refuse them): those become null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _load(spec):
    if ":" not in spec:
        raise ValueError(f"target must be MODULE:FUNCTION; got {spec!r}")
    mod, _, attr = spec.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def build_parser():
    """The argparse parser of ``python -m gdn_ext conformance``."""
    ap = _cli.parser("python -m gdn_ext conformance", conformance.__doc__,
                     epilog="Exit status: 1 when a case fails, 0 otherwise.")
    ap.add_argument("target", metavar="MODULE:FUNCTION",
                    help="the implementation to check, e.g. gdn_ext.torch:chunk_gated_delta_rule")
    ap.add_argument("--convention", choices=["fla", "transformers", "gdn_ext"], default="fla",
                    help="the target's signature: fla, flash-linear-attention's "
                         "chunk_gated_delta_rule / fused_recurrent_gated_delta_rule; "
                         "transformers, its torch fallbacks' (no scale, no packing); gdn_ext, "
                         "gdn_ext.torch's")
    ap.add_argument("--dtype", choices=sorted(TOLERANCES), default="float32",
                    help="the dtype of the target's inputs (it sets the tolerances)")
    ap.add_argument("--device", default="cpu", help="the target's torch device, e.g. cuda")
    ap.add_argument("--forward-only", action="store_true",
                    help="the target has no backward: compare its output and final state only "
                         "(without this flag a target whose outputs carry no gradients fails)")
    ap.add_argument("--json", metavar="FILE", default=None,
                    help="also write the results to FILE as JSON (default: no file)")
    ap.add_argument("--no-progress", action="store_true",
                    help="print each case's row as it finishes instead of a progress bar and "
                         "the table at the end")
    return ap


def main(argv=None):
    """Command line; returns 1 when a case fails, 0 otherwise."""
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        fn = _load(a.target)
    except Exception as exc:   # whatever importing the target raised
        ap.error(f"cannot load {a.target}: {type(exc).__name__}: {exc}")
    if not callable(fn):
        ap.error(f"{a.target} is a {type(fn).__name__}, not a function")
    json_file = None
    if a.json:
        try:
            json_file = open(a.json, "w")
        except OSError as exc:
            ap.error(f"--json {a.json}: {exc}")
    try:
        import torch
        if a.device != "cpu" and torch.device(a.device).type == "cuda" \
                and not torch.cuda.is_available():
            ap.error(f"--device {a.device}: this torch has no CUDA device")
    except (RuntimeError, ValueError) as exc:
        ap.error(f"--device {a.device}: {exc}")
    shell = Report(a.target, a.convention, a.dtype, [], a.forward_only)
    if a.no_progress:          # rows as they come (a slow target still shows what it did)
        print(shell.header(), flush=True)
        report = run(fn, a.convention, a.dtype, a.device, name=a.target,
                     on_row=lambda r: print(Report.line(r), flush=True),
                     forward_only=a.forward_only)
        print(report.table().splitlines()[-1])
    else:
        report = run(fn, a.convention, a.dtype, a.device, progress=True, name=a.target,
                     forward_only=a.forward_only)
        print(report.table())
    if json_file is not None:
        with json_file:
            json.dump(_finite(dataclasses.asdict(report)), json_file, indent=1)
    return 0 if report.passed else 1
