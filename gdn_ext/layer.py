"""A Gated DeltaNet layer in NumPy, its backward, and token-by-token stepping.

``gated_deltanet_forward``, line by line::

    h    = rmsnorm(x)                                  x [B, T, D]
    q    = h Wq,  k = h Wk,  v = h Wv                  [B, T, H, Dk] / [B, T, H, Dv]
    gate = sigmoid(h Wg_state),  eta = sigmoid(h Weta) [B, T, H]
    O, S = recurrence(q, k, v, alpha=gate, beta=eta)   in C (gdn_ext.gated_delta_rule)
    y    = x + O Wo

with heads, and an option (off by default: the layer's simplest form) to L2-normalise q and k the way
the paper's layer does (``x / sqrt(sum x^2 + 1e-6)``), which keeps the delta rule stable.
The backward is written out by hand in NumPy; the recurrence's backward is the C kernel.

Source: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", ICLR 2025 (arXiv:2412.06464), sections 3-4.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from . import reference
from ._checks import as_real_array, expect_shape, flag, fmt
from ._constants import L2_EPS, RMS_EPS
from ._results import LayerCache, LayerGrads, LayerStepResult
from .recurrence import (_train_backward, _train_forward, gated_delta_rule,
                         gated_delta_rule_backward, gated_delta_rule_step)

# The rule family by name: (gated, delta_rule), in the order the tutorials build it: linear
# attention, then the delta rule (DeltaNet), then gating (Mamba2's forget gate), then both.
RULES = {"linear": (False, False), "delta": (False, True), "gated_linear": (True, False),
         "gated_delta": (True, True)}

__all__ = ["RULES", "GatedDeltaNetParams", "LayerCache", "rmsnorm", "rmsnorm_backward", "l2norm",
           "l2norm_backward", "gated_deltanet_forward", "gated_deltanet_backward",
           "gated_deltanet_step"]


@dataclass(repr=False)
class GatedDeltaNetParams:
    """Weights of one Gated DeltaNet layer (``params`` of ``gated_deltanet_forward``).

    Fields (D = d_model, H = n_heads, Dk = d_key, Dv = d_value; rows index the input):
        Wq [D, H*Dk], Wk [D, H*Dk], Wv [D, H*Dv]  query / key / value projections
        Wg_state [D, H]   decay-gate projection (gate = sigmoid(h Wg_state))
        Weta [D, H]       write-strength projection (eta = sigmoid(h Weta), the recurrence's beta)
        Wo [H*Dv, D]      output projection
        norm_weight [D]   RMSNorm weight (ones at init)

    Iterating gives (name, array) pairs in that order; ``dparams`` of the backward has the same
    fields.
    """
    Wq: np.ndarray
    Wk: np.ndarray
    Wv: np.ndarray
    Wg_state: np.ndarray
    Weta: np.ndarray
    Wo: np.ndarray
    norm_weight: np.ndarray

    @classmethod
    def init(cls, d_model, d_key, d_value, n_heads=1, seed=0, dtype=np.float32):
        """Random weights: projections ~ N(0, 1/fan_in), norm weight ones.

        d_model, d_key, d_value, n_heads: positive ints (D, Dk, Dv, H). seed: for
        numpy.random.default_rng. dtype: float32 or float64. Raises ValueError otherwise."""
        for name, n in (("d_model", d_model), ("d_key", d_key), ("d_value", d_value),
                        ("n_heads", n_heads)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} must be a positive int; got {n!r}")
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64; got {dtype}")
        rng = np.random.default_rng(seed)
        D, H, Dk, Dv = d_model, n_heads, d_key, d_value

        def w(shape, fan_in):
            return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(dtype)

        return cls(Wq=w((D, H * Dk), D), Wk=w((D, H * Dk), D), Wv=w((D, H * Dv), D),
                   Wg_state=w((D, H), D), Weta=w((D, H), D), Wo=w((H * Dv, D), H * Dv),
                   norm_weight=np.ones(D, dtype))

    def __iter__(self):
        return ((f.name, getattr(self, f.name)) for f in fields(self))

    def __repr__(self):
        body = ", ".join(f"{n}={fmt(np.shape(a))}" for n, a in self)
        try:
            sizes = (f"D={self.d_model}, H={self.n_heads}, Dk={self.d_key}, Dv={self.d_value}, "
                     f"dtype={self.Wq.dtype}; ")
        except (AttributeError, IndexError, TypeError, ZeroDivisionError):
            sizes = "inconsistent: "
        return f"GatedDeltaNetParams({sizes}{body})"

    @property
    def d_model(self):
        return self.Wq.shape[0]

    @property
    def n_heads(self):
        return self.Wg_state.shape[1]

    @property
    def d_key(self):
        return self.Wq.shape[1] // self.n_heads

    @property
    def d_value(self):
        return self.Wv.shape[1] // self.n_heads

    def map(self, fn):
        """A new GatedDeltaNetParams with fn(array) for every field."""
        return GatedDeltaNetParams(**{n: fn(a) for n, a in self})

    def check(self):
        """Raise TypeError unless every field is a real ndarray, ValueError unless every field has
        the shape its role needs."""
        for n, a in self:
            if not isinstance(a, np.ndarray):
                raise TypeError(f"params.{n} must be a NumPy array; got {type(a).__name__}")
            as_real_array(a, f"params.{n}")
        if self.Wg_state.ndim != 2:
            raise ValueError(f"params.Wg_state must have shape [D, H]; got {fmt(self.Wg_state.shape)}")
        D, H = self.Wq.shape[0] if self.Wq.ndim == 2 else -1, self.Wg_state.shape[-1]
        if H < 1 or self.Wq.ndim != 2 or self.Wq.shape[1] % H or self.Wv.ndim != 2 \
                or self.Wv.shape[1] % H:
            raise ValueError("params: Wq must be [D, H*Dk], Wv [D, H*Dv] and Wg_state [D, H]; got "
                             + ", ".join(f"{n} {fmt(a.shape)}" for n, a in self))
        Dk, Dv = self.Wq.shape[1] // H, self.Wv.shape[1] // H
        want = {"Wq": ((D, H * Dk), "[D, H*Dk]"), "Wk": ((D, H * Dk), "[D, H*Dk]"),
                "Wv": ((D, H * Dv), "[D, H*Dv]"), "Wg_state": ((D, H), "[D, H]"),
                "Weta": ((D, H), "[D, H]"), "Wo": ((H * Dv, D), "[H*Dv, D]"),
                "norm_weight": ((D,), "[D]")}
        for n, a in self:
            expect_shape(a, f"params.{n}", *want[n])


def _inv_rms(x, eps):
    """1 / sqrt(mean(x**2, axis=-1) + eps), computed on x / max|x| so that x**2 cannot overflow."""
    m = np.max(np.abs(x), axis=-1, keepdims=True) if x.shape[-1] else np.ones(x.shape[:-1] + (1,))
    m = np.where(m > 0, m, 1).astype(x.dtype, copy=False)
    xs = x / m
    with np.errstate(under="ignore", over="ignore"):   # eps / m^2 -> 0 for huge rows: right
        return (1 / m) / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps / (m * m))


def _rows(x, name):
    """An array with a last axis (the one normalised); ValueError for a scalar."""
    x = as_real_array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must be an array [..., D] (normalised over its last axis); "
                         f"got a scalar")
    return x


def _weight(weight, x, name="weight"):
    weight = as_real_array(weight, name)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{name} must have shape [D] = {fmt(x.shape[-1:])} (x's last axis); got "
                         f"{fmt(weight.shape)}")
    return weight


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float = RMS_EPS) -> np.ndarray:
    """RMSNorm: ``weight * x / sqrt(mean(x**2, axis=-1) + eps)``. x [..., D], weight [D].
    Raises ValueError / TypeError for a scalar x, a weight not of shape [D], non-real input.

    Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019."""
    x = _rows(x, "x")
    weight = _weight(weight, x)
    return weight * (x * _inv_rms(x, eps))


def rmsnorm_backward(dh: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float = RMS_EPS,
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """Gradients (dx, dweight) of :func:`rmsnorm` given dh = dL/dh; dweight sums leading axes."""
    x = _rows(x, "x")
    weight = _weight(weight, x)
    dh = as_real_array(dh, "dh")
    expect_shape(dh, "dh", x.shape, "[..., D] (the shape of x)")
    r = _inv_rms(x, eps)
    xhat = x * r
    dweight = np.sum((dh * xhat).reshape(-1, x.shape[-1]), axis=0)
    dxhat = dh * weight
    # d/dx of x r(x), r = (mean(x^2) + eps)^(-1/2):  r dxhat - x r^3 mean(dxhat x)
    dx = r * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx, dweight


def l2norm(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """``x / sqrt(sum(x**2, axis=-1) + eps)`` (eps inside the root, as flash-linear-attention).
    x [..., D]; ValueError / TypeError for a scalar or non-real x."""
    return reference.l2norm(_rows(x, "x"), eps)


def l2norm_backward(dy: np.ndarray, x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    """dx of :func:`l2norm` given dy: (dy - y (y . dy)) / n with n = sqrt(sum x^2 + eps)."""
    x = _rows(x, "x")
    dy = as_real_array(dy, "dy")
    expect_shape(dy, "dy", x.shape, "[..., D] (the shape of x)")
    return reference.l2norm_backward(dy, x, eps)


def _sigmoid(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))   # no overflow warning for large |z|


def _check(x, S, params, name="x"):
    if not isinstance(params, GatedDeltaNetParams):
        raise TypeError(f"params must be a GatedDeltaNetParams; got {type(params).__name__}")
    params.check()
    x = as_real_array(x, name)
    D, H, Dk, Dv = params.d_model, params.n_heads, params.d_key, params.d_value
    if x.ndim != 3 or x.shape[-1] != D:
        if name == "x_t":
            raise ValueError(f"x_t must have shape [B, D] with D = {D}; got {fmt(x.shape[::2])}")
        raise ValueError(f"{name} must have shape [B, T, D] with D = {D}; got {fmt(x.shape)}")
    if S is not None:
        S = as_real_array(S, "S")
        expect_shape(S, "S", (x.shape[0], H, Dv, Dk), "[B, H, Dv, Dk]")
    return x, S


def _in_weights(params):
    """The five input projections side by side, [D, 2 H Dk + H Dv + 2 H]: one matrix product
    instead of five (and one each for their gradients), which BLAS runs faster."""
    return np.concatenate([params.Wq, params.Wk, params.Wv, params.Wg_state, params.Weta], axis=1)


def _projections(x, params, gated=True):
    """The layer up to the recurrence's inputs (gated=False: the gate is 1, no forgetting, and
    Wg_state is unused). q and k come raw: the kernels L2-normalise them when asked, and take
    the normalisation's gradient back to the raw q, k."""
    B, T, _ = x.shape
    H, Dk, Dv = params.n_heads, params.d_key, params.d_value
    h = rmsnorm(x, params.norm_weight)                          # [B, T, D]
    P = h @ _in_weights(params)                                 # q | k | v | gate | eta
    e = np.cumsum([H * Dk, H * Dk, H * Dv, H])
    q = P[..., :e[0]].reshape(B, T, H, Dk)
    k = P[..., e[0]:e[1]].reshape(B, T, H, Dk)
    v = P[..., e[1]:e[2]].reshape(B, T, H, Dv)
    gate = (_sigmoid(P[..., e[2]:e[3]]) if gated                 # [B, T, H], alpha
            else np.ones((B, T, H), h.dtype))
    eta = _sigmoid(P[..., e[3]:])                               # [B, T, H], beta
    return h, q, k, v, gate, eta


