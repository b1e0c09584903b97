"""``python -m gdn_ext``: train a small character-level Gated DeltaNet language model.

Trains on the Python documentation that ships with the standard library (``pydoc_data``, about
465 000 characters; no download) or on ``--text FILE``, holds out the last 10 % for validation,
reports the validation loss against the unigram baseline, and prints a sample generated token by
token with the recurrent step API. Forward and backward run in gdn_ext; Adam runs in NumPy.
"""
import math
import sys
import time

import numpy as np

from ..layer import RULES
from .lm import Adam, CharLM, CharVocab, load_text, unigram_baseline
from . import _cli
from ._cli import non_negative_int, positive_float, positive_int

__all__ = ["train", "build_parser", "main"]


def _windows(ids, starts, T):
    idx = starts[:, None] + np.arange(T)
    return ids[idx], ids[idx + 1]


def train(text, steps=800, d_model=128, n_layers=3, n_heads=4, d_head=32, batch=16, seq_len=128,
          lr=3e-3, seed=0, num_threads=None, eval_every=100, sample_len=240, progress=True,
          log=print, rule="gated_delta"):
    """Train and evaluate; returns a dict of results (losses, baseline, sample, speed).

    Loss unit: nats per character (mean cross-entropy of the next character). ``progress``: a
    progress bar on stderr (tqdm) when stderr is a terminal."""
    vocab = CharVocab(text)
    ids = vocab.encode(text)
    n_train = int(0.9 * len(ids))
    train_ids, val_ids = ids[:n_train], ids[n_train:]
    if len(val_ids) < seq_len + 2 or len(train_ids) < seq_len + 2:
        raise ValueError(f"text too short for seq_len={seq_len}: {len(ids)} characters; the last "
                         f"10% is held out, so at least {10 * (seq_len + 2)} are needed")
    baseline = unigram_baseline(train_ids, val_ids, len(vocab))
    rng = np.random.default_rng(seed)
    model = CharLM.init(len(vocab), d_model, n_layers, n_heads, d_head, seed=seed, rule=rule)
    opt = Adam(model.arrays(), lr=lr)
    # a fixed set of held-out windows, the same at every evaluation
    n_val = max(1, min(8, (len(val_ids) - 1) // seq_len // batch))
    val_starts = np.linspace(0, len(val_ids) - seq_len - 1, n_val * batch).astype(int)
    val_batches = [_windows(val_ids, s, seq_len) for s in val_starts.reshape(n_val, batch)]

    def val_loss():
        return float(np.mean([model.loss(x, y, num_threads) for x, y in val_batches]))

    log(f"text: {len(ids):,} characters, vocabulary {len(vocab)}; model ({rule} rule): {n_layers} "
        f"layer{'s' if n_layers != 1 else ''}, d_model {d_model}, {n_heads} head"
        f"{'s' if n_heads != 1 else ''} of {d_head}, {model.n_params():,} parameters")
    log(f"unigram baseline on the validation text: {baseline:.3f} nats/char")

    warmup = max(1, steps // 20)
    history = {"step": [], "train": [], "val_step": [], "val": []}
    try:
        from tqdm import tqdm
        # disable=None: no bar when stderr is not a terminal (a log file would fill with it)
        bar = tqdm(range(steps), disable=None if progress else True, unit="step", file=sys.stderr)
    except ImportError:  # the apps extra brings it; without it, no bar
        bar = range(steps)
    t0 = time.perf_counter()
    tokens = 0
    for step in bar:
        x, y = _windows(train_ids, rng.integers(0, len(train_ids) - seq_len - 1, batch), seq_len)
        loss, grads = model.loss_and_grads(x, y, num_threads)
        norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads))
        clip = min(1.0, 1.0 / (norm + 1e-12))          # clip the global gradient norm to 1
        frac = (step + 1) / warmup if step < warmup else \
            0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
        opt.step([g * clip for g in grads], lr=lr * frac)
        tokens += x.size
        history["step"].append(step)
        history["train"].append(loss)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            history["val_step"].append(step + 1)
            history["val"].append(val_loss())
        if hasattr(bar, "set_postfix"):
            rate = tokens / (time.perf_counter() - t0)
            post = {"loss": f"{loss:.3f}", "tok/s": f"{rate:,.0f}"}
            if history["val"]:
                post["val"] = f"{history['val'][-1]:.3f}"
            bar.set_postfix(post)
    seconds = time.perf_counter() - t0
    final_val = history["val"][-1]
    # a prompt the vocabulary can spell: "The " when it can, else the start of the held-out text
    prompt = "The " if all(c in vocab.index for c in "The ") else vocab.decode(val_ids[:4])
    sample_ids = (model.generate(vocab.encode(prompt), sample_len, np.random.default_rng(seed))
                  if np.isfinite(final_val) else [])
    return {"model": model, "vocab": vocab, "history": history, "val_loss": final_val,
            "baseline": baseline, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "sample": vocab.decode(sample_ids)}


RULE_TITLES = {"linear": "linear attention", "delta": "DeltaNet",
               "gated_linear": "gated linear attention", "gated_delta": "Gated DeltaNet"}


def plot_title(rules):
    """The rules a plot compares, by their names in the literature ('' or None: Gated DeltaNet,
    the default)."""
    names = [RULE_TITLES.get(r or "gated_delta", r) for r in rules]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def plot(histories, baseline, path):
    """Save the training and validation loss curves to a PNG (needs matplotlib); histories: a
    history, or a dict of them by rule (one colour each)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    if "train" in histories:
        histories = {"": histories}
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (rule, history) in enumerate(histories.items()):
        tr = np.asarray(history["train"])
        w = max(1, len(tr) // 50)
        smooth = np.convolve(tr, np.ones(w) / w, mode="valid")
        name = f"{rule} " if rule else ""
        ax.plot(np.arange(len(smooth)) + w, smooth, color=f"C{i}", alpha=0.6,
                label=f"{name}train (mean of {w} steps)" if w > 1 else f"{name}train")
        ax.plot(history["val_step"], history["val"], "o-", color=f"C{i}",
                label=f"{name}validation")
    ax.axhline(baseline, color="gray", ls="--", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title("gdn_ext: character-level language models, " + plot_title(list(histories)))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser():
    """The argparse parser of ``python -m gdn_ext [train]``."""
    ap = _cli.parser("python -m gdn_ext [train]", __doc__,
                     epilog="The main job is the default command; all of them:\n\n"
                            + _cli.commands_help())
    ap.add_argument("--steps", type=positive_int, default=800, help="training steps")
    ap.add_argument("--d-model", type=positive_int, default=128, help="model width D")
    ap.add_argument("--layers", type=positive_int, default=3, help="Gated DeltaNet layers")
    ap.add_argument("--heads", type=positive_int, default=4, help="heads per layer")
    ap.add_argument("--head-dim", type=positive_int, default=32, help="Dk = Dv per head")
    ap.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=positive_int, default=128, help="characters per sequence")
    ap.add_argument("--lr", type=positive_float, default=3e-3, help="peak Adam learning rate")
    ap.add_argument("--seed", type=non_negative_int, default=0,
                    help="seed of the weights, the batches and the sample")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="OpenMP threads of the recurrence (default: OpenMP's default thread "
                         "count)")
    ap.add_argument("--text", metavar="FILE", default=None,
                    help="train on this UTF-8 text file (default: the Python documentation that "
                         "ships with the standard library)")
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="save the loss curves to FILE.png (needs matplotlib; default: no plot)")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ap.add_argument("--rule", nargs="+", choices=list(RULES) + ["all"], default=["gated_delta"],
                    help="the token mixer's rule: linear attention, DeltaNet, gated linear "
                         "attention or Gated DeltaNet; several (or 'all') train one model each, "
                         "same weights' shapes, seed and steps, and compare them")
    return ap


def main(argv=None):
    """Command line of the main job (see the module docstring); returns the exit status:
    0 when the model ends below the unigram baseline, 1 otherwise."""
    ap = build_parser()
    a = ap.parse_args(argv)
    rules = list(RULES) if "all" in a.rule else list(dict.fromkeys(a.rule))
    if a.plot:  # fail now, not after training
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error('--plot needs matplotlib: pip install matplotlib (or pip install -e ".[plot]" '
                     "in a checkout)")
    try:
        text = load_text(a.text)
    except (OSError, UnicodeDecodeError) as exc:
        ap.error(f"--text {a.text}: {exc}")
    if len(text) < 10 * (a.seq_len + 2):
        ap.error(f"the text has {len(text)} characters; --seq-len {a.seq_len} needs at least "
                 f"{10 * (a.seq_len + 2)} (the last 10% is held out for validation)")
    # NumPy's BLAS threads spin after each small matmul and fight the kernels' OpenMP threads for
    # the cores: the model's matmuls are small, so one BLAS thread is faster overall
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        ap.error('threadpoolctl is missing: install the applications\' extra, '
                 'pip install -e ".[apps]" (in a clone)')
    results = {}
    with threadpool_limits(limits=1, user_api="blas"):
        for rule in rules:
            res = results[rule] = train(
                text, steps=a.steps, d_model=a.d_model, n_layers=a.layers, n_heads=a.heads,
                d_head=a.head_dim, batch=a.batch, seq_len=a.seq_len, lr=a.lr, seed=a.seed,
                num_threads=a.threads, progress=not a.no_progress, rule=rule)
            val, base = res["val_loss"], res["baseline"]
            if not np.isfinite(val):
                print(f"{rule}: training diverged (validation loss {val}); try a smaller --lr",
                      file=sys.stderr)
                continue
            print(f"trained {a.steps} steps in {res['seconds']:.0f} s "
                  f"({res['tokens_per_s']:,.0f} tokens/s)")
            rel = 100 * (1 - val / base)
            print(f"validation loss {val:.3f} nats/char ({val / math.log(2):.2f} bits/char) vs "
                  f"unigram baseline {base:.3f}: {abs(rel):.0f}% {'below' if rel >= 0 else 'above'}")
            print("sample:\n" + res["sample"])
    base = next(iter(results.values()))["baseline"]
    if len(rules) > 1:
        print(f"\n{'rule':<14}{'val nats/char':>14}{'bits/char':>11}{'vs unigram':>12}"
              f"{'tokens/s':>11}{'parameters':>12}")
        for rule, res in results.items():
            val = res["val_loss"]
            print(f"{rule:<14}{val:>14.3f}{val / math.log(2):>11.2f}"
                  f"{100 * (val / base - 1):>+11.0f}%{res['tokens_per_s']:>11,.0f}"
                  f"{res['model'].n_params():>12,}")
    if a.plot:
        plot({r: res["history"] for r, res in results.items()}, base, a.plot)
        print(f"loss curves saved to {a.plot}")
    return 0 if all(np.isfinite(r["val_loss"]) and r["val_loss"] < base
                    for r in results.values()) else 1
