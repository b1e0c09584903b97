"""The transformers patch: Qwen3-Next's (and alike) gated delta rule fallbacks replaced by
gdn_ext's drop-ins for the length of a ``with`` block."""
from .fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["patch_transformers"]


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
    return mock.patch.multiple(module, torch_chunk_gated_delta_rule=chunk_gated_delta_rule,
                               torch_recurrent_gated_delta_rule=fused_recurrent_gated_delta_rule)
