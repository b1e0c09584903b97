"""Type stub of the compiled module gdn_ext._core (csrc/_core.c): the gated delta rule's NumPy
generalized ufuncs and the build's small helpers. Signatures of the gufuncs: gdn_ext.ufuncs."""
from typing import Literal

import numpy as np

L2_EPS: float

gated_delta_rule_fwd: np.ufunc
gated_delta_rule_bwd: np.ufunc
gated_delta_rule_general_fwd: np.ufunc
gated_delta_rule_general_bwd: np.ufunc
gated_delta_rule_fwd_ckpt: np.ufunc
gated_delta_rule_bwd_ckpt: np.ufunc
gated_delta_rule_general_fwd_ckpt: np.ufunc
gated_delta_rule_general_bwd_ckpt: np.ufunc
gated_rule_fwd: np.ufunc
gated_rule_bwd: np.ufunc
gated_rule_fwd_ckpt: np.ufunc
gated_rule_bwd_ckpt: np.ufunc

def openmp_enabled() -> bool: ...
def isa() -> Literal["generic", "avx2", "avx512"]: ...
def fma_peak(float64: bool, threads: int, seconds: float = 0.2, /) -> float: ...
def checkpoint_interval(T: int, /) -> int: ...
def checkpoint_count(T: int, /) -> int: ...
def bwd_workspace_len(T: int, Dk: int, Dv: int, /) -> int: ...
def _set_call_threads(n: int, /) -> int: ...
def _threads_for(N: int, /) -> int: ...
def _busy_cap(nt: int = 0, late_s: float = 0.0, total_s: float = 0.0, /) -> int: ...
