"""Feature rows packed as fp8 on the GPU (`--feature-wire fp8`): the device packs and unpacks
bit for bit as the CPU does, and a verifier that packs (CUDA graphs, overlapped steps, prefills)
sends exactly the packed form of the rows a verifier in the model's dtype sends.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import load_draft_config
from common.feature_wire import FP8, pack_rows, unpack_rows
from common.protocol import OpenEntry, Prefilled, SamplingParams, TreeEntry, Verified
from common.tree import DraftTree
from verifier_svc.server import VerifierConfig, load_verifier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_packs_and_unpacks_as_the_cpu_does(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 4096, generator=g) * torch.logspace(-3, 3, 300)[:, None]).to(dtype)
    x[0] = 0
    packed = pack_rows(x.cuda())
    assert torch.equal(packed.cpu(), pack_rows(x))
    for out in (torch.bfloat16, torch.float32):
        assert torch.equal(unpack_rows(packed.cpu(), "cuda", out).cpu(), unpack_rows(packed.cpu(), "cpu", out))


def test_a_packing_verifier_sends_the_packed_rows_of_the_plain_one(qwen3_pair):
    layers = tuple(load_draft_config(qwen3_pair[1]).target_layer_ids)
    config = VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, device="cuda", dtype="bfloat16",
                            max_sessions=4, max_seq_len=256, max_tree_nodes=17, max_tree_depth=16,
                            graph_batches=(1, 2, 4), graph_trees=(0, 8, 16), measure_costs="off")
    plain, packing = load_verifier(config), load_verifier(config)
    packing.runner.feature_wire = FP8
    prompts = [[5, 17, 42, 99, 3], list(range(60, 90)), [7, 300, 12], list(range(200, 240))]
    opens = [("L", OpenEntry(i + 1, p, SamplingParams(), "", layers)) for i, p in enumerate(prompts)]
    roots = {}
    for a, b in zip(plain.step(opens), packing.step(opens)):
        assert isinstance(a.outcome, Prefilled) and a.outcome.token == b.outcome.token
        assert torch.equal(b.outcome.features, pack_rows(a.outcome.features))
        roots[a.session_id] = a.outcome.token
    rng = np.random.default_rng(0)
    vocab = plain.vocab_size
    for rnd in range(1, 6):
        entries = []
        for sid, root in roots.items():
            n = int(rng.integers(1, 12))
            parents = [-1] + [int(rng.integers(0, i + 1)) for i in range(n)]
            tokens = [root] + [int(t) for t in rng.choice(vocab, n, replace=False)]
            entries.append(("L", TreeEntry(sid, rnd, DraftTree.from_parents(tokens, parents))))
        # two steps in flight on the packing verifier, as a pipelining link keeps them
        pending = [packing.begin(entries[:2]), packing.begin(entries[2:])]
        got = packing.finish(pending[0]) + packing.finish(pending[1])
        for a, b in zip(plain.step(entries), got):
            assert isinstance(a.outcome, Verified) and a.outcome.accepted_tokens == b.outcome.accepted_tokens
            assert torch.equal(b.outcome.features, pack_rows(a.outcome.features))
            roots[a.session_id] = a.outcome.next_token


def test_a_gpu_drafter_reads_each_replys_rows_onto_its_device():
    """Model-dtype rows go to the draft's device in one copy, packed ones are unpacked there: the
    values are those the CPU reads."""
    from common.feature_wire import MODEL_DTYPE, feature_reader

    rows = torch.randn(40, 4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    plain = feature_reader(MODEL_DTYPE, torch.device("cuda"), torch.bfloat16).to_draft(rows)
    assert plain.is_cuda and torch.equal(plain.cpu(), rows)
    packed = feature_reader(FP8, torch.device("cuda"), torch.bfloat16).to_draft(pack_rows(rows))
    assert packed.is_cuda and torch.equal(packed.cpu(), unpack_rows(pack_rows(rows), "cpu", torch.bfloat16))
