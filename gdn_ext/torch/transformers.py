"""The transformers patch: Qwen3-Next's (and alike) gated delta rule fallbacks replaced by
gdn_ext's drop-ins for the length of a ``with`` block."""
import functools

from .fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["patch_transformers", "TRANSFORMERS_KWARGS"]

# What transformers' layers pass on to the gated delta rule in **kwargs (its TransformersKwargs
# and the model call's flags, use_cache seen from Qwen3-Next: bookkeeping that does not change
# this op's result; cu_seq_lens_q is turned into cu_seqlens by the layer itself). The patch drops these before calling the drop-ins, which
# refuse unknown keywords.
TRANSFORMERS_KWARGS = frozenset({
    "num_items_in_batch", "output_hidden_states", "output_attentions", "output_router_logits",
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids",
    "is_causal", "seq_idx", "use_cache", "return_dict", "cache_position"})


def _from_transformers(fn):
    """``fn`` called as transformers calls its fallbacks: their keyword ``chunk_size`` kept,
    TransformersKwargs dropped; transformers' positional order (q, k, v, g, beta)."""
    @functools.wraps(fn)
    def call(query, key, value, g=None, beta=None, **kwargs):
        for name in TRANSFORMERS_KWARGS & kwargs.keys():
            del kwargs[name]
        return fn(query, key, value, g=g, beta=beta, **kwargs)
    return call


def patch_transformers(module=None):
    """Make a transformers model use gdn_ext for its gated delta rule: a context manager.

    transformers' Gated DeltaNet layers (Qwen3-Next and models built like it) call the module
    functions ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` of their
    modeling module, whose pure-torch fallbacks run when flash-linear-attention (CUDA only) is
    missing. Inside ``with gdn_ext.torch.patch_transformers():`` they are gdn_ext's
    :func:`chunk_gated_delta_rule` and :func:`fused_recurrent_gated_delta_rule`::

        with gdn_ext.torch.patch_transformers():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()

    module: the modeling module (default ``transformers.models.qwen3_next.modeling_qwen3_next``).
    Raises AttributeError if the module has no such functions.
    """
    from unittest import mock
    if module is None:
        import transformers.models.qwen3_next.modeling_qwen3_next as module
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name} to replace")
    return mock.patch.multiple(
        module, torch_chunk_gated_delta_rule=_from_transformers(chunk_gated_delta_rule),
        torch_recurrent_gated_delta_rule=_from_transformers(fused_recurrent_gated_delta_rule))
