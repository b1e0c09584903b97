"""Numbers shared by the reference, the checked API, the layer, the torch code and (through
setup.py, which reads this file and passes them to the compiler) the C kernels. Pure Python: no
import here may need the compiled module."""

__all__ = ["L2_EPS", "RMS_EPS"]

# q, k L2 normalisation: x / sqrt(sum(x**2) + L2_EPS), epsilon inside the root (as
# flash-linear-attention's use_qk_l2norm_in_kernel); csrc reads it as GDN_L2_EPS
L2_EPS = 1e-6
# the layer's RMSNorm: weight * x / sqrt(mean(x**2) + RMS_EPS)
RMS_EPS = 1e-6
