"""GPU kernels of the verifier (and the drafter's top-k), each with a plain PyTorch reference (see the modules)."""
from ddtree_kernels.fused_accept import tree_accept
from ddtree_kernels.layer_ops import add_rms_norm, qk_norm_rope_store, silu_mul

__all__ = ["add_rms_norm", "qk_norm_rope_store", "silu_mul", "tree_accept"]
