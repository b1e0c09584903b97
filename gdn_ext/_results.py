"""The named tuples the public functions return, printed compactly (shapes and dtypes, not every
number: a notebook cell should not fill the screen). Pure Python + NumPy: the reference imports
them without the compiled module."""
from collections import namedtuple

__all__ = ["GatedDeltaRuleGrads", "GatedDeltaRuleGradsG", "StepResult", "LayerStepResult", "LayerGrads",
           "LayerCache", "describe"]


def describe(x):
    """A short description of a result: an array's shape and dtype, else its repr."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"array(shape={list(shape)}, dtype={dtype})"
    return repr(x)


class _Compact:
    """Mixin for a namedtuple of arrays: ``repr`` lists each field's shape and dtype."""
    __slots__ = ()

    def __repr__(self):
        body = ", ".join(f"{n}={describe(x)}" for n, x in zip(self._fields, self))
        return f"{type(self).__name__}({body})"


class GatedDeltaRuleGrads(_Compact, namedtuple("GatedDeltaRuleGrads",
                                               ["dq", "dk", "dv", "dbeta", "dalpha",
                                                "d_initial_state"])):
    """Gradients of gated_delta_rule when the gate was given as alpha.
    Each field has the shape of its input (d_initial_state: of the state) and the dtype the
    computation ran in (float32 or float64)."""
    __slots__ = ()


class GatedDeltaRuleGradsG(_Compact, namedtuple("GatedDeltaRuleGradsG",
                                                ["dq", "dk", "dv", "dbeta", "dg",
                                                 "d_initial_state"])):
    """Gradients of gated_delta_rule when the gate was given as log decay g (dg = alpha *
    dalpha). Each field has the shape of its input and the dtype the computation ran in (float32
    or float64)."""
    __slots__ = ()


class StepResult(_Compact, namedtuple("StepResult", ["o", "state"])):
    """One decoding step's results: ``o`` the read-out of the token, ``state`` the new state
    (a tuple: ``o_t, S_t = gated_delta_rule_step(...)`` unpacks it)."""
    __slots__ = ()


class LayerStepResult(_Compact, namedtuple("LayerStepResult", ["y", "state"])):
    """The layer's decoding step: ``y`` the layer's output for the token (residual included),
    ``state`` the new state; unpacks as ``y_t, S_t``."""
    __slots__ = ()


class LayerGrads(_Compact, namedtuple("LayerGrads", ["dx", "d_initial_state", "dparams"])):
    """Gradients of the layer: ``dx`` of its input, ``d_initial_state`` of its state, ``dparams``
    of its weights (a GatedDeltaNetParams); unpacks as ``dx, dS, dparams``."""
    __slots__ = ()


class LayerCache(_Compact, namedtuple("LayerCache", ["h", "q", "k", "v", "gate", "eta", "O",
                                                    "checkpoints"])):
    """What ``gated_deltanet_forward(..., return_cache=True)`` keeps for its backward, so that
    a training step runs the recurrence forward once: ``h`` = rmsnorm(x) [B, T, D]; ``q``, ``k``
    [B, T, H, Dk] (before any L2 normalisation, which the kernels do); ``v`` [B, T, H, Dv];
    ``gate``, ``eta`` [B, T, H]; ``O`` the recurrence's output [B, T, H, Dv]; ``checkpoints``
    the recurrence's states every checkpoint_interval(T) steps (gated_delta_rule's
    ``return_checkpoints``). Computed in the layer's dtype; read-only by convention."""
    __slots__ = ()
