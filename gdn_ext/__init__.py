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
import os as _os

# Idle OpenMP threads sleep instead of spinning, unless the user chose (OMP_WAIT_POLICY,
# GOMP_SPINCOUNT): spinning threads take the cores from NumPy's BLAS threads and from other
# processes (measured: the main job 2.5 x slower with one busy process on 2 cores). The OpenMP
# runtime reads this once, when the extension loads it; the environment is restored afterwards so
# that runtimes loaded later (torch's own) keep their defaults.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        from . import _core  # noqa: F401  (loads the OpenMP runtime)
    except ImportError:
        pass   # recurrence.py's import below reports it
    finally:
        del _os.environ["OMP_WAIT_POLICY"]

from . import layer, reference, ufuncs
from .layer import (GatedDeltaNetParams, gated_deltanet_backward, gated_deltanet_forward,
                    gated_deltanet_step, l2norm, rmsnorm)
from .recurrence import (GatedDeltaRuleGrads, GatedDeltaRuleGradsG, checkpoint_count,
                         checkpoint_interval,
                         gated_delta_rule, gated_delta_rule_backward, gated_delta_rule_step,
                         openmp_enabled)

__version__ = "0.1.0"

__all__ = ["gated_delta_rule", "gated_delta_rule_backward", "gated_delta_rule_step", "GatedDeltaRuleGrads",
           "GatedDeltaRuleGradsG", "openmp_enabled", "checkpoint_interval", "checkpoint_count", "GatedDeltaNetParams",
           "gated_deltanet_forward", "gated_deltanet_backward", "gated_deltanet_step", "rmsnorm",
           "l2norm", "layer", "reference", "ufuncs", "__version__"]
