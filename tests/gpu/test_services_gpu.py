"""Both services on the GPU over gRPC (CUDA graphs on both sides, float32 so that greedy tree
decoding is exactly plain decoding): concurrent requests, whole and chunked prompts, with the
verifier's feature rows in the model's dtype (copied to the draft's device once per reply) and
packed as fp8 (unpacked there), each give the tokens of plain decoding.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from common.config import load_draft_config
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 17, 42, 99, 3], [300, 12], list(range(60, 90)), list(range(100, 160))]


def _tokens(stub, prompt, budget):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=24, tree_budget=budget,
                             sampling=pb.SamplingParams(temperature=0.0))
    return [t for reply in stub.Generate(req, timeout=120) if not reply.HasField("final")
            for t in reply.delta.token_ids]


@pytest.mark.parametrize("feature_wire", ["model", "fp8"])
def test_greedy_over_grpc_on_the_gpu_is_plain_decoding(qwen3_pair, feature_wire):
    layers = load_draft_config(qwen3_pair[1]).target_layer_ids
    vcfg = VerifierConfig(target_dir=str(qwen3_pair[0]), feature_layer_ids=layers, projection_dir=str(qwen3_pair[1]),
                          host="127.0.0.1", port=0, device="cuda", dtype="float32", max_sessions=4, max_seq_len=256,
                          max_tree_nodes=17, graph_batches=(1, 2, 4), graph_trees=(0, 8, 16), measure_costs="off",
                          feature_wire=feature_wire)
    with ServerThread(lambda: serve_verifier(vcfg)) as verifier:
        dcfg = DrafterConfig(draft_dir=str(qwen3_pair[1]), target_dir=str(qwen3_pair[0]),
                             verifier=f"127.0.0.1:{verifier.port}", host="127.0.0.1", port=0, device="cuda",
                             dtype="float32", tree_budget=8, max_new_tokens=24, verifier_wait_s=30, prefill_chunk=16)
        engine = DrafterEngine.start(dcfg, torch.float32)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0)) as drafter, \
                grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.GenerationStub(channel)
            plain = [_tokens(stub, p, 0) for p in PROMPTS]  # root-only trees: plain decoding
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                trees = list(pool.map(lambda p: _tokens(stub, p, 8), PROMPTS))
    assert trees == plain and all(len(t) > 0 for t in plain)
