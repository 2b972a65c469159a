"""Tree verification: which drafted tokens the target accepts, and the token that follows.

Plain PyTorch/Python references of SGLang's `verify_tree_greedy` and
`tree_speculative_sampling_target_only` (sgl-kernel, see shared/notes/sglang_tree_verification.md
sections 1-2) with the same argument names, shapes, dtypes and in-place outputs: the
specification that ddtree_kernels/fused_accept.py's `tree_accept_reference` composes (its Triton
version is the product's implementation). Per batch row b:

    walk from the root; at each level try the children of the last accepted node in
    sibling order, accept the first one the rule allows, stop when none is accepted or
    the path holds S = accept_index.size(1) nodes (root included);
    accept_index[b, :n+1] = slots (retrive_index values) of the accepted path
    predicts[slot of path[i]] = token that follows path[i]: the next accepted draft, and
    for the last node a "bonus" token taken from the target;
    accept_token_num[b] = n (accepted drafts, root excluded).

Greedy accepts a child whose token equals the target's argmax after its parent; the bonus
is that argmax. Target-only sampling draws one coin per level and accepts by inverse-CDF
over the siblings' target mass (so with thresholds (1, 1) the committed tokens are exact
samples of the target); the bonus is drawn from the target row with the rejected
siblings' mass removed (it is parked in the zero-filled `draft_probs`).

The module also holds the helpers that every kernel module imports: `kernel_backend`
(Triton exactly for CUDA tensors; DDTREE_KERNELS=reference|triton overrides), `environment`
(the kernel settings' variables, read once per process) and `expect_tensor`.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

BACKEND_ENV = "DDTREE_KERNELS"


@functools.cache
def environment(name: str) -> str:
    """A kernel setting's environment variable (DDTREE_KERNELS, DDTREE_PDL, TRITON_INTERPRET), read
    once per process: every kernel's dispatch asks, and a lookup of an unset variable costs about
    a microsecond (some ten a layer in an eager pass). `reread_environment` reads them again
    (tests that change them)."""
    return os.environ.get(name, "")


def reread_environment() -> None:
    """Forget the settings `environment` read, so that the next call reads the environment again."""
    environment.cache_clear()


def kernel_backend(device: torch.device) -> str:
    """'triton' or 'reference': DDTREE_KERNELS if set, else Triton exactly for CUDA tensors."""
    forced = environment(BACKEND_ENV)
    if forced in ("reference", "triton"):
        return forced
    if forced:
        raise ValueError(f"{BACKEND_ENV} must be 'reference' or 'triton', got {forced!r}")
    return "triton" if device.type == "cuda" else "reference"


def unspecialised(ints: list[str], pointers: list[str]) -> dict:
    """`triton.jit` options for a kernel compiled once for every step: no integer in `ints` is
    specialised on its value, and no pointer in `pointers` on its alignment (where this Triton
    can say so), since a step's views into packed buffers may start off a 16-byte boundary and
    such a step would compile a variant of its own while serving."""
    import inspect

    import triton

    options: dict = {"do_not_specialize": ints}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = pointers
    return options


# ---------------------------------------------------------------------------------------
# Argument checking.
# ---------------------------------------------------------------------------------------


def expect_tensor(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None,
                  device: torch.device) -> None:
    """Raise ValueError unless t is a contiguous tensor of this dtype, shape and device."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like candidates")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_tree_args(predicts, accept_index, accept_token_num, candidates, retrive_index,
                     retrive_next_token, retrive_next_sibling) -> tuple[int, int, int]:
    """Check the arguments both operations share; return (bs, N, S)."""
    if not isinstance(candidates, Tensor) or candidates.dim() != 2:
        raise ValueError("candidates must be a 2-D tensor [bs, N]")
    bs, num_nodes = candidates.shape
    if num_nodes < 1:
        raise ValueError("the tree needs at least its root (N >= 1)")
    dev = candidates.device
    for name, t in (("candidates", candidates), ("retrive_index", retrive_index),
                    ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        expect_tensor(name, t, torch.int64, (bs, num_nodes), dev)
    if not isinstance(accept_index, Tensor) or accept_index.dim() != 2 or accept_index.shape[1] < 1:
        raise ValueError("accept_index must be a 2-D tensor [bs, S] with S >= 1")
    max_path = accept_index.shape[1]
    expect_tensor("accept_index", accept_index, torch.int32, (bs, max_path), dev)
    expect_tensor("accept_token_num", accept_token_num, torch.int32, (bs,), dev)
    if not isinstance(predicts, Tensor) or predicts.dim() != 1:
        raise ValueError("predicts must be a 1-D tensor indexed by retrive_index values")
    expect_tensor("predicts", predicts, torch.int32, None, dev)
    return bs, num_nodes, max_path


def _check_greedy_args(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict) -> tuple[int, int, int]:
    """Check verify_tree_greedy's arguments; return (bs, N, S)."""
    bs, num_nodes, max_path = _check_tree_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling)
    expect_tensor("target_predict", target_predict, torch.int64, (bs, num_nodes), candidates.device)
    return bs, num_nodes, max_path