def _recurrence(h, q, k, v, gate, eta, S, normalize_qk, scale, num_threads, delta_rule,
                algorithm, chunk_size):
    """The recurrence's forward, keeping what its backward needs: (O, S_T, LayerCache)."""
    # the layer makes q, k, v itself, gates in [0, 1]: nothing for check_values to find
    O, S_T, ck = _train_forward(q, k, v, beta=eta, alpha=gate, initial_state=S, scale=scale,
                                num_threads=num_threads, normalize_qk=normalize_qk,
                                delta_rule=delta_rule, algorithm=algorithm,
                                chunk_size=chunk_size)
    return O, S_T, LayerCache(h, q, k, v, gate, eta, O, ck)


# The overloads tell a type checker that return_cache=True adds the cache.
@overload
def gated_deltanet_forward(x: ArrayLike, S: Optional[ArrayLike], params: GatedDeltaNetParams, *,
                           normalize_qk: bool = False, scale: float = 1.0,
                           num_threads: Optional[int] = None, delta_rule: bool = True,
                           gated: bool = True, algorithm: str = "auto",
                           chunk_size: Optional[int] = None, return_cache: Literal[False] = False,
                           ) -> Tuple[NDArray[Any], NDArray[Any]]: ...
@overload  # noqa: E302
def gated_deltanet_forward(x: ArrayLike, S: Optional[ArrayLike], params: GatedDeltaNetParams, *,
                           normalize_qk: bool = False, scale: float = 1.0,
                           num_threads: Optional[int] = None, delta_rule: bool = True,
                           gated: bool = True, algorithm: str = "auto",
                           chunk_size: Optional[int] = None, return_cache: Literal[True],
                           ) -> Tuple[NDArray[Any], NDArray[Any], LayerCache]: ...


