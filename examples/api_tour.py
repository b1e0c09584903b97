"""A tour of gdn_ext's public API, as a user script: it runs (tests/test_api_forms.py runs it)
and type-checks with ``mypy --strict`` (CI), so the types the library declares are the ones a
user's code meets."""
import importlib.util

import numpy as np
from numpy.typing import NDArray

import gdn_ext

rng = np.random.default_rng(0)
B, T, H, Dk, Dv = 2, 16, 4, 8, 8
q = rng.standard_normal((B, T, H, Dk)).astype(np.float32)
k = rng.standard_normal((B, T, H, Dk)).astype(np.float32)
k /= np.linalg.norm(k, axis=-1, keepdims=True)
v = rng.standard_normal((B, T, H, Dv)).astype(np.float32)
beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
alpha = rng.uniform(0.9, 1, (B, T, H)).astype(np.float32)

# the forward: a named tuple that unpacks as (o, S_T)
o, S_T = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=alpha)
out = gdn_ext.gated_delta_rule(q, k, v, beta=0.5, alpha=1.0, scale=Dk ** -0.5,
                               initial_state=S_T, num_threads=1, normalize_qk=True,
                               delta_rule=True, check_values=True)
state: NDArray[np.float32] = out.S_T.astype(np.float32)
assert out.o.shape == (B, T, H, Dv) and state.shape == (B, H, Dv, Dk)

# checkpoints for the backward: training runs the recurrence forward once
o, S_T, checkpoints = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=alpha,
                                               return_checkpoints=True)
do = np.ones_like(o)
grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=beta, alpha=alpha,
                                          checkpoints=checkpoints)
print("dalpha", grads.dalpha.shape, grads.dbeta.dtype)
grads_g = gdn_ext.gated_delta_rule_backward(do, q, k, v, beta=0.5, g=np.log(alpha))
print("dg", grads_g.dg.shape, "dbeta of a scalar:", grads_g.dbeta.shape)

# packed sequences of different lengths (B = 1)
packed = gdn_ext.gated_delta_rule(q[:1], k[:1], v[:1], beta=beta[:1], alpha=alpha[:1],
                                  cu_seqlens=[0, 5, T])
assert packed.S_T.shape == (2, H, Dv, Dk)

# decoding one token at a time
step_state = None
for t in range(T):
    o_t, step_state = gdn_ext.gated_delta_rule_step(q[:, t], k[:, t], v[:, t], beta=beta[:, t],
                                                    alpha=alpha[:, t], state=step_state)
assert step_state is not None
print("decode matches:", np.allclose(step_state, S_T, atol=1e-4))

with gdn_ext.threads(1):
    o1 = gdn_ext.gated_delta_rule(q, k, v, beta=beta, alpha=alpha).o
print("checkpoints:", gdn_ext.checkpoint_count(T), "every", gdn_ext.checkpoint_interval(T),
      "steps; OpenMP:", gdn_ext.openmp_enabled(), o1.dtype)

# PyTorch: the same function on tensors, differentiable; half precision runs in float32


def torch_tour() -> None:
    import torch
    import gdn_ext.torch as gt

    qt, kt, vt = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    o_torch, S_torch = gt.gated_delta_rule(qt, kt, vt, beta=0.5, g=torch.full((H,), -0.05),
                                           scale=Dk ** -0.5, normalize_qk=True)
    (dq,) = torch.autograd.grad(o_torch.square().sum() + S_torch.sum(), [qt])
    assert dq.shape == qt.shape
    half = gt.gated_delta_rule(qt.detach().bfloat16(), kt.detach().bfloat16(),
                               vt.detach().bfloat16(), beta=0.5, alpha=1.0)
    print("torch:", o_torch.dtype, half.o.dtype, half.S_T.dtype)
    o_fla, final = gt.chunk_gated_delta_rule(qt.detach(), kt.detach(), vt.detach(),
                                             g=torch.full((B, T, H), -0.05),
                                             beta=torch.full((B, T, H), 0.5),
                                             output_final_state=True)
    assert final is not None and final.shape == (B, H, Dk, Dv) and o_fla.shape == v.shape


if importlib.util.find_spec("torch") is not None:   # the NumPy API needs no torch
    torch_tour()
