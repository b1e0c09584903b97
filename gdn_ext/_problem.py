"""One call of the checked API, checked and laid out for the kernels, in three steps:

1. the forms: every input as an array of real numbers, the one-token (step) and single-head forms
   brought to the general [B, T, H, D] form (so the rest has one case);
2. the shapes: q, k, v, beta, the gate, packed sequences and the state checked against each other,
   each error naming the argument and the shape it expected in the user's own form;
3. the views: the kernels' [B, H, G, T, D] views of the inputs (no copies) and the outputs.

Loop dimensions are (B, H, G): batch, query/key head, value head within its group (HV = H * G
value heads; value head hv reads query/key head hv // G). The plain case (scalar gate, no
normalisation, not packed) runs the scalar-gate ufunc pair; the rest runs the general pair, whose
states carry a sequence axis NS (1 unless packed).
"""
import numpy as np

from ._native import _core
from ._checks import (as_real_array, compute_dtype, converted, expect_shape, flag, fmt,
                      gate_axis_note, head_first_message, real_scalar, value_messages, warn)

__all__ = []  # private: the front ends use _Problem and packed_sequences


class _Names:
    """How the user's arguments and shapes are spelled in messages: the step API has no T axis
    and calls its arguments q_t, k_t, v_t and state; the single-head form has no head axis."""

    def __init__(self, step):
        self.step = step
        sfx = "_t" if step else ""
        self.q, self.k, self.v = "q" + sfx, "k" + sfx, "v" + sfx
        self.state = "state" if step else "initial_state"

    def lay(self, *dims):
        """A layout such as [B, T, H, Dk], without T for the step API."""
        return "[" + ", ".join(d for d in dims if not (self.step and d == "T")) + "]"

    def user(self, shape, single_head=False):
        """A shape of the general form as the user passed it (no T axis for the step API, no
        head axis in the single-head form)."""
        shape = list(shape)
        if single_head and len(shape) >= 3:
            shape = shape[:2] + shape[3:]
        return shape[:1] + shape[2:] if self.step else shape


_BROADCASTS = (" (a scalar, or an array that broadcasts to that shape by NumPy's rules, aligned "
               "at the right, works too)")


def _pick_gate(alpha, g):
    """(name, value) of the one gate given; ValueError for both or neither."""
    if (alpha is None) == (g is None):
        raise ValueError("give exactly one of alpha (decay in [0, 1]) and g (log decay, "
                         "alpha = exp(g)); got " + ("both" if alpha is not None else "neither"))
    return ("alpha", alpha) if alpha is not None else ("g", g)


def _with_axis(a, axis, name, layout):
    """``a`` with a new axis of size 1 at ``axis``; ValueError (not IndexError) when ``a`` has
    too few dimensions for that, e.g. a scalar where an array is required. ``layout()`` gives the
    expected layout for the message (built only then: decoding calls this per token)."""
    if a.ndim < axis:
        got = "a scalar" if a.ndim == 0 else f"shape {fmt(a.shape)}"
        raise ValueError(f"{name} must be an array of shape {layout()}; got {got}")
    return a.reshape(a.shape[:axis] + (1,) + a.shape[axis:])