def gated_deltanet_forward(x: ArrayLike, S: Optional[ArrayLike], params: GatedDeltaNetParams, *,
                           normalize_qk: bool = False, scale: float = 1.0,
                           num_threads: Optional[int] = None, delta_rule: bool = True,
                           gated: bool = True, algorithm: str = "auto",
                           chunk_size: Optional[int] = None, return_cache: bool = False,
                           ) -> Union[Tuple[NDArray[Any], NDArray[Any]],
                                      Tuple[NDArray[Any], NDArray[Any], LayerCache]]:
    """One Gated DeltaNet layer: ``y, S_T = gated_deltanet_forward(x, S, params)``.

    Parameters
    ----------
    x : array [B, T, D]
    S : array [B, H, Dv, Dk] or None (zeros): the recurrent state entering the layer.
    params : GatedDeltaNetParams
    normalize_qk : bool, default False
        L2-normalise q and k before the recurrence (the paper's layer; the simplest form has none).
    scale : float, default 1.0
        Read-out scale of the recurrence.
    num_threads : int or None
        OpenMP threads of the recurrence (None: OpenMP's default).
    delta_rule : bool, default True
        False: the same layer with linear attention's write (u_t = eta_t v_t), the note's
        earlier steps (gated linear attention); see :func:`gdn_ext.gated_delta_rule`.
    gated : bool, default True
        False: no forget gate (alpha = 1; Wg_state unused, its gradient 0): with
        ``delta_rule=True`` DeltaNet, with False plain linear attention. ``RULES`` names the four.
    algorithm, chunk_size
        The form of the recurrence, as :func:`gdn_ext.gated_delta_rule` ("auto": the chunkwise
        form for sequences of 64 tokens or more); pass the same to the backward.
    return_cache : bool, default False
        Also return a :class:`LayerCache` (the projections, the recurrence's output and the
        states its backward restarts from) to hand to :func:`gated_deltanet_backward` as
        ``cache=``, with the same ``algorithm`` and ``chunk_size``: a training step then runs
        the recurrence forward once, not three times, and the projections once. It holds about
        (4 Dk + 2 Dv) / D times x's size plus, per head, the state entering every chunk
        (chunkwise form) or checkpoint_count(T) states (the recurrence).

    Returns
    -------
    y : ndarray [B, T, D] = x + O Wo;  S_T : ndarray [B, H, Dv, Dk];
    cache : LayerCache, only with ``return_cache=True``.
    Computed in the promoted float dtype of x, S and params (float32 or float64).

    Raises
    ------
    ValueError, TypeError
        x or S of the wrong shape or dtype, params whose shapes do not fit together.

    Source: Yang, Kautz, Hatamizadeh, ICLR 2025, sec. 3 (the layer without its convolutions and output gate).
    """
    x, S = _check(x, S, params)
    normalize_qk = flag(normalize_qk, "normalize_qk")
    return_cache = flag(return_cache, "return_cache")
    B, T, D = x.shape
    gated = flag(gated, "gated")
    h, q, k, v, gate, eta = _projections(x, params, gated)
    if return_cache:
        O, S_T, cache = _recurrence(h, q, k, v, gate, eta, S, normalize_qk, scale, num_threads,
                                    delta_rule, algorithm, chunk_size)
    else:
        # the layer makes q, k, v itself, gates in [0, 1]: nothing for check_values to find
        O, S_T = gated_delta_rule(q, k, v, beta=eta, alpha=gate, initial_state=S, scale=scale,
                                  num_threads=num_threads, normalize_qk=normalize_qk,
                                  check_values=False, delta_rule=delta_rule,
                                  algorithm=algorithm, chunk_size=chunk_size)
    y = x + O.reshape(B, T, params.n_heads * params.d_value) @ params.Wo
    return (y, S_T, cache) if return_cache else (y, S_T)


