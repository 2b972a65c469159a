"""Trees handed over on the device (`common.tree.DeviceTrees`): an in-process drafter's DDTrees
stay where its selection left them, and the verifier builds its inputs from their parents there.
Each piece against its host twin on fresh random inputs: the fields (`tree_fields` against
`DraftTree.from_parents`, `walk_trees`, `ancestor_masks`), the selection (`select_device_trees`
against `select_ddtrees`), the verify inputs (`BatchInputs.fill`), a verifier step, and the
scheduler's choice of the path."""
from __future__ import annotations

import random

import pytest
import torch

from common.protocol import OpenEntry, SamplingParams, TreeEntry, Verified
from common.staging import HostCopy
from common.tree import DeviceTree, DeviceTrees, DraftTree, ancestor_masks, tree_fields, walk_trees
from drafter_svc.ddtree import select_ddtrees, select_device_trees, tree_sizes
from tests.test_batch_inputs import VOCAB, random_rows, reference_fill
from verifier_svc.cuda_graphs import BatchInputs, VerifyRow
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits


def device_trees(trees: list[DraftTree], order: list[int], width: int, failed: frozenset[int] = frozenset(),
                 device: str = "cpu", cut: dict[int, int] | None = None) -> list[DeviceTree]:
    """The trees as rows `order` of one DeviceTrees on `device`, `width` nodes wide (columns past a
    tree's nodes hold junk); trees in `failed` get count -1, as a NaN row does; a row in `cut`
    keeps only its first cut[row] nodes (its count stays, as the adaptive budget leaves it)."""
    layouts = walk_trees(trees, vocab_size=VOCAB, max_nodes=width, max_depth=width)
    w = width - 1
    packed = torch.randint(-1, width, (len(trees), 3 + 3 * w))  # junk in the unused columns
    packed[:, 3 + 2 * w:] = torch.full((len(trees), w), float("nan"), dtype=torch.float64).view(torch.int64)
    num_nodes = [0] * len(trees)
    for tree, layout, row in zip(trees, layouts, order):
        n = tree.num_nodes
        packed[row, :n], packed[row, 1 + w: 1 + w + n] = tree.tokens, torch.from_numpy(layout.parents)
        packed[row, 2 + 2 * w] = -1 if row in failed else n
        num_nodes[row] = min(n, (cut or {}).get(row, n))
    depth = max((int(l.depths[: num_nodes[row]].max()) for l, row in zip(layouts, order)), default=0)
    packed = packed.to(device)
    batch = DeviceTrees(packed, w, tuple(num_nodes), depth, HostCopy(packed))
    return [batch.tree(row, tree.root) for tree, row in zip(trees, order)]


def random_tree(rng: random.Random, n: int, root: int | None = None, vocab: int = VOCAB) -> DraftTree:
    parents = [-1] + [rng.randrange(i) if rng.random() < 0.6 else i - 1 for i in range(1, n)]
    tokens = rng.sample(range(vocab), n)  # siblings differ
    if root is not None:
        tokens[0] = root
    return DraftTree.from_parents(tokens, parents)


@pytest.mark.parametrize("seed", range(8))
def test_tree_fields_equal_the_host_builders(seed):
    rng = random.Random(seed)
    width = rng.randint(1, 40)
    trees = [random_tree(rng, rng.randint(1, width)) for _ in range(rng.randint(1, 6))]
    layouts = walk_trees(trees, vocab_size=VOCAB, max_nodes=width, max_depth=width)
    parents = torch.randint(-1, width, (len(trees), width))  # junk past each tree's nodes
    for j, layout in enumerate(layouts):
        parents[j, : layout.parents.shape[0]] = torch.from_numpy(layout.parents)
    counts = torch.tensor([t.num_nodes for t in trees])
    bound = max(layout.max_depth for layout in layouts) + rng.randint(0, 3)
    next_token, next_sibling, depths, masks = tree_fields(parents, counts, bound)
    assert torch.equal(masks, ancestor_masks(layouts, width))
    for j, (tree, layout) in enumerate(zip(trees, layouts)):
        n = tree.num_nodes
        assert torch.equal(next_token[j, :n], tree.next_token) and (next_token[j, n:] == -1).all()
        assert torch.equal(next_sibling[j, :n], tree.next_sibling) and (next_sibling[j, n:] == -1).all()
        assert torch.equal(depths[j, :n], torch.from_numpy(layout.depths)) and (depths[j, n:] == 0).all()


