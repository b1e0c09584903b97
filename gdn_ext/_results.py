"""The named tuples the public functions return, printed compactly (shapes and dtypes, not every
number: a notebook cell should not fill the screen). Pure Python + NumPy: the reference imports
them without the compiled module. Typed (``typing.NamedTuple``), so that a type checker knows
each field is an array."""
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

__all__ = ["GatedDeltaRuleOutput", "GatedDeltaRuleOutputWithCheckpoints", "GatedDeltaRuleGrads",
           "GatedDeltaRuleGradsG", "ChunkIntermediates", "StepResult", "LayerStepResult", "LayerGrads", "LayerCache",
           "describe"]

Array = NDArray[np.floating[Any]]


def describe(x: object) -> str:
    """A short description of a result: an array's shape and dtype, else its repr."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"array(shape={list(shape)}, dtype={dtype})"
    return repr(x)


def _compact_repr(self: Any) -> str:
    """``repr`` of a named tuple of arrays: each field's shape and dtype."""
    body = ", ".join(f"{n}={describe(x)}" for n, x in zip(self._fields, self))
    return f"{type(self).__name__}({body})"


class GatedDeltaRuleOutput(NamedTuple):
    """What gated_delta_rule returns: ``o`` [B, T, HV, Dv] (the read-outs) and ``S_T`` the final
    state; unpacks as ``o, S_T``. (With ``output_final_state=False`` S_T is None, and the
    function's declared type says so: a tuple of an array and None.)"""
    o: Array
    S_T: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class GatedDeltaRuleOutputWithCheckpoints(NamedTuple):
    """What gated_delta_rule returns with ``return_checkpoints=True``: ``o``, ``S_T`` as
    GatedDeltaRuleOutput, and ``checkpoints`` (the states the backward restarts from); unpacks
    as ``o, S_T, checkpoints``."""
    o: Array
    S_T: Array
    checkpoints: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class GatedDeltaRuleGrads(NamedTuple):
    """Gradients of gated_delta_rule when the gate was given as alpha.
    Each field has the shape its input was given in (d_initial_state: of the state) and the
    dtype the computation ran in (float32 or float64)."""
    dq: Array
    dk: Array
    dv: Array
    dbeta: Array
    dalpha: Array
    d_initial_state: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class GatedDeltaRuleGradsG(NamedTuple):
    """Gradients of gated_delta_rule when the gate was given as log decay g (dg = alpha *
    dalpha). Each field has the shape its input was given in and the dtype the computation ran
    in (float32 or float64)."""
    dq: Array
    dk: Array
    dv: Array
    dbeta: Array
    dg: Array
    d_initial_state: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class StepResult(NamedTuple):
    """One decoding step's results: ``o`` the read-out of the token, ``state`` the new state
    (a tuple: ``o_t, S_t = gated_delta_rule_step(...)`` unpacks it)."""
    o: Array
    state: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class LayerStepResult(NamedTuple):
    """The layer's decoding step: ``y`` the layer's output for the token (residual included),
    ``state`` the new state; unpacks as ``y_t, S_t``."""
    y: Array
    state: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class LayerGrads(NamedTuple):
    """Gradients of the layer: ``dx`` of its input, ``d_initial_state`` of its state, ``dparams``
    of its weights (a GatedDeltaNetParams); unpacks as ``dx, dS, dparams``."""
    dx: Array
    d_initial_state: Array
    dparams: Any

    def __repr__(self) -> str:
        return _compact_repr(self)


class LayerCache(NamedTuple):
    """What ``gated_deltanet_forward(..., return_cache=True)`` keeps for its backward, so that
    a training step runs the recurrence forward once: ``h`` = rmsnorm(x) [B, T, D]; ``q``, ``k``
    [B, T, H, Dk] (before any L2 normalisation, which the kernels do); ``v`` [B, T, H, Dv];
    ``gate``, ``eta`` [B, T, H]; ``O`` the recurrence's output [B, T, H, Dv]; ``checkpoints``
    the states the backward restarts from: those entering the chunks of the chunkwise form,
    else the recurrence's every checkpoint_interval(T) steps (gated_delta_rule's
    ``return_checkpoints``). Computed in the layer's dtype; read-only by convention."""
    h: Array
    q: Array
    k: Array
    v: Array
    gate: Array
    eta: Array
    O: Array
    checkpoints: Array

    def __repr__(self) -> str:
        return _compact_repr(self)


class ChunkIntermediates(NamedTuple):
    """What ``gdn_ext.reference.chunk_gated_delta_rule(..., return_intermediates=True)`` returns:
    the output, the final state and the pieces a chunk kernel is built from, by
    flash-linear-attention's names and in its layouts (NT chunks of C tokens; the last chunk's
    rows past T are zero):

    - ``o`` [B, T, HV, Dv], ``S_T`` [B, HV, Dv, Dk] (gdn_ext's layout), as gated_delta_rule;
    - ``g_cumsum`` [B, T, HV]: the log decay summed from the start of each chunk, G_i;
    - ``A`` [B, HV, NT, C, C]: (I + strictly_lower(diag(beta) (K K^T o Gamma)))^-1, the UT
      transform (unit lower-triangular);
    - ``w`` [B, T, HV, Dk]: A diag(beta e^G) K;  ``u`` [B, T, HV, Dv]: A diag(beta) V;
    - ``h`` [B, NT, HV, Dk, Dv]: the state entering each chunk, transposed (H = S^T);
    - ``v_new`` [B, T, HV, Dv]: u - w H, what each token really writes."""
    o: Array
    S_T: Array
    g_cumsum: Array
    A: Array
    w: Array
    u: Array
    h: Array
    v_new: Array

    def __repr__(self) -> str:
        return _compact_repr(self)