def packed_sequences(cu_seqlens, B, T):
    """(cu [N + 1] int64, N, the longest sequence's length) of FlashAttention's packed batch
    cu_seqlens, checked against q's B and T: every front end's one check of it. Not packed
    (None): ([0, T], 1, T)."""
    if cu_seqlens is None:
        return np.array([0, T], np.int64), 1, T
    try:
        cu = np.asarray(cu_seqlens)
    except ValueError as exc:   # ragged nested lists
        raise TypeError(f"cu_seqlens must be an integer array [N + 1]: {exc}") from None
    if cu.dtype.kind not in "iu" and cu.size > 0:   # ([] is float64: a shape error)
        raise TypeError(f"cu_seqlens must be an integer array [N + 1]; got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must have shape [N + 1] with N >= 1; got {fmt(cu.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T, so B must be 1; got B = {B}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got {int(cu[0])}")
    cu = cu.astype(np.int64)
    lengths = np.diff(cu)
    if np.any(lengths < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing; got {cu.tolist()}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {T}, the packed length; got {int(cu[-1])}")
    return cu, cu.size - 1, int(lengths.max())


class _Problem:
    """A checked call: its sizes (B, T, H, G, HV, Dk, Dv, NS), options, and the kernels' views
    q, k, v, alpha, beta, S0 (see the module docstring). ``step=True`` checks the one-token
    shapes of gated_delta_rule_step instead (no T axis). ``views=False`` stops after the checks
    (no views, no conversions)."""

    def __init__(self, q, k, v, beta, alpha, g, initial_state, scale, normalize_qk=False,
                 cu_seqlens=None, extra=(), step=False, check_values=True, delta_rule=True,
                 num_threads=1, views=True, backward=False):
        self.names = _Names(step)
        # threads for the conversions of large inputs (run_pieces); 0: OpenMP's default count
        self.num_threads = num_threads
        self.scale = real_scalar(scale, "scale")
        self.normalize_qk = flag(normalize_qk, "normalize_qk")
        check_values = flag(check_values, "check_values")
        self.delta_rule = flag(delta_rule, "delta_rule")
        self.gate_name, gate = _pick_gate(alpha, g)
        # Python numbers are weak, as in NumPy (NEP 50): beta=0.5 keeps float32 inputs float32
        weak = [type(beta) in (int, float), type(gate) in (int, float)]
        q, k, v, beta, gate, s0 = self._read_forms(q, k, v, beta, gate, initial_state)
        self._check_shapes(q, k, v, beta, gate)
        self._check_packed(cu_seqlens)
        self._check_state(s0)
        strong = [a for a, w in zip((beta, gate), weak) if not w]
        self.dtype = compute_dtype([q, k, v] + strong + ([s0] if s0 is not None else [])
                                   + list(extra))
        if views:
            self._preflight(backward)
        if check_values:
            self._warn_unusual(k, beta, gate)
        if views:   # False: shapes only (gdn_ext.dask checks its lazy arrays' shapes here)
            self._build_views(q, k, v, beta, gate, s0)

    # 1. the forms ------------------------------------------------------------------------------
    def _read_forms(self, q, k, v, beta, gate, s0):
        """Arrays in the general form: q, k [B, T, H, Dk], v [B, T, HV, Dv], beta [B, T(, 1)]
        or [B, T, HV], the gate as given (with its T axis); s0 as given or None."""
        n = self.names
        q = as_real_array(q, n.q)
        if n.step and q.ndim not in (2, 3):
            raise ValueError(f"{n.q} must have shape [B, H, Dk] (or [B, Dk], the single-head "
                             f"form); got {'a scalar' if q.ndim == 0 else 'shape ' + fmt(q.shape)}")
        if not n.step and q.ndim not in (3, 4):
            raise ValueError(f"{n.q} must have shape [B, T, H, Dk] (or [B, T, Dk], the "
                             f"single-head form); got "
                             f"{'a scalar' if q.ndim == 0 else 'shape ' + fmt(q.shape)}")
        self.single_head = q.ndim == (2 if n.step else 3)
        sh = self.single_head
        k = as_real_array(k, n.k)
        v = as_real_array(v, n.v)
        beta = as_real_array(beta, "beta")
        gate = as_real_array(gate, self.gate_name)
        s0 = None if s0 is None else as_real_array(s0, n.state)
        beta, gate = self._broadcast(q, v, beta, gate)
        if n.step:   # one token: add the T axis
            q = q[:, None]
            k = _with_axis(k, 1, n.k,
                           lambda: n.lay("B", "Dk") if sh else n.lay("B", "H", "Dk"))
            v = _with_axis(v, 1, n.v,
                           lambda: n.lay("B", "Dv") if sh else n.lay("B", "HV", "Dv"))
            beta = _with_axis(beta, 1, "beta", lambda: "[B]" if sh else "[B, HV]")
            gate = _with_axis(gate, 1, self.gate_name, lambda: "[B]" if sh else "[B, HV]")
        if sh:       # the single-head form is H = HV = 1
            q = q[:, :, None]
            k = _with_axis(k, 2, n.k, lambda: n.lay("B", "T", "Dk"))
            v = _with_axis(v, 2, n.v, lambda: n.lay("B", "T", "Dv"))
        return q, k, v, beta, gate, s0

    def _broadcast(self, q, v, beta, gate):
        """beta and the gate broadcast (NumPy's rules) to one per head, [B, T, HV] ([B, T]
        single-head; no T for the step API), or, for a gate with one dimension more, to one per
        key channel [.., Dk]. The shapes given are kept for the gradients (beta_given,
        gate_given; None when given in full). Shapes that do not broadcast are left for
        _check_shapes to name."""
        self.beta_given = self.gate_given = None
        self.shape_notes = []   # warnings about shapes a user may not mean (with check_values)
        step, sh = self.names.step, self.single_head
        if v.ndim != q.ndim:
            return beta, gate
        lead = q.shape[:1] if step else q.shape[:2]
        per_head = lead if sh else lead + v.shape[-2:-1]
        Dk = q.shape[-1]
        per_key = per_head + (Dk,)
        exact = {per_head, per_key} | ({per_head + (1,)} if sh else set())

        def fit(a, name, per_key_ok):
            if a.shape in exact and (per_key_ok or a.shape != per_key):
                return a, None
            target = per_key if per_key_ok and a.ndim == len(per_head) + 1 else per_head
            if sh and not per_key_ok and a.ndim == len(per_head) + 1 and a.shape[-1] == 1:
                target = per_head + (1,)      # the single-head beta's [B, T, 1], broadcast
            if a.ndim > len(target):
                return a, None
            try:
                full = np.broadcast_to(a, target)
            except ValueError:
                return a, None
            note = per_key_ok and target == per_head and gate_axis_note(name, a.shape,
                                                                        per_head, Dk)
            if note:
                self.shape_notes.append(note)
            return full, a.shape
        beta, self.beta_given = fit(beta, "beta", False)
        gate, self.gate_given = fit(gate, self.gate_name, True)
        return beta, gate

    # 2. the shapes -----------------------------------------------------------------------------
    def _check_shapes(self, q, k, v, beta, gate):
        """Sizes from q, then k, v, beta and the gate checked against them."""
        n, sh = self.names, self.single_head
        B, T, H, Dk = q.shape
        if Dk == 0:
            raise ValueError(f"{n.q} and {n.k} must have Dk >= 1 key channels; got "
                             f"{n.q} of shape {fmt(n.user(q.shape, sh))}")
        if k.shape != q.shape:
            q_lay = n.lay("B", "T", "Dk") if sh else n.lay("B", "T", "H", "Dk")
            raise ValueError(f"{n.k} must have shape {q_lay} (the shape of {n.q}) = "
                             f"{fmt(n.user(q.shape, sh))}; got {fmt(n.user(k.shape, sh))}")
        v_user = lambda: fmt(n.user(v.shape, sh))  # noqa: E731  (messages only: decoding)
        if v.ndim != 4 or v.shape[:2] != (B, T) or (sh and v.shape[2] != 1):
            want = n.user([B, T, "Dv"] if sh else [B, T, H, "Dv"])
            raise ValueError(f"{n.v} must have shape "
                             f"{n.lay('B', 'T', 'Dv') if sh else n.lay('B', 'T', 'H', 'Dv')} = "
                             f"{fmt(want)}; got {v_user()}")
        if v.shape[2] % H if H else v.shape[2]:
            raise ValueError(f"{n.v} must have shape {n.lay('B', 'T', 'H', 'Dv')} = "
                             f"{fmt(n.user([B, T, H, 'Dv']))}, or {n.lay('B', 'T', 'HV', 'Dv')} "
                             f"with HV a multiple of H = {H} (grouped value heads: value head hv "
                             f"reads query/key head hv // (HV / H)); got {v_user()}")
        HV, Dv = v.shape[2], v.shape[3]
        self.B, self.T, self.H, self.HV, self.Dk, self.Dv = B, T, H, HV, Dk, Dv
        self.G = HV // H if H else 1      # no heads at all: nothing to compute

        # beta: one per head; the gate: one per head or one per key channel
        heads = "" if sh else "HV" if HV != H else "H"
        self.gate_shape, self.beta_shape = gate.shape, beta.shape
        per_head = {(B, T), (B, T, 1)} if sh else {(B, T, HV)}
        per_key = (B, T, Dk) if sh else (B, T, HV, Dk)
        head_lay = lambda: (n.lay("B", "T") + " or " + n.lay("B", "T", "1")  # noqa: E731
                            if sh else n.lay("B", "T", heads))
        head_user = lambda: fmt(n.user((B, T) if sh else (B, T, HV)))  # noqa: E731
        if beta.shape not in per_head:
            raise ValueError(f"beta must have shape {head_lay()} = {head_user()}; got "
                             f"{fmt(n.user(beta.shape))}{_BROADCASTS}")
        self.per_key = gate.shape == per_key and gate.shape not in per_head
        if gate.shape not in per_head and not self.per_key:
            key_lay = n.lay("B", "T", "Dk") if sh else n.lay("B", "T", heads, "Dk")
            raise ValueError(f"{self.gate_name} must have shape {head_lay()} = {head_user()} (one "
                             f"gate per head) or {key_lay} = {fmt(n.user(per_key))} (one per key "
                             f"channel); got {fmt(n.user(gate.shape))}{_BROADCASTS}")

    def _preflight(self, backward):
        """MemoryError now when the largest per-token output cannot be allocated (o; in the
        backward dq, dk, dv or a per-key dalpha), not after the value checks and conversions,
        which take seconds to minutes on inputs of tens of GB. The test allocation is given back
        at once (untouched, it costs no page)."""
        per = self.HV * (max(self.Dk, self.Dv) if backward else self.Dv)
        n = self.B * self.T * per * np.dtype(self.dtype).itemsize
        try:
            np.empty(n, np.uint8)
        except MemoryError:
            raise MemoryError(f"an output of this call needs {n / 2**30:.1f} GiB of "
                              f"{np.dtype(self.dtype).name}, more than can be allocated") from None

    def _warn_unusual(self, k, beta, gate):
        """Warnings for values a learner may not mean (cheap next to the recurrence; see
        _checks.value_messages): a decay outside [0, 1], a log decay above 0, with the delta rule
        beta outside [0, 2] or beta ||k||^2 above 2 where the state can grow (keys not
        normalised), and q of a sequence shorter than its number of heads (head-first?)."""
        for m in value_messages(beta, gate, k, log_gate=self.gate_name == "g",
                                delta_rule=self.delta_rule, normalize_qk=self.normalize_qk):
            warn(m)
        n = self.names
        if not n.step and not self.single_head:
            m = head_first_message((self.B, self.T, self.H, self.Dk), n.q)
            if m:
                warn(m)
        for m in self.shape_notes:
            warn(m)

    def _check_packed(self, cu_seqlens):
        """cu_seqlens (FlashAttention's packed batch) checked against B and T."""
        self.packed = cu_seqlens is not None
        self.cu, self.NS, self.max_len = packed_sequences(cu_seqlens, self.B, self.T)
        self.general = (self.per_key or self.normalize_qk or self.packed
                        or not self.delta_rule)

    def _check_state(self, s0):
        """The state's shape (for S_0, S_T, dS_T) and s0 checked against it."""
        sh, heads = self.single_head, "HV" if self.HV != self.H else "H"
        first = ("N", self.NS) if self.packed else ("B", self.B)
        if sh:
            self.state_shape = (first[1], self.Dv, self.Dk)
            self.state_layout = self.names.lay(first[0], "Dv", "Dk")
        else:
            self.state_shape = (first[1], self.HV, self.Dv, self.Dk)
            self.state_layout = f"[{first[0]}, {heads}, Dv, Dk]"
        if s0 is not None:
            expect_shape(s0, self.names.state, self.state_shape, self.state_layout)

    # 3. the views ------------------------------------------------------------------------------
    def _build_views(self, q, k, v, beta, gate, s0):
        """The kernels' views of the inputs, in the computation's dtype where a cast is needed
        (the gate as alpha = exp(g) when given as g; a scalar gate broadcast over the keys for
        the general ufunc, which reads [.., T, Dk])."""
        B, T, HV, Dk = self.B, self.T, self.HV, self.Dk
        # converted here, not by the ufunc: in pieces, so that Ctrl-C is not held up
        nt = self.num_threads
        q, k, v, beta = (converted(a, self.dtype, num_threads=nt) for a in (q, k, v, beta))
        s0 = None if s0 is None else converted(s0, self.dtype, num_threads=nt)
        self.q, self.k = self.qk_view(q), self.qk_view(k)
        self.v = self.seq_view(v.reshape(B, T, HV, self.Dv))
        if self.gate_name == "g":
            gate = converted(gate, self.dtype, np.exp, nt)
        else:
            gate = converted(gate, self.dtype, num_threads=nt)
        gate = gate.reshape((B, T, HV, Dk) if self.per_key else (B, T, HV))
        self.alpha = self.seq_view(gate) if self.per_key else self.head_view(gate)
        if self.general and not self.per_key:
            self.alpha = np.broadcast_to(self.alpha[..., None], self.alpha.shape + (Dk,))
        self.beta = self.head_view(beta.reshape(B, T, HV))
        self.S0 = self.zero_state() if s0 is None else self.state_view(s0)

    def qk_view(self, x):
        """[B, T, H, Dk] -> [B, H, 1, T, Dk] (broadcast over the G value heads of a group)."""
        return x.transpose(0, 2, 1, 3)[:, :, None]

    def seq_view(self, x):
        """[B, T, HV, D] -> [B, H, G, T, D]."""
        B, T, _, D = x.shape
        return x.reshape(B, T, self.H, self.G, D).transpose(0, 2, 3, 1, 4)

    def head_view(self, x):
        """[B, T, HV] -> [B, H, G, T]."""
        return x.reshape(x.shape[0], self.T, self.H, self.G).transpose(0, 2, 3, 1)

    def zero_state(self):
        """Zeros for S_0 or dS_T, broadcast over every (sequence, head) by the ufunc."""
        seq_axis = (self.NS,) if self.general else ()   # core dimensions do not broadcast
        return np.zeros((1, 1, 1) + seq_axis + (self.Dv, self.Dk), self.dtype)

    def state_view(self, S):
        """A state in the user's shape -> [B, H, G, (NS,) Dv, Dk]. The general ufunc's states have
        the sequence axis NS."""
        Dv, Dk = self.Dv, self.Dk
        if self.packed:                                # [N, HV, ...] -> [1, H, G, N, ...]
            return S.reshape(self.NS, self.H, self.G, Dv, Dk).transpose(1, 2, 0, 3, 4)[None]
        S = S.reshape(self.B, self.H, self.G, Dv, Dk)
        return S[:, :, :, None] if self.general else S

    def ckpt_shape(self, chunk=0):
        """The user's shape of the forward's checkpoints: the state's, with an axis of
        checkpoint_count(longest sequence) states before (Dv, Dk); with ``chunk`` > 0 the chunk
        form's states instead (as many as it keeps for the longest sequence)."""
        n = (_core._chunk_checkpoint_count(self.max_len, chunk, self.Dk, self.Dv) if chunk
             else _core.checkpoint_count(self.max_len))
        return self.state_shape[:-2] + (int(n), self.Dv, self.Dk)

    def ckpt_view(self, C):
        """Checkpoints in the user's shape -> the _ckpt ufuncs' [B, H, G, (NS,) NCK, Dv, Dk]."""
        nck, Dv, Dk = C.shape[-3:]
        if self.packed:
            return C.reshape(self.NS, self.H, self.G, nck, Dv, Dk).transpose(1, 2, 0, 3, 4, 5)[None]
        C = C.reshape(self.B, self.H, self.G, nck, Dv, Dk)
        return C[:, :, :, None] if self.general else C

    def new_seq(self, D):
        """A new [B, T, HV, D] array (user layout) and its kernel view [B, H, G, T, D]."""
        a = np.empty((self.B, self.T, self.HV, D), self.dtype)
        return a, self.seq_view(a)

    def new_state(self):
        """A new state array (user shape) and its kernel view."""
        a = np.empty(self.state_shape, self.dtype)
        return a, self.state_view(a)

    def user_seq(self, a):
        """[B, T, H or HV, D] -> the user's form ([B, T, D] for the single-head form)."""
        return a[:, :, 0, :] if self.single_head else a

    def ufunc_args(self):
        """Inputs of the forward ufunc after (q, k, v, alpha, beta, S_0, scale)."""
        if not self.general:
            return ()
        nq = (np.asarray(self.normalize_qk, self.dtype), self.cu)
        return nq if self.delta_rule else nq + (np.asarray(0, self.dtype),)

    def ufunc(self, kind):
        """The gufunc for this problem: kind "fwd", "bwd", "fwd_ckpt" or "bwd_ckpt" of the
        scalar-gate pair, the general pair, or (without the delta rule) the gated_rule pair."""
        base, _, ck = kind.partition("_")
        if not self.delta_rule:
            name = f"gated_rule_{base}"
        else:
            name = f"gated_delta_rule_{'general_' if self.general else ''}{base}"
        return getattr(_core, name + ("_ckpt" if ck else ""))
