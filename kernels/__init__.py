"""GPU kernels of the verifier, each with a plain PyTorch reference (see the modules)."""
from kernels.fused_accept import tree_accept
from kernels.layer_ops import add_rms_norm, qk_norm_rope_store, silu_mul
from kernels.probs import process_probs
from kernels.tree_sampling import tree_speculative_sampling_target_only, verify_tree_greedy

__all__ = ["add_rms_norm", "process_probs", "qk_norm_rope_store", "silu_mul", "tree_accept", "tree_speculative_sampling_target_only",
           "verify_tree_greedy"]