def test_tree_fields_need_the_depth_bound():
    """With a bound below the deepest tree, a deep node misses its far ancestors: the bound matters."""
    chain = torch.arange(-1, 7)[None]
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(tree_fields(chain, torch.tensor([8]), 7)[3][0], causal)
    assert not torch.equal(tree_fields(chain, torch.tensor([8]), 2)[3][0], causal)


@pytest.mark.parametrize("seed", range(6))
def test_device_selection_gives_the_trees_of_select_ddtrees(seed):
    """Same trees, node counts known without the logits (`tree_sizes`), -inf log-probs and a
    vocabulary smaller than the budget included."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for _ in range(10):
        sessions, depths, vocab = rng.randint(1, 5), rng.randint(1, 5), rng.choice([2, 3, 7, 50])
        logits = torch.randn(sessions, depths, vocab, generator=gen)
        if rng.random() < 0.4:  # many -inf log-probs, ties among them
            logits[logits < 0] = -float("inf")
            logits[..., 0] = 0.0
        budgets = [rng.randint(0, 20) for _ in range(sessions)]
        roots = [rng.randrange(vocab) for _ in range(sessions)]
        want = select_ddtrees(logits, roots, budgets)
        assert tree_sizes(budgets, min(max(budgets), vocab), depths) == tuple(want.num_nodes.tolist())
        for got, tree in zip(select_device_trees(logits, roots, budgets), want.trees()):
            host = got.on_host()
            assert got.num_nodes == tree.num_nodes and got.root == int(tree.tokens[0]) and not got.failed
            assert all(torch.equal(a, b) for a, b in zip((host.tokens, host.next_token, host.next_sibling),
                                                          (tree.tokens, tree.next_token, tree.next_sibling)))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("seed", range(6))
def test_fill_with_device_trees_equals_the_reference(kernel_env, backend, seed, device="cpu"):
    """Rows whose trees are DeviceTrees (in any order of their batch, mixed with host trees;
    their host masks junk) leave the buffers as the same trees from the host do: through the
    Triton kernel (`ddtree_kernels.place_trees`, interpreted on the CPU) and `tree_fields`. A
    tree cut by the host count is its first nodes; a count of -1 (a NaN row) leaves the root.
    (tests/gpu runs it on CUDA.)"""
    kernel_env("DDTREE_KERNELS", backend)
    rng = random.Random(seed)
    b_bucket, t_bucket = rng.choice([(1, 8), (4, 16), (16, 16), (32, 32)])
    inp = BatchInputs(b_bucket, t_bucket, torch.device(device), pinned=False)
    for _ in range(3):
        rows, masks = random_rows(rng, rng.randint(1, b_bucket), t_bucket)
        picked = [j for j in range(len(rows)) if rng.random() < 0.7]
        order = rng.sample(range(len(picked)), len(picked))
        failed = frozenset(rng.sample(order, 1)) if order and rng.random() < 0.5 else frozenset()
        cut = {row: rng.randint(1, 8) for row in order if row not in failed and rng.random() < 0.3}
        handed = device_trees([rows[j].tree for j in picked], order, t_bucket + rng.randint(0, 3), failed, device,
                              cut)
        want_rows, want_masks = list(rows), masks.clone()
        for j, tree in zip(picked, handed):
            r = rows[j]
            n = 1 if tree.row in failed else tree.num_nodes
            layout = walk_trees([r.tree], vocab_size=VOCAB, max_nodes=t_bucket, max_depth=t_bucket)[0]
            twin = DraftTree.from_parents(r.tree.tokens[:n].tolist(), layout.parents[:n].tolist())
            want_rows[j] = VerifyRow(r.slot, r.past, twin, r.depths[:n], r.sampling, r.coins, r.seed)
            want_masks[j] = torch.eye(masks.shape[-1], dtype=torch.bool)
            want_masks[j, :n, :n] = masks[j, :n, :n]
            rows[j] = VerifyRow(r.slot, r.past, tree, None, r.sampling, r.coins, r.seed)
        junk = masks.clone()
        junk[picked] = torch.rand(junk[picked].shape) < 0.5
        inp.fill(rows, junk, scratch_slot=99)
        want = reference_fill(b_bucket, t_bucket, want_rows, want_masks, 99)
        for j in picked:  # the coins staged are those of the tree's host count
            r = rows[j]
            if r.coins is not None:
                want["coins"][j] = 0.5
                want["coins"][j, : r.tree.num_nodes], want["final_coin"][j] = r.coins[: r.tree.num_nodes], \
                    r.coins[r.tree.num_nodes]
        got = {**{k: getattr(inp.ints, k) for k in ("tokens", "positions", "next_token", "next_sibling", "past",
                                                       "slot", "top_k", "seed")},
               **{k: getattr(inp.floats, k) for k in ("coins", "final_coin", "temperature", "top_p", "greedy")},
               "tree_mask": inp.tree_mask}
        for name, tensor in want.items():
            assert torch.equal(got[name].cpu(), tensor), name


def _verifier(target_dir, device: str, dtype: torch.dtype) -> TreeVerifier:
    from verifier_svc.target_model import TargetModel

    model = TargetModel.from_pretrained(target_dir, (0, 1), device=device, dtype=dtype)
    limits = VerifierLimits(max_sessions=4, max_seq_len=96, max_tree_nodes=17)
    return TreeVerifier(TargetRunner(model, 4, 96, 17), limits)


def test_a_verifier_step_takes_device_trees_as_their_host_twins(tiny_pair, device="cpu", dtype=torch.float32):
    """Rounds of random trees verified from the host (walked) and as DeviceTrees (trusted, built
    on the device) give the same tokens and features; a tree whose count is -1 fails its own
    session only (INTERNAL), and it is closed. (tests/gpu runs it on CUDA, through graphs.)"""
    rng = random.Random(3)
    host, device_side = _verifier(tiny_pair[0], device, dtype), _verifier(tiny_pair[0], device, dtype)
    vocab = host.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 9))] for _ in range(3)]
    roots = []
    for v in (host, device_side):
        opened = v.step([("d", OpenEntry(s, p, SamplingParams(), feature_layer_ids=v.feature_layer_ids))
                         for s, p in enumerate(prompts)])
        roots = [r.outcome.token for r in opened]
    for round_ in range(1, 5):
        trees = [random_tree(rng, rng.randint(1, 16), root, vocab) for root in roots]
        failed = frozenset({0}) if round_ == 4 else frozenset()  # row 0 holds session 1's tree
        handed = device_trees(trees, [2, 0, 1], 16, failed, device)
        want = host.step([("d", TreeEntry(s, round_, t)) for s, t in enumerate(trees)])
        got = device_side.step([("d", TreeEntry(s, round_, t)) for s, t in enumerate(handed)])
        for s, (w, g) in enumerate(zip(want, got)):
            if s == 1 and failed:
                assert g.outcome.status == "INTERNAL" and "NaN" in g.outcome.message
                continue
            assert isinstance(w.outcome, Verified) and isinstance(g.outcome, Verified)
            assert g.outcome.accepted_tokens == w.outcome.accepted_tokens
            assert g.outcome.next_token == w.outcome.next_token
            assert torch.equal(g.outcome.features, w.outcome.features)
        roots = [r.outcome.next_token if isinstance(r.outcome, Verified) else 0 for r in want]
    assert device_side.num_sessions == 2 and host.num_sessions == 3


def test_the_in_process_link_takes_device_trees(tiny_pair):
    """With the verifier in process the scheduler hands over its DDTrees as DeviceTrees; a link
    that does not take them gets host trees; the outputs are the same."""
    from drafter_svc.drafter import DraftMode
    from drafter_svc.generate import LocalEngine
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler
    from drafter_svc.session import GenerationConfig

    engine = LocalEngine.load(str(tiny_pair[0]), str(tiny_pair[1]),
                              limits=VerifierLimits(max_sessions=4, max_seq_len=128))

    def run(device: bool):
        kinds = set()

        class Recording(LocalLink):
            takes_device_trees = device

            def send(self, entries):
                kinds.update((type(e.tree), e.tree.num_nodes > 1) for e in entries if isinstance(e, TreeEntry))
                super().send(entries)

        scheduler = DraftScheduler(Recording(engine.verifier), engine.proposer, max_sessions=4,
                                   feature_layer_ids=engine.verifier.feature_layer_ids)
        out = []
        for prompt in ([5, 6, 7, 8], [9, 10, 11]):
            scheduler.submit(prompt, GenerationConfig(24, mode=DraftMode("tree", 6)),
                             lambda item, out=out: out.append(item))
        scheduler.run_until_idle()
        return [item.tokens for item in out if hasattr(item, "finish_reason")], kinds

    on_device, kinds = run(True)
    on_host, host_kinds = run(False)
    # The drafted trees on the device; root-only ones (no room left to draft) from the host.
    assert kinds == {(DeviceTree, True), (DraftTree, False)} and host_kinds == {(DraftTree, True), (DraftTree, False)}
    assert on_device == on_host and len(on_device) == 2


def test_the_adaptive_budget_plans_device_trees_from_the_previous_ones(tiny_pair):
    """With a planner, a step's trees are built on the host while none of its sessions has gains;
    later ones stay on the device, cut to the budget chosen from the sessions' previous trees'
    gains (a newcomer gets the others' mean). The outputs are plain decoding's."""
    from drafter_svc.budget import BudgetPlanner
    from drafter_svc.drafter import DraftMode
    from drafter_svc.generate import LocalEngine
    from drafter_svc.link import LocalLink
    from drafter_svc.scheduler import DraftScheduler
    from drafter_svc.session import GenerationConfig

    engine = LocalEngine.load(str(tiny_pair[0]), str(tiny_pair[1]),
                              limits=VerifierLimits(max_sessions=4, max_seq_len=128))
    prompts = ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16])
    ar = [engine.generate(p, GenerationConfig(30, mode=DraftMode("ar", 0))).tokens for p in prompts]
    planner = BudgetPlanner({(b, t): 1e-3 * (1 + b * t / 64) for b in (1, 2, 4) for t in (1, 4, 8, 16)},
                            explore_every=2)
    steps, chosen = [], []  # each message's trees, and the choice made for them (None: none)

    class Recording(LocalLink):
        def send(self, entries):
            choice = chosen.pop() if chosen else None
            steps.append(([(type(e.tree), e.tree.num_nodes) for e in entries if isinstance(e, TreeEntry)], choice))
            super().send(entries)

    scheduler = DraftScheduler(Recording(engine.verifier), engine.proposer, max_sessions=4,
                               feature_layer_ids=engine.verifier.feature_layer_ids, planner=planner)
    choose = planner.choose
    planner.choose = lambda *args, **kw: chosen.append(choose(*args, **kw)) or chosen[-1]
    out = []
    for p in prompts:
        scheduler.submit(p, GenerationConfig(30, mode=DraftMode("tree", 15)), out.append)
    scheduler.run_until_idle()
    assert [item.tokens for item in out if hasattr(item, "finish_reason")] == ar
    planned = [(trees, c) for trees, c in steps if c is not None]
    assert {kind for kind, n in planned[0][0] if n > 1} <= {DraftTree}  # no gains yet: on the host
    # Later on the device (two pipelined groups: the second's first step is on the host too).
    drafted = [trees for trees, _ in planned[2:] if any(n > 1 for _, n in trees)]
    assert len(drafted) >= 5 and all({kind for kind, n in trees if n > 1} == {DeviceTree} for trees in drafted)
    assert len({c.budget for _, c in planned}) >= 2
    for trees, c in planned:  # each step's trees are cut to its choice
        assert all(n <= 1 + c.budget for _, n in trees)
