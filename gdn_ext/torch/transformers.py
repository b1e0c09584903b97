"""The transformers patch: Qwen3-Next's (and alike) gated delta rule fallbacks replaced by
gdn_ext's drop-ins for the length of a ``with`` block."""
import inspect
import operator

from .fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

__all__ = ["patch_transformers"]

# The drop-ins' keywords (flash-linear-attention's) that the patch passes on; any other keyword
# is dropped, as transformers' own dispatcher drops what its implementation does not take (the
# layers pass the model call's **kwargs down: loss keywords, output flags, TransformersKwargs).
# q, k, v are the fallbacks' query, key, value; chunk_size is checked as transformers' fallback
# uses it and not passed on (the fallback's chunks are not gdn_ext's, which keeps its own size).
_NAMED = frozenset({"q", "k", "v", "g", "beta", "chunk_size", "initial_state",
                    "output_final_state", "use_qk_l2norm_in_kernel"})
_PASSED = {fn: frozenset(inspect.signature(fn).parameters) - _NAMED
           for fn in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)}


def _fla_keywords(fn, kwargs):
    """The keywords of ``kwargs`` that ``fn`` takes; seq_idx refused as transformers does
    when it cannot keep packed sequences apart."""
    if kwargs.get("seq_idx") is not None and kwargs.get("cu_seqlens") is None:
        raise ValueError("seq_idx without cu_seqlens: gdn_ext keeps packed sequences apart by "
                         "cu_seqlens (transformers' cu_seq_lens_q, given by "
                         "DataCollatorWithFlattening(return_flash_attn_kwargs=True))")
    return {name: val for name, val in kwargs.items() if name in _PASSED[fn]}


def _check_chunk_size(chunk_size):
    """transformers' fallback chunks by any positive integer; gdn_ext's result does not depend
    on it. Refused here: what makes the fallback fail (0, negatives, non-integers)."""
    if isinstance(chunk_size, bool):
        raise TypeError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    try:
        size = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size must be a positive integer; got {chunk_size!r}") from None
    if size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {size}")


def transformers_chunk_gated_delta_rule(query, key, value, g=None, beta=None, chunk_size=64,
                                        initial_state=None, output_final_state=False,
                                        use_qk_l2norm_in_kernel=False, **kwargs):
    """gdn_ext's :func:`chunk_gated_delta_rule` called as transformers calls
    ``torch_chunk_gated_delta_rule``: its positional order (query, key, value, g, beta,
    chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel); ``chunk_size`` any
    positive integer (ignored: the chunkwise form runs with gdn_ext's own chunk size; TypeError /
    ValueError for what the fallback cannot chunk by); flash-linear-attention's other keywords (``cu_seqlens``,
    ``scale``, ...) with their meaning there; every other keyword ignored, as the fallback
    ignores its ``**kwargs``. ``seq_idx`` without ``cu_seqlens`` is a ValueError (transformers
    refuses it without flash-linear-attention too). No value warnings unless
    ``check_values=True`` is passed: the model makes its inputs, and the fallback warns for none.

    Shapes as the fallback: query, key [B, T, H, K]; value [B, T, HV, V]; g, beta [B, T, HV];
    initial_state [B, HV, K, V]. Returns (o [B, T, HV, V], final state [B, HV, K, V] or None).
    """
    _check_chunk_size(chunk_size)
    return chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        **{'check_values': False, **_fla_keywords(chunk_gated_delta_rule, kwargs)})


def transformers_recurrent_gated_delta_rule(query, key, value, g=None, beta=None,
                                            initial_state=None, output_final_state=False,
                                            use_qk_l2norm_in_kernel=False, **kwargs):
    """gdn_ext's :func:`fused_recurrent_gated_delta_rule` called as transformers calls
    ``torch_recurrent_gated_delta_rule``: its positional order (query, key, value, g, beta,
    initial_state, output_final_state, use_qk_l2norm_in_kernel); keywords as
    :func:`transformers_chunk_gated_delta_rule` (a ``chunk_size`` is ignored, as there)."""
    return fused_recurrent_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        **{'check_values': False, **_fla_keywords(fused_recurrent_gated_delta_rule, kwargs)})


def patch_transformers(module=None):
    """Make a transformers model use gdn_ext for its gated delta rule: a context manager.

    transformers' Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo-Hybrid and models built like
    them) call the module functions ``torch_chunk_gated_delta_rule`` and
    ``torch_recurrent_gated_delta_rule`` of their modeling module, whose pure-torch fallbacks
    run when flash-linear-attention (CUDA only) is missing. Inside
    ``with gdn_ext.torch.patch_transformers():`` they are gdn_ext's
    :func:`chunk_gated_delta_rule` and :func:`fused_recurrent_gated_delta_rule`, taking every
    call the fallbacks take (see :func:`transformers_chunk_gated_delta_rule`)::

        with gdn_ext.torch.patch_transformers():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()

    module: the modeling module (default ``transformers.models.qwen3_next.modeling_qwen3_next``;
    e.g. ``transformers.models.qwen3_5.modeling_qwen3_5``,
    ``transformers.models.olmo_hybrid.modeling_olmo_hybrid``).
    Raises AttributeError if the module has no such functions.
    """
    from unittest import mock
    if module is None:
        import transformers.models.qwen3_next.modeling_qwen3_next as module
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        if not hasattr(module, name):
            raise AttributeError(f"{module.__name__} has no {name} to replace")
    return mock.patch.multiple(
        module, torch_chunk_gated_delta_rule=transformers_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule=transformers_recurrent_gated_delta_rule)