def gated_deltanet_backward(dy: ArrayLike, x: ArrayLike, S: Optional[ArrayLike],
                            params: GatedDeltaNetParams, dS_T: Optional[ArrayLike] = None, *,
                            normalize_qk: bool = False, scale: float = 1.0,
                            num_threads: Optional[int] = None, delta_rule: bool = True,
                            gated: bool = True, cache: Optional[LayerCache] = None,
                            algorithm: str = "auto", chunk_size: Optional[int] = None,
                            ) -> LayerGrads:
    """Backward of :func:`gated_deltanet_forward`: ``dx, dS, dparams``.

    Runs the recurrence's backward in C (:func:`gdn_ext.gated_delta_rule_backward`, from the
    forward's checkpoints) and the rest in NumPy. Without ``cache`` it first recomputes the
    projections and the recurrence's forward (once, keeping O and the checkpoints).

    Parameters
    ----------
    dy : array [B, T, D]   gradient of the loss with respect to y.
    x, S, params, normalize_qk, scale, num_threads, algorithm, chunk_size : as for the forward.
    dS_T : array [B, H, Dv, Dk] or None   gradient with respect to the final state.
    cache : LayerCache or None
        What ``gated_deltanet_forward(..., return_cache=True)`` returned for these same x, S,
        params and options (not checked beyond its shapes: a cache of other inputs gives the
        gradients of those).

    Returns
    -------
    dx : ndarray [B, T, D];  dS : ndarray [B, H, Dv, Dk] (also when S was None);
    dparams : GatedDeltaNetParams of gradients, each the shape of its weight.

    Raises
    ------
    ValueError, TypeError as the forward; also dy or dS_T of the wrong shape, a cache that is
    not a LayerCache (TypeError) or whose h is not x's shape (ValueError).
    """
    x, S = _check(x, S, params)
    normalize_qk = flag(normalize_qk, "normalize_qk")
    dy = as_real_array(dy, "dy")
    expect_shape(dy, "dy", x.shape, "[B, T, D]")
    B, T, D = x.shape
    H, Dv = params.n_heads, params.d_value
    gated = flag(gated, "gated")
    if cache is None:
        cache = _recurrence(*_projections(x, params, gated), S, normalize_qk, scale, num_threads,
                            delta_rule, algorithm, chunk_size)[2]
    elif not isinstance(cache, LayerCache):
        raise TypeError(f"cache must be the LayerCache of gated_deltanet_forward(..., "
                        f"return_cache=True); got {type(cache).__name__}")
    else:
        expect_shape(cache.h, "cache.h", x.shape, "[B, T, D] (the shape of x)")
    h, q, k, v, gate, eta, O, ck = cache

    # y = x + O Wo
    O2 = O.reshape(B * T, H * Dv)
    dy2 = dy.reshape(B * T, D)
    dWo = O2.T @ dy2
    dO = (dy2 @ params.Wo.T).reshape(B, T, H, Dv)
    # O, S_T = recurrence(q, k, v, alpha=gate, beta=eta, S), q and k normalised in the kernel
    g = _train_backward(dO, q, k, v, beta=eta, alpha=gate, initial_state=S, dS_T=dS_T,
                        scale=scale, num_threads=num_threads, delta_rule=delta_rule,
                        normalize_qk=normalize_qk, checkpoints=ck, algorithm=algorithm,
                        chunk_size=chunk_size)
    dq, dk = g.dq, g.dk
    # gate = sigmoid(h Wg_state), eta = sigmoid(h Weta)
    dg_pre = g.dalpha * gate * (1 - gate) if gated else np.zeros_like(gate)
    de_pre = g.dbeta * eta * (1 - eta)
    # q = h Wq, k = h Wk, v = h Wv
    h2 = h.reshape(B * T, D)
    dP = np.concatenate([d.reshape(B * T, W.shape[1]) for d, W in
                         ((dq, params.Wq), (dk, params.Wk), (g.dv, params.Wv),
                          (dg_pre, params.Wg_state), (de_pre, params.Weta))], axis=1)
    dW = np.split(h2.T @ dP, np.cumsum([W.shape[1] for W in (params.Wq, params.Wk, params.Wv,
                                                             params.Wg_state)]), axis=1)
    dh = (dP @ _in_weights(params).T).reshape(B, T, D)
    # h = rmsnorm(x)
    dx_norm, dnorm = rmsnorm_backward(dh, x, params.norm_weight)
    dparams = GatedDeltaNetParams(Wq=dW[0], Wk=dW[1], Wv=dW[2], Wg_state=dW[3], Weta=dW[4],
                                  Wo=dWo, norm_weight=dnorm)
    return LayerGrads(dy + dx_norm, g.d_initial_state, dparams)


