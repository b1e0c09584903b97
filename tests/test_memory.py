"""The backward keeps checkpoints, not every state: its memory is O(sqrt(T) Dk Dv), not O(T Dk Dv).

The C workspace comes from PyMem_RawMalloc and NumPy's arrays are traced too, so tracemalloc sees
every byte the call allocates."""
import tracemalloc

import numpy as np

import gdn_ext
from gdn_ext import _core


def test_backward_does_not_store_every_state():
    T, Dk, Dv = 100_000, 32, 32
    rng = np.random.default_rng(70)
    q = rng.standard_normal((1, T, 1, Dk))
    k = rng.standard_normal((1, T, 1, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((1, T, 1, Dv))
    beta = rng.uniform(0, 1, (1, T, 1))
    alpha = rng.uniform(0.9, 1, (1, T, 1))
    do = rng.standard_normal((1, T, 1, Dv))

    all_states = T * Dk * Dv * 8                     # 819 MB: what storing every S_t would take
    grads_bytes = (2 * T * Dk + T * Dv + 2 * T + Dk * Dv) * 8
    workspace = _core.bwd_workspace_len(T, Dk, Dv) * 8
    assert workspace < all_states / 100

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, alpha=alpha,
                                                  num_threads=1, algorithm="recurrent")
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak >= grads_bytes                      # tracemalloc did see the arrays
    assert peak <= grads_bytes + workspace + 1_000_000, (peak, grads_bytes, workspace)
    assert peak < all_states / 5
    assert np.all(np.isfinite(grads.dq)) and np.all(np.isfinite(grads.d_initial_state))


def test_workspace_grows_as_sqrt_t():
    """Checkpoints every C = ceil(sqrt T) steps and one segment of C states: the backward's
    workspace grows as sqrt(T), far below the T states it would take to store them all."""
    for T in (1, 63, 64, 65, 10_000, 100_000):
        C = gdn_ext.checkpoint_interval(T)
        assert C * C >= T and (C - 1) ** 2 < T
    Dk, Dv = 32, 48
    small, large = (_core.bwd_workspace_len(T, Dk, Dv) for T in (10_000, 1_000_000))
    assert 7 < large / small < 11                      # sqrt(100) = 10, less the fixed part
    assert large < 1_000_000 * Dk * Dv / 200
    assert _core.bwd_workspace_len(1, Dk, Dv) < 20 * Dk * Dv
