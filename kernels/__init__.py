"""GPU kernels of the verifier, each with a plain PyTorch reference (see the modules)."""
from kernels.probs import process_probs
from kernels.tree_sampling import tree_speculative_sampling_target_only, verify_tree_greedy

__all__ = ["process_probs", "tree_speculative_sampling_target_only", "verify_tree_greedy"]
