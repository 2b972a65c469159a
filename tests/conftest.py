"""Test setup: on machines without CUDA, Triton kernels run in the interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from common.make_tiny import TinySizes, make_tiny, train_tokenizer  # noqa: E402
from tests.servers import loopback_channel  # noqa: E402


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return train_tokenizer(TinySizes().vocab)


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_pair(request, tmp_path_factory, tiny_tokenizer):
    """(target_dir, draft_dir) of a tiny random pair, for each target architecture."""
    arch = request.param
    sizes = TinySizes(arch=arch, tie_embeddings=arch == "llama")
    return make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), seed=1, sizes=sizes, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory, tiny_tokenizer):
    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3"), seed=2, sizes=TinySizes(), tokenizer=tiny_tokenizer)


# Channels to the module's own `verifier` and `drafter` server fixtures (tests/servers.py).
@pytest.fixture(scope="module")
def verifier_channel(verifier):
    with loopback_channel(verifier.port) as channel:
        yield channel


@pytest.fixture(scope="module")
def drafter_channel(drafter):
    with loopback_channel(drafter.port) as channel:
        yield channel
