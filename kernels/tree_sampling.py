"""Tree verification: which drafted tokens the target accepts, and the token that follows.

Re-implements SGLang's `verify_tree_greedy` and `tree_speculative_sampling_target_only`
(sgl-kernel, see shared/notes/sglang_tree_verification.md sections 1-2) with the same
argument names, shapes, dtypes and in-place outputs. Per batch row b:

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

Each operation exists three times: `*_reference` (plain PyTorch/Python, the
specification), `*_triton` (one program per batch row) and a dispatcher that picks Triton
for CUDA tensors and the reference otherwise; DDTREE_KERNELS=reference|triton overrides.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

BACKEND_ENV = "DDTREE_KERNELS"

# Vocabulary chunk that one Triton program handles per loop step (a power of two).
# Tests lower it to exercise several chunks with a small vocabulary.
MAX_BLOCK_V = 1024


def kernel_backend(device: torch.device) -> str:
    """'triton' or 'reference': DDTREE_KERNELS if set, else Triton exactly for CUDA tensors."""
    forced = os.environ.get(BACKEND_ENV, "")
    if forced in ("reference", "triton"):
        return forced
    if forced:
        raise ValueError(f"{BACKEND_ENV} must be 'reference' or 'triton', got {forced!r}")
    return "triton" if device.type == "cuda" else "reference"


def block_size(vocab_size: int) -> int:
    """Chunk length for a loop over the vocabulary: a power of two, at most MAX_BLOCK_V."""
    return min(triton.next_power_of_2(vocab_size), MAX_BLOCK_V)


# ---------------------------------------------------------------------------------------
# Argument checking, shared by the reference and the Triton wrappers.
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


def _clamped_threshold_acc(threshold_acc: float) -> float:
    """SGLang's launcher divides by max(threshold_acc, 1e-9)."""
    return max(threshold_acc, 1e-9)


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
    thr_acc = np.float32(_clamped_threshold_acc(threshold_acc))
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


# ---------------------------------------------------------------------------------------
# Triton kernel: one program per batch row, both operations (GREEDY picks the rule).
# ---------------------------------------------------------------------------------------


@triton.jit
def _verify_tree_kernel(
    predicts_ptr, accept_index_ptr, accept_token_num_ptr,
    candidates_ptr, retrive_index_ptr, next_token_ptr, next_sibling_ptr,
    target_predict_ptr,  # GREEDY only
    uniform_ptr, final_uniform_ptr, target_probs_ptr, draft_probs_ptr,  # sampling only
    threshold_single, threshold_acc,
    N, S, V,
    GREEDY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nodes = b * N  # offset of row b in the [bs, N] buffers
    probs = b * N * V  # offset of row b in the [bs, N, V] buffers

    # The walk, flattened into one loop: `cur` is the child being tried, `row` the last
    # accepted node (its parent), `n` the number of accepted drafts.
    row = tl.full([], 0, tl.int64)
    last = tl.load(retrive_index_ptr + nodes)
    tl.store(accept_index_ptr + b * S, last.to(tl.int32))
    n = tl.full([], 0, tl.int32)
    prob_acc = tl.full([], 0.0, tl.float32)
    coin = tl.full([], 0.0, tl.float32)
    if not GREEDY:
        coin = tl.load(uniform_ptr + nodes)
    cur = tl.load(next_token_ptr + nodes)
    while (cur != -1) & (n < S - 1):
        tok = tl.load(candidates_ptr + nodes + cur)
        if GREEDY:
            accepted = tok == tl.load(target_predict_ptr + last)
        else:
            q = tl.load(target_probs_ptr + probs + row * V + tok)
            prob_acc += q
            accepted = (coin <= tl.math.div_rn(prob_acc, threshold_acc)) | (q >= threshold_single)
        if accepted:
            tl.store(predicts_ptr + last, tok.to(tl.int32))
            n += 1
            last = tl.load(retrive_index_ptr + nodes + cur)
            tl.store(accept_index_ptr + b * S + n, last.to(tl.int32))
            row = cur
            if not GREEDY:
                prob_acc = 0.0
                coin = tl.load(uniform_ptr + nodes + cur)
            cur = tl.load(next_token_ptr + nodes + cur)
        else:
            if not GREEDY:
                tl.store(draft_probs_ptr + probs + row * V + tok, q)
            cur = tl.load(next_sibling_ptr + nodes + cur)
    tl.store(accept_token_num_ptr + b, n)

    if GREEDY:
        bonus = tl.load(target_predict_ptr + last)
    else:
        # Bonus from r = relu(target[row] - rejected[row]) (nothing removed on a full path).
        target_row = target_probs_ptr + probs + row * V
        rejected_row = draft_probs_ptr + probs + row * V
        remove = n != S - 1
        total = 0.0
        for start in range(0, V, BLOCK_V):
            r = _residual_chunk(target_row, rejected_row, start, V, remove, BLOCK_V)
            total += tl.sum(r, axis=0)
        u = tl.load(final_uniform_ptr + b) * total
        # First index whose running cumsum exceeds u, and the last positive index.
        running = 0.0
        first_hit = V
        last_positive = -1
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            r = _residual_chunk(target_row, rejected_row, start, V, remove, BLOCK_V)
            cdf = running + tl.cumsum(r, axis=0)
            hit = (r > 0) & (cdf > u)
            first_hit = tl.minimum(first_hit, tl.min(tl.where(hit, offs, V), axis=0))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(r > 0, offs, -1), axis=0))
            running += tl.sum(r, axis=0)
        fallback = tl.where(last_positive >= 0, last_positive, V - 1)
        bonus = tl.where(first_hit < V, first_hit, fallback)
    tl.store(predicts_ptr + last, bonus.to(tl.int32))