def gated_deltanet_step(x_t: ArrayLike, S: Optional[ArrayLike], params: GatedDeltaNetParams, *,
                        normalize_qk: bool = False, scale: float = 1.0,
                        num_threads: Optional[int] = None, delta_rule: bool = True,
                        gated: bool = True) -> LayerStepResult:
    """One token through the layer: ``y_t, S_new = gated_deltanet_step(x_t, S, params)``.

    x_t [B, D]; S [B, H, Dv, Dk] or None (zeros); normalize_qk, scale, num_threads as for
    :func:`gated_deltanet_forward`. Returns y_t [B, D] and the new state [B, H, Dv, Dk]. Feeding a
    sequence token by token gives what :func:`gated_deltanet_forward` gives for the whole of it,
    up to rounding (the projections' matrix products may sum in another order).
    Raises ValueError / TypeError for inputs of the wrong shape or dtype."""
    x_t = as_real_array(x_t, "x_t")
    if x_t.ndim != 2:
        raise ValueError(f"x_t must have shape [B, D]; got {fmt(x_t.shape)}")
    normalize_qk = flag(normalize_qk, "normalize_qk")
    x, S = _check(x_t[:, None, :], S, params, name="x_t")
    gated = flag(gated, "gated")
    h, q, k, v, gate, eta = _projections(x, params, gated)
    o, S_new = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta=eta[:, 0],
                                     alpha=gate[:, 0], state=S, scale=scale,
                                     num_threads=num_threads, normalize_qk=normalize_qk,
                                     check_values=False, delta_rule=delta_rule)
    return LayerStepResult(x_t + o.reshape(x_t.shape[0], params.n_heads * params.d_value) @ params.Wo,
                           S_new)
