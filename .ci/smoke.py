"""Smoke test of an installed gdn_ext (a wheel in a fresh environment), run from outside the
source folder: the compiled kernels load, agree with the NumPy reference forward and backward in
float64 on every variant, and the version is the package's. Exit status 0 on success."""
import os
import sys

import numpy as np

import gdn_ext
from gdn_ext import reference

here = os.path.dirname(os.path.abspath(__file__))
src = os.path.dirname(here)
if os.path.dirname(os.path.dirname(os.path.abspath(gdn_ext.__file__))) == src:
    sys.exit(f"smoke: gdn_ext was imported from the source folder {src}, not from the install")

rng = np.random.default_rng(0)
B, T, H, HV, Dk, Dv = 2, 23, 2, 4, 12, 10
q = rng.standard_normal((B, T, H, Dk))
k = rng.standard_normal((B, T, H, Dk))
k /= np.linalg.norm(k, axis=-1, keepdims=True)
v = rng.standard_normal((B, T, HV, Dv))
beta = rng.uniform(0.1, 0.9, (B, T, HV))
S0 = rng.standard_normal((B, HV, Dv, Dk))
do = rng.standard_normal((B, T, HV, Dv))
worst = 0.0
for gate in (rng.uniform(0.5, 1, (B, T, HV)), rng.uniform(0.5, 1, (B, T, HV, Dk))):
    for normalize_qk in (False, True):
        kw = dict(beta=beta, alpha=gate, initial_state=S0, scale=0.5, normalize_qk=normalize_qk)
        got = gdn_ext.gated_delta_rule(q, k, v, **kw)
        want = reference.gated_delta_rule(q, k, v, **kw)
        grads = gdn_ext.gated_delta_rule_backward(do, q, k, v, **kw)
        grads_ref = reference.gated_delta_rule_backward(do, q, k, v, **kw)
        for a, b in list(zip(got, want)) + list(zip(grads, grads_ref)):
            worst = max(worst, float(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(b)))))
print(f"gdn_ext {gdn_ext.__version__} from {os.path.dirname(gdn_ext.__file__)}: isa "
      f"{gdn_ext._core.isa()}, OpenMP {gdn_ext.openmp_enabled()}, largest relative error against "
      f"the reference {worst:.2e}")
sys.exit(0 if worst < 1e-10 else 1)