@triton.jit
def _residual_chunk(target_row, rejected_row, start, V, remove, BLOCK_V: tl.constexpr):
    """relu(target - rejected) (or relu(target) when not `remove`) on one chunk; 0 past V."""
    offs = start + tl.arange(0, BLOCK_V)
    mask = offs < V
    p = tl.load(target_row + offs, mask=mask, other=0.0)
    d = tl.load(rejected_row + offs, mask=mask, other=0.0)
    return tl.maximum(tl.where(remove, p - d, p), 0.0)


def verify_tree_greedy_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                              retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Triton version of verify_tree_greedy_reference (one program per batch row)."""
    bs, num_nodes, max_path = _check_greedy_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling, target_predict)
    unused = target_predict  # stands in for the sampling-only pointers
    _verify_tree_kernel[(bs,)](
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling, target_predict,
        unused, unused, unused, unused, 1.0, 1.0,
        num_nodes, max_path, 1, GREEDY=True, BLOCK_V=1)


def tree_speculative_sampling_target_only_triton(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True) -> None:
    """Triton version of tree_speculative_sampling_target_only_reference.

    Sums are float32; the bonus search loops over the vocabulary in chunks.
    """
    bs, num_nodes, max_path, vocab = _check_sampling_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, threshold_single, threshold_acc)
    unused = candidates  # stands in for the greedy-only pointer
    _verify_tree_kernel[(bs,)](
        predicts, accept_index, accept_token_num, candidates, retrive_index,
        retrive_next_token, retrive_next_sibling, unused,
        uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
        float(threshold_single), _clamped_threshold_acc(float(threshold_acc)),
        num_nodes, max_path, vocab, GREEDY=False, BLOCK_V=block_size(vocab))


# ---------------------------------------------------------------------------------------
# Dispatchers.
# ---------------------------------------------------------------------------------------


def verify_tree_greedy(predicts, accept_index, accept_token_num, candidates, retrive_index,
                       retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """SGLang's verify_tree_greedy: Triton on CUDA, the reference elsewhere (see module doc)."""
    impl = (verify_tree_greedy_triton if kernel_backend(candidates.device) == "triton"
            else verify_tree_greedy_reference)
    impl(predicts, accept_index, accept_token_num, candidates, retrive_index,
         retrive_next_token, retrive_next_sibling, target_predict)


def tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, threshold_single=1.0, threshold_acc=1.0, deterministic=True) -> None:
    """SGLang's tree_speculative_sampling_target_only: Triton on CUDA, the reference elsewhere."""
    impl = (tree_speculative_sampling_target_only_triton
            if kernel_backend(candidates.device) == "triton"
            else tree_speculative_sampling_target_only_reference)
    impl(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
         retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
         draft_probs, threshold_single, threshold_acc, deterministic)