def _check_sampling_args(predicts, accept_index, accept_token_num, candidates, retrive_index,
                         retrive_next_token, retrive_next_sibling, uniform_samples,
                         uniform_samples_for_final_sampling, target_probs, draft_probs,
                         threshold_single, threshold_acc) -> tuple[int, int, int, int]:
    """Check tree_speculative_sampling_target_only's arguments; return (bs, N, S, V)."""
    bs, num_nodes, max_path = _check_tree_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling)
    dev = candidates.device
    if not isinstance(target_probs, Tensor) or target_probs.dim() != 3 or target_probs.shape[2] < 1:
        raise ValueError("target_probs must be a 3-D tensor [bs, N, V] with V >= 1")
    vocab = target_probs.shape[2]
    expect_tensor("uniform_samples", uniform_samples, torch.float32, (bs, num_nodes), dev)
    expect_tensor("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling,
                  torch.float32, (bs,), dev)
    expect_tensor("target_probs", target_probs, torch.float32, (bs, num_nodes, vocab), dev)
    expect_tensor("draft_probs", draft_probs, torch.float32, (bs, num_nodes, vocab), dev)
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    return bs, num_nodes, max_path, vocab


# ---------------------------------------------------------------------------------------
# Reference implementations.
# ---------------------------------------------------------------------------------------


class _HostTree:
    """The tree buffers of every row as Python lists (converted once: fast to walk)."""

    def __init__(self, candidates: Tensor, retrive_index: Tensor, retrive_next_token: Tensor,
                 retrive_next_sibling: Tensor) -> None:
        self.tokens = candidates.tolist()
        self.slots = retrive_index.tolist()
        self.next_token = retrive_next_token.tolist()
        self.next_sibling = retrive_next_sibling.tolist()

    def accepted_path(self, b: int, max_path: int, accept: Callable[[int, int], bool]) -> list[int]:
        """Local indices of row b's accepted nodes, root first, at most max_path of them.

        accept(parent, child) decides each child tried, in sibling order; SGLang tries
        the siblings of one level until one is accepted and stops at a level without one.
        """
        path = [0]
        while len(path) < max_path:
            parent = path[-1]
            child = self.next_token[b][parent]
            while child != -1 and not accept(parent, child):
                child = self.next_sibling[b][child]
            if child == -1:
                break
            path.append(child)
        return path


class _HostOutputs:
    """predicts / accept_index / accept_token_num as lists, written back in one copy."""

    def __init__(self, predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor) -> None:
        self._tensors = (predicts, accept_index, accept_token_num)
        self.predicts = predicts.tolist()
        self.accept_index = accept_index.tolist()
        self.accept_token_num = accept_token_num.tolist()

    def record_path(self, tree: _HostTree, b: int, path: list[int]) -> int:
        """Write row b's accepted path; return the slot of its last node (gets the bonus)."""
        slots = tree.slots[b]
        for depth, node in enumerate(path):
            self.accept_index[b][depth] = slots[node]
        for node, next_node in zip(path, path[1:]):
            self.predicts[slots[node]] = tree.tokens[b][next_node]
        self.accept_token_num[b] = len(path) - 1
        return slots[path[-1]]

    def write_back(self) -> None:
        for dst, values in zip(self._tensors, (self.predicts, self.accept_index, self.accept_token_num)):
            dst.copy_(torch.tensor(values, dtype=dst.dtype))


