"""gdn_ext: Gated DeltaNet on the CPU.

The gated delta rule recurrence and its backward pass over time in C (NumPy generalized ufuncs,
OpenMP over batch and heads), a pure-NumPy reference of the design note's loop, checked Python
entry points, and the design note's layer (gdn_ext.layer) with its backward and token stepping.
``python -m gdn_ext`` trains a small character-level language model made of these layers.

    o, S_T = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=alpha)
    grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, alpha=alpha)

Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464).
"""
import importlib as _importlib
import os as _os

__version__ = "0.1.0"   # the one place: pyproject.toml reads it from here

_LIBRARY = {   # public names -> the module that holds them (loaded with the compiled module)
    "layer": None, "ufuncs": None,
    "GatedDeltaNetParams": "layer", "gated_deltanet_forward": "layer",
    "gated_deltanet_backward": "layer", "gated_deltanet_step": "layer", "rmsnorm": "layer",
    "l2norm": "layer",
    "gated_delta_rule": "recurrence", "gated_delta_rule_backward": "recurrence",
    "gated_delta_rule_step": "recurrence", "openmp_enabled": "recurrence",
    "checkpoint_interval": "recurrence", "checkpoint_count": "recurrence",
    "threads": "recurrence",
}
__all__ = list(_LIBRARY) + ["GatedDeltaRuleGrads", "GatedDeltaRuleGradsG", "StepResult",
                            "LayerStepResult", "LayerGrads", "LayerCache", "reference",
                            "__version__"]

# Importable without the compiled module: the oracle and the result types.
from . import reference  # noqa: E402
from ._results import (GatedDeltaRuleGrads, GatedDeltaRuleGradsG, LayerCache,  # noqa: E402
                       LayerGrads, LayerStepResult, StepResult)

# Idle OpenMP threads sleep instead of spinning, unless the user chose (OMP_WAIT_POLICY,
# GOMP_SPINCOUNT): spinning threads take the cores from NumPy's BLAS threads and from other
# processes (measured: the main job 2.5 x slower with one busy process on 2 cores). The OpenMP
# runtime reads this once, when the extension loads it; the environment is restored afterwards so
# that runtimes loaded later (torch's own) keep their defaults.
_set_policy = "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ
if _set_policy:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
try:
    # (import_module: a missing module is reported as missing, not as a circular import)
    _core = _importlib.import_module(__name__ + "._core")  # loads the OpenMP runtime
except ImportError as _exc:
    # Not built (a source checkout) or broken: gdn_ext.reference still works; the names that
    # need the kernels raise this, saying what to do.
    _why = ("is not built" if isinstance(_exc, ModuleNotFoundError)
            else f"could not be loaded ({_exc})")
    _CORE_ERROR = ImportError(
        f"gdn_ext's compiled module gdn_ext._core {_why}. In a source checkout, build it "
        f"first: `pip install -e .` (or `python setup.py build_ext --inplace`), which needs a C "
        f"compiler (README, Install); or run from outside the source folder so that an installed "
        f"gdn_ext is found. gdn_ext.reference works without it.")
    _CORE_ERROR.__cause__ = _exc
else:
    _CORE_ERROR = None
finally:
    if _set_policy:
        del _os.environ["OMP_WAIT_POLICY"]

if _CORE_ERROR is None:
    from . import layer, ufuncs  # noqa: E402
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
