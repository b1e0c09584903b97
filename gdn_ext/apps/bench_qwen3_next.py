"""``python -m gdn_ext bench-qwen3-next``: a Qwen3-Next model's forward + backward on the CPU with
transformers' pure-torch gated delta rule versus gdn_ext's (:func:`gdn_ext.torch.patch_transformers`).

Builds a small randomly initialised Qwen3-Next (no download; needs transformers and torch), checks
that both paths give the same loss, and prints the median time of forward + backward for each and
their ratio. Times are wall-clock on this machine, median of ``--repeat`` runs after a warm-up.
"""
from . import _cli
from ._cli import positive_int
from .bench import _timeit as _time

__all__ = ["tiny_qwen3_next", "build_parser", "main"]


def tiny_qwen3_next(dtype=None, hidden_size=64, linear_layers=1, full_layers=1, head_dim=16,
                    k_heads=2, v_heads=4, vocab_size=128):
    """A randomly initialised Qwen3-Next for causal LM with small widths and dense MLPs
    (grouped-GEMM experts have no float64 kernel). Seed torch first for reproducible weights."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    n = linear_layers + full_layers
    cfg = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 3 // 2,
        num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        linear_conv_kernel_dim=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        mlp_only_layers=list(range(n)),
        layer_types=["linear_attention"] * linear_layers + ["full_attention"] * full_layers,
        max_position_embeddings=65536)
    return Qwen3NextForCausalLM(cfg).to(dtype or torch.float32).train()


def build_parser():
    """The argparse parser of ``python -m gdn_ext bench-qwen3-next``."""
    ap = _cli.parser("python -m gdn_ext bench-qwen3-next", __doc__)
    ap.add_argument("--batch", type=positive_int, default=2, help="sequences per batch")
    ap.add_argument("--seq-len", type=positive_int, nargs="+", default=[256, 1024, 4096],
                    metavar="T", help="sequence lengths, one timing row each")
    ap.add_argument("--hidden", type=positive_int, default=256, help="the model's hidden size")
    ap.add_argument("--head-dim", type=positive_int, default=64,
                    help="Dk = Dv of the Gated DeltaNet (and attention) heads")
    ap.add_argument("--linear-layers", type=positive_int, default=2,
                    help="Gated DeltaNet layers (followed by one attention layer)")
    ap.add_argument("--repeat", type=positive_int, default=3,
                    help="timed runs per path, after a warm-up; the median is shown")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch and OpenMP threads (default: torch's default thread count)")
    return ap


def main(argv=None):
    """Command line of ``python -m gdn_ext bench-qwen3-next``; returns 0."""
    a = build_parser().parse_args(argv)    # before importing torch: --help works without it
    import torch
    from transformers.utils import logging as hf_logging

    from ..torch import patch_transformers
    hf_logging.set_verbosity_error()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = tiny_qwen3_next(torch.float32, hidden_size=a.hidden, linear_layers=a.linear_layers,
                            full_layers=1, head_dim=a.head_dim, k_heads=2, v_heads=4)
    print(f"Qwen3-Next, {a.linear_layers} Gated DeltaNet layers + 1 attention layer, hidden {a.hidden}, 2 key / 4 value "
          f"heads of {a.head_dim}, batch {a.batch}, float32, {torch.get_num_threads()} torch threads")
    print(f"{'T':>6} {'transformers fallback':>22} {'gdn_ext':>10} {'speed-up':>9}  loss diff")
    for T in a.seq_len:
        ids = torch.randint(0, 128, (a.batch, T), generator=torch.Generator().manual_seed(T))
        losses = {}

        def step(tag):
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses[tag] = loss.item()

        t_hf = _time(lambda: step("hf"), a.repeat)
        with patch_transformers():
            t_gdn = _time(lambda: step("gdn"), a.repeat)
        print(f"{T:>6} {t_hf * 1e3:>19.1f} ms {t_gdn * 1e3:>7.1f} ms {t_hf / t_gdn:>8.2f}x  "
              f"{abs(losses['hf'] - losses['gdn']):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
