"""gdn_ext: Gated DeltaNet on the CPU.

The gated delta rule recurrence and its backward pass over time in C (NumPy generalized ufuncs,
OpenMP over batch and heads), a pure-NumPy reference loop, checked Python
entry points, and a whole Gated DeltaNet layer (gdn_ext.layer) with its backward and token stepping.
``python -m gdn_ext`` trains a small character-level language model made of these layers.

    o, S_T = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=alpha)
    grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, alpha=alpha)

Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464).
"""
__version__ = "0.1.0"   # the one place: pyproject.toml reads it from here

_LIBRARY = {   # public names -> the module that holds them (loaded with the compiled module)
    "layer": None, "ufuncs": None,
    "GatedDeltaNetParams": "layer", "gated_deltanet_forward": "layer",
    "gated_deltanet_backward": "layer", "gated_deltanet_step": "layer", "rmsnorm": "layer",
    "l2norm": "layer",
    "gated_delta_rule": "recurrence", "gated_delta_rule_backward": "recurrence",
    "gated_delta_rule_step": "recurrence", "openmp_enabled": "recurrence",
    "checkpoint_interval": "recurrence", "checkpoint_count": "recurrence",
    "threads": "recurrence", "empty_cache": "_cache", "memory_reserved": "_cache",
    "set_cache_limit": "_cache",
}
__all__ = [   # written out (not computed from _LIBRARY), so that type checkers read it
    "layer", "ufuncs", "GatedDeltaNetParams", "gated_deltanet_forward", "gated_deltanet_backward",
    "gated_deltanet_step", "rmsnorm", "l2norm", "gated_delta_rule", "gated_delta_rule_backward",
    "gated_delta_rule_step", "openmp_enabled", "checkpoint_interval", "checkpoint_count",
    "threads", "empty_cache", "memory_reserved", "set_cache_limit", "GatedDeltaRuleOutput",
    "GatedDeltaRuleOutputWithCheckpoints",
    "GatedDeltaRuleGrads", "GatedDeltaRuleGradsG", "StepResult", "LayerStepResult", "LayerGrads",
    "LayerCache", "ChunkIntermediates", "reference", "__version__"]

# Importable without the compiled module: the oracle and the result types.
from . import reference  # noqa: E402
from ._results import (ChunkIntermediates, GatedDeltaRuleGrads,  # noqa: E402
                       GatedDeltaRuleGradsG, GatedDeltaRuleOutput,
                       GatedDeltaRuleOutputWithCheckpoints, LayerCache, LayerGrads,
                       LayerStepResult, StepResult)

# The compiled module, loaded by _native (which holds the error to raise when it is missing)
from ._native import CORE_ERROR as _CORE_ERROR  # noqa: E402

if _CORE_ERROR is None:
    from . import layer, ufuncs  # noqa: E402
    from ._cache import empty_cache, memory_reserved, set_cache_limit  # noqa: E402
    from .layer import (GatedDeltaNetParams, gated_deltanet_backward,  # noqa: E402
                        gated_deltanet_forward, gated_deltanet_step, l2norm, rmsnorm)
    from .recurrence import (checkpoint_count, checkpoint_interval, gated_delta_rule,  # noqa: E402
                             gated_delta_rule_backward, gated_delta_rule_step, openmp_enabled,
                             threads)
else:
    def __getattr__(name):
        if name in _LIBRARY:
            raise _CORE_ERROR
        raise AttributeError(f"module 'gdn_ext' has no attribute {name!r}")
