"""A drafter with `--verifier local` on the GPU: the draft model's work and the in-process
verifier's go on streams of their own, so that pipelined rounds run one group's draft while the
other's verify runs. Every request must get the tokens it gets in lockstep (float32: exactly).
"""
from __future__ import annotations

import threading

import pytest
import torch

from common.config import load_draft_config
from common.protocol import SamplingParams
from drafter_svc.drafter import DraftMode
from drafter_svc.scheduler import GenerationConfig, GenerationResult
from drafter_svc.server import DrafterConfig, DrafterEngine
from verifier_svc.server import VerifierConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 90)), [7, 300, 12, 450, 33, 8, 2], [100, 200, 300],
           [9, 8, 7, 6], list(range(200, 240)), [1, 2, 3], [400, 401]]


def run_all(engine: DrafterEngine, requests) -> list[list[int]]:
    """Submit every request at once; the tokens of each, once all have ended."""
    ends: dict[int, object] = {}
    done = threading.Event()

    def deliver(i, item):
        if isinstance(item, GenerationResult) or isinstance(item, Exception):
            ends[i] = item
            if len(ends) == len(requests):
                done.set()

    for i, (prompt, config) in enumerate(requests):
        engine.scheduler.submit(prompt, config, lambda item, i=i: deliver(i, item))
    assert done.wait(120)
    assert all(isinstance(ends[i], GenerationResult) for i in range(len(requests))), ends
    return [ends[i].tokens for i in range(len(requests))]


def test_colocated_pipelined_rounds_equal_lockstep(qwen3_pair):
    layers = load_draft_config(qwen3_pair[1]).target_layer_ids
    local = VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, projection_dir=str(qwen3_pair[1]),
                           device="cuda", dtype="float32", max_sessions=8, max_seq_len=256, max_tree_nodes=17,
                           graph_batches=(1, 2, 4, 8), graph_trees=(0, 8, 16), measure_costs="off")
    requests = [(p, GenerationConfig(24 + i, sampling=SamplingParams() if i % 2 == 0 else
                                     SamplingParams(temperature=0.9, top_k=30, seed=40 + i),
                                     mode=DraftMode("tree", (8, 16, 4, 0)[i % 4])))
                for i, p in enumerate(PROMPTS)]
    tokens = {}
    for pipelining in ("off", "on"):
        cfg = DrafterConfig(draft_dir=str(qwen3_pair[1]), target_dir=str(qwen3_pair[0]), verifier="local",
                            local_verifier=local, device="cuda", dtype="float32", max_concurrent=8,
                            pipelining=pipelining)
        engine = DrafterEngine.start(cfg, torch.float32)
        link = engine.scheduler.link
        most, send = [0], link.send

        def counting_send(entries, send=send, link=link, most=most):
            send(entries)
            most[0] = max(most[0], link.in_flight)

        link.send = counting_send
        try:
            assert link.stream is not None and engine.scheduler.proposer.stream is not None
            tokens[pipelining] = [run_all(engine, requests) for _ in range(2)]
        finally:
            engine.stop()
        assert most[0] == (2 if pipelining == "on" else 1)
    assert tokens["on"][0] == tokens["on"][1] == tokens["off"][0] == tokens["off"][1]
