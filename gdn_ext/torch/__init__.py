"""PyTorch interop: the C kernels as a ``torch.autograd.Function``, a plain-torch reference, and
drop-ins for flash-linear-attention's gated-delta-rule functions on the CPU.

    import gdn_ext.torch as gt
    o, S_T = gt.gated_delta_rule(q, k, v, beta=beta, g=g)          # autograd through C kernels
    out = gt.gated_delta_rule(q, k, v, beta=0.5, alpha=1.0)        # out.o, out.S_T
    o, ht = gt.chunk_gated_delta_rule(q, k, v, g, beta)              # flash-linear-attention API

torch is imported by this module only; ``import gdn_ext`` never needs it.

Conventions: :func:`gated_delta_rule` uses gdn_ext's (state ``[.., Dv, Dk]``, scale default 1);
:func:`chunk_gated_delta_rule` and :func:`fused_recurrent_gated_delta_rule` use
flash-linear-attention's and transformers' (state ``[N, HV, K, V]``, log decay ``g``, scale default
``K ** -0.5``).

Dtypes, the same in every function and in the layer, as flash-linear-attention's: tensors
float16, bfloat16, float32 or float64; q, k and v share one dtype, and o is returned in it. The
recurrence runs in float32, or float64 when any tensor argument is float64: half-precision
tensors are cast to float32 in torch before the C kernels, so gradients come back in each
tensor's own dtype. The final state is returned in the dtype the recurrence ran in (float32 for
half inputs), ready to pass back as the next call's initial state.

Source of the math: S. Yang, J. Kautz, A. Hatamizadeh, "Gated Delta Networks:
Improving Mamba2 with Delta Rule", ICLR 2025 (arXiv:2412.06464), section 3.

Modules: ``_inputs`` (the dtype rule, the shapes of beta and the gates, the result's named
tuple), ``function`` (the custom operators and their autograd), ``loop`` (the reference loop
in torch ops, the reference), ``fla`` (the flash-linear-attention drop-ins), ``transformers`` (the
transformers patch), ``modules`` (the whole Gated DeltaNet layer as an ``nn.Module``).
"""
try:
    import torch as _torch  # noqa: F401
except ImportError as _exc:
    raise ImportError("gdn_ext.torch needs PyTorch, which gdn_ext does not install: pip install "
                      "torch (for the CPU only, e.g. pip install torch==2.13.0 "
                      "--index-url https://download.pytorch.org/whl/cpu)") from _exc

from .fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from ._inputs import GatedDeltaRuleOutput
from .function import gated_delta_rule
from .loop import reference_gated_delta_rule
from .modules import GatedDeltaNet, GatedDeltaNetState
from .transformers import patch_transformers

__all__ = ["gated_delta_rule", "GatedDeltaRuleOutput", "reference_gated_delta_rule",
           "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "patch_transformers",
           "GatedDeltaNet", "GatedDeltaNetState"]