def verify_tree_greedy_reference(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                 retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Greedy tree verification in plain Python; same contract as SGLang's kernel.

    A child is accepted iff its token equals target_predict at its parent's slot;
    target_predict is read flattened at slot values, as SGLang does (so it assumes
    retrive_index[b, i] == b * N + i).
    """
    _, _, max_path = _check_greedy_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling, target_predict)
    tree = _HostTree(candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    target = target_predict.reshape(-1).tolist()
    out = _HostOutputs(predicts, accept_index, accept_token_num)
    for b in range(len(tree.tokens)):
        slots, tokens = tree.slots[b], tree.tokens[b]
        path = tree.accepted_path(
            b, max_path, lambda parent, child: tokens[child] == target[slots[parent]])
        last = out.record_path(tree, b, path)
        out.predicts[last] = target[last]
    out.write_back()


def tree_speculative_sampling_target_only_reference(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True) -> None:
    """Target-only tree sampling in plain Python/PyTorch; same contract as SGLang's kernel.

    The walk accumulates in float32 (numpy scalars) exactly like the kernel. The bonus
    token of every row is then drawn in one vectorised step. `deterministic` is accepted
    for compatibility; this implementation always is.
    """
    bs, _, max_path, vocab = _check_sampling_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, threshold_single, threshold_acc)
    thr_single = np.float32(threshold_single)
    thr_acc = np.float32(max(threshold_acc, 1e-9))  # SGLang's launcher divides by this
    tree = _HostTree(candidates, retrive_index, retrive_next_token, retrive_next_sibling)
    out = _HostOutputs(predicts, accept_index, accept_token_num)
    probs_host = target_probs.detach().cpu()
    rejected_host = draft_probs.detach().cpu()  # the same storage when on the CPU
    target, rejected = probs_host.numpy(), rejected_host.numpy()
    coins = uniform_samples.detach().cpu().numpy()

    last_node, last_slot = [0] * bs, [0] * bs
    for b in range(bs):
        prob_acc, coin = np.float32(0.0), coins[b, 0]
        tokens = tree.tokens[b]

        def accept(parent: int, child: int) -> bool:
            nonlocal prob_acc, coin
            tok = tokens[child]
            q = target[b, parent, tok]
            prob_acc += q
            if coin <= prob_acc / thr_acc or q >= thr_single:
                prob_acc, coin = np.float32(0.0), coins[b, child]
                return True
            rejected[b, parent, tok] = q  # park the rejected mass; the bonus excludes it
            return False

        path = tree.accepted_path(b, max_path, accept)
        last_node[b] = path[-1]
        last_slot[b] = out.record_path(tree, b, path)

    # Bonus: r = relu(target - rejected) at the last accepted node (nothing is removed
    # when the path is full); u = coin * sum(r); the first v with r[v] > 0 and
    # cumsum(r)[v] > u, else the last v with r[v] > 0, else V - 1.
    rows = torch.arange(bs)
    nodes = torch.tensor(last_node, dtype=torch.long)
    path_full = torch.tensor(out.accept_token_num) == max_path - 1
    target_row = probs_host[rows, nodes]
    residual = torch.where(path_full[:, None], target_row, target_row - rejected_host[rows, nodes])
    residual = residual.clamp_min(0.0)
    u = uniform_samples_for_final_sampling.detach().cpu() * residual.sum(dim=1)
    positive = residual > 0
    hit = positive & (residual.cumsum(dim=1) > u[:, None])
    first_hit = hit.int().argmax(dim=1)  # argmax returns the first maximum
    last_positive = vocab - 1 - positive.flip(1).int().argmax(dim=1)
    fallback = torch.where(positive.any(dim=1), last_positive, vocab - 1)
    bonus = torch.where(hit.any(dim=1), first_hit, fallback).tolist()
    for b in range(bs):
        out.predicts[last_slot[b]] = bonus[b]

    out.write_back()
    if rejected_host.data_ptr() != draft_probs.data_ptr():
        draft_probs.copy_(rejected_host)
