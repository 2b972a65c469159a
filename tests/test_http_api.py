"""The drafter's OpenAI-compatible HTTP API, driven with the official `openai` client against both
services on loopback with the shipped pair: its outputs equal the gRPC API's for the same
request, streamed or not, for completions and chat; stop strings cut text and usage; bad
requests get 400 with OpenAI's error body; /health follows the drafter's serving state."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.checkpoint import load_tokenizer
from common.config import load_draft_config
from common.protocol import TokenLogprob
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tls import ServerTls
from drafter_svc.http_api import ApiRequest, _Output, parse_chat, parse_completion
from drafter_svc.server import DrafterConfig, DrafterEngine
from drafter_svc.text_stream import TokenBytes
from drafter_svc.server import serve as serve_drafter
from tests.servers import ServerThread
from verifier_svc.server import VerifierConfig
from verifier_svc.server import serve as serve_verifier

PAIR = Path(__file__).resolve().parent.parent / "models" / "default"
MODEL_NAME = "stdlib-coder"  # the name of the drafter's target folder (a copy of the shipped one, with a template)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
PROMPT = "def read_config(path):\n"


def shipped_target_with_template(folder: Path) -> Path:
    """The shipped target's files, linked into `folder`, plus a chat template (the shipped one has none)."""
    folder.mkdir(parents=True, exist_ok=True)
    for f in (PAIR / "target").iterdir():
        if not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return folder


@contextlib.contextmanager
def shipped_services(target: Path, max_sessions: int = 8, **drafter_changes):
    """The verifier (with /metrics) and a drafter with its HTTP API on loopback, both on CPU; yields
    their ServerThreads. `drafter.server.http_port` is the HTTP port, `drafter.port` the gRPC one,
    `verifier.server.metrics.port` the verifier's metrics port."""
    verifier_cfg = VerifierConfig(target_dir=str(PAIR / "target"), projection_dir=str(PAIR / "draft"),
                                  feature_layer_ids=load_draft_config(PAIR / "draft").target_layer_ids,
                                  host="127.0.0.1", port=0, max_sessions=max_sessions, max_seq_len=512,
                                  max_tree_nodes=33)
    with ServerThread(lambda: serve_verifier(verifier_cfg, metrics_port=0)) as verifier:
        fields = dict(draft_dir=str(PAIR / "draft"), target_dir=str(target), verifier=f"127.0.0.1:{verifier.port}",
                      host="127.0.0.1", port=0, tree_budget=16, max_new_tokens=32, verifier_wait_s=30,
                      max_concurrent=max_sessions)
        engine = DrafterEngine.start(DrafterConfig(**(fields | drafter_changes)), torch.float32)
        with ServerThread(lambda: serve_drafter(engine, "127.0.0.1", 0, http_port=0)) as drafter:
            yield verifier, drafter


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    target = shipped_target_with_template(tmp_path_factory.mktemp("http") / MODEL_NAME)
    with shipped_services(target) as (_, running):
        yield running


@pytest.fixture(scope="module")
def client(drafter):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{drafter.server.http_port}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_stub(drafter):
    with grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS) as channel:
        yield pb_grpc.GenerationStub(channel)


def post(drafter, path: str, body: bytes | dict, headers=None) -> tuple[int, dict | bytes]:
    """A raw request: (status, parsed JSON body, or the raw bytes of an event stream)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{drafter.server.http_port}{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            events = r.headers.get("Content-Type", "").startswith("text/event-stream")
            return r.status, raw if events else json.loads(raw)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(drafter, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{drafter.server.http_port}{path}", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def streamed_text(stream) -> tuple[str, str | None, object]:
    """Text, finish reason and usage of a streamed completion (completions or chat)."""
    text, reason, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason, usage


def test_models_lists_the_target_folder_name(client, drafter):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    status, body = get(drafter, "/v1/models/another-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert DrafterConfig(target_dir="x/y/", served_model_name="served").model_name == "served"
    assert DrafterConfig(target_dir="x/y/").model_name == "y"


def test_completion_equals_grpc_generate_once(client, grpc_stub):
    once = grpc_stub.GenerateOnce(pb.GenerateRequest(text=PROMPT, max_new_tokens=24), timeout=60)
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == once.text and once.text
    assert out.choices[0].finish_reason == once.final.finish_reason == "length"
    assert out.model == MODEL_NAME and out.object == "text_completion"
    assert out.usage.prompt_tokens == once.final.usage.prompt_tokens
    assert out.usage.completion_tokens == once.final.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_token_id_prompt_equals_text_prompt(client, drafter):
    ids = drafter.server.engine.tokenize(PROMPT)
    by_text = client.completions.create(model="any-name", prompt=PROMPT, max_tokens=12, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0)
    batch_of_one = client.completions.create(model=MODEL_NAME, prompt=[ids], max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == batch_of_one.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_streamed_completion_equals_whole(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0)
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    text, reason, usage = streamed_text(stream)
    assert text == whole.choices[0].text and reason == whole.choices[0].finish_reason
    assert usage.model_dump() == whole.usage.model_dump()


def test_stream_is_server_sent_events_ending_with_done(drafter):
    # (ignore_eos: sampled at OpenAI's temperature 1, the shipped model may end early)
    status, raw = post(drafter, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stream": True,
                                                    "ignore_eos": True})
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage fields at all
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["object"] == "text_completion"


def test_seeded_sampling_repeats(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.8, top_p=0.95, seed=7,
                  extra_body={"top_k": 50})
    first = client.completions.create(**kwargs)
    assert client.completions.create(**kwargs).choices[0].text == first.choices[0].text


def test_n_choices_and_batched_prompts_equal_their_single_requests(client):
    """n choices of each of several prompts: choice prompt x n + j equals the single request of that
    prompt with seed + j, streamed or not; usage counts each prompt once and every choice's tokens."""
    prompts, kwargs = [PROMPT, "def main():"], dict(model=MODEL_NAME, max_tokens=12, temperature=0.9, top_p=0.95)
    out = client.completions.create(prompt=prompts, n=2, seed=11, **kwargs)
    singles = [client.completions.create(prompt=p, seed=11 + j, **kwargs) for p in prompts for j in range(2)]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert out.choices[0].text != out.choices[1].text  # seed + j: the choices differ
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens + singles[2].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 48
    texts, reasons, usage = collections.defaultdict(str), {}, None
    for chunk in client.completions.create(prompt=prompts, n=2, seed=11, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [texts[i] for i in range(4)] == [c.text for c in out.choices]
    assert reasons == {i: "length" for i in range(4)} and usage.model_dump() == out.usage.model_dump()
    greedy = client.completions.create(prompt=PROMPT, n=3, model=MODEL_NAME, max_tokens=12, temperature=0,
                                       logprobs=1)
    assert len({c.text for c in greedy.choices}) == 1 and all(c.logprobs.text_offset[0] == 0 for c in greedy.choices)


def test_chat_n_choices_stream_each_with_its_role(client):
    messages = [{"role": "user", "content": "def parse("}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0.9, seed=5, n=2)
    whole = client.chat.completions.create(**kwargs)
    roles, texts = collections.Counter(), collections.defaultdict(str)
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
    assert roles == {0: 1, 1: 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 20


def test_chat_completion_equals_grpc_chat(client, grpc_stub):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse("}]
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in messages])
    once = grpc_stub.GenerateOnce(pb.GenerateRequest(chat=chat, max_new_tokens=20), timeout=60)
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=20,
                                         temperature=0)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == once.text and once.text
    assert out.usage.prompt_tokens == once.final.usage.prompt_tokens
    assert out.usage.completion_tokens == once.final.usage.completion_tokens
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, reason, usage = streamed_text(stream)
    assert text == once.text and reason == out.choices[0].finish_reason
    assert usage.completion_tokens == out.usage.completion_tokens
    parts = [{"role": "system", "content": [{"type": "text", "text": "You write Python."}]}, messages[1]]
    same = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=20, temperature=0)
    assert same.choices[0].message.content == once.text


def test_stop_cuts_text_and_usage(client, grpc_stub):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    once = grpc_stub.GenerateOnce(pb.GenerateRequest(text=PROMPT, max_new_tokens=32, stop=[stop]), timeout=60)
    assert cut.usage.completion_tokens == once.final.usage.completion_tokens < full.usage.completion_tokens
    streamed, reason, _ = streamed_text(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True))
    assert (streamed, reason) == (cut.choices[0].text, "stop")


@pytest.mark.parametrize("body, param, needle", [
    ({"prompt": PROMPT, "temperature": -1}, "temperature", "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p", "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n", "n must be in [1, 129)"),
    ({"prompt": PROMPT, "n": 129}, "n", "n must be in [1, 129)"),
    ({"prompt": PROMPT, "n": True}, "n", "integer"),
    ({"prompt": ["a"] * 65, "n": 2}, "n", "at most 128 choices a request: 65 prompts x n 2"),
    ({"prompt": ["a"] * 129}, "prompt", "at most 128 prompts a request"),
    ({"prompt": ["a", ""]}, "prompt", "prompt 1 of the batch: prompt is empty"),
    ({"prompt": PROMPT, "n": 9}, "n", "9 choices (prompts x n) are more than the 8 generations this server runs at once"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens", "integer"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature", "number"),
    ({"prompt": PROMPT, "stream": "yes"}, "stream", "boolean"),
    ({"prompt": PROMPT, "stop": [1, 2]}, "stop", "strings"),
    ({"prompt": PROMPT, "logprobs": 21}, "logprobs", "[0, 21)"),
    ({"prompt": PROMPT, "logprobs": True}, "logprobs", "integer"),
    ({"prompt": PROMPT, "echo": True}, "echo", "not supported"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": PROMPT, "best_of": 2}, "best_of", "not supported"),
    ({"prompt": PROMPT, "presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"prompt": PROMPT, "frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"prompt": PROMPT, "frequency_penalty": "1"}, "frequency_penalty", "a number"),
    ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be in (0, 100]"),
    ({"prompt": PROMPT, "seed": -(1 << 63) - 1}, "seed", "seed must be in [-2^63, 2^63)"),
    ({"prompt": [1, "x"]}, "prompt", "token ids"),
    ({"prompt": [5, 999999]}, "prompt", "outside the vocabulary"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": ""}, "prompt", "empty"),
    ({}, "prompt", "required"),
    ({"prompt": PROMPT, "model": 3}, "model", "string"),
    ({"prompt": PROMPT, "tree_budget": 1000}, "tree_budget", "tree_budget"),
    ({"prompt": PROMPT, "stop": ["x"] * 65}, "stop", "at most 64 strings"),
    ({"prompt": PROMPT, "stop": "x" * 1025}, "stop", "of at most 1024 characters"),
    ({"prompt": PROMPT, "stop_token_ids": [999999]}, "stop_token_ids", "outside the vocabulary"),
    ({"prompt": PROMPT, "top_k": -2}, "top_k", "top_k"),
    ({"prompt": PROMPT, "ignore_eos": 1}, "ignore_eos", "boolean"),
    ({"prompt": PROMPT, "min_tokens": -1}, "min_tokens", "min_tokens must be in [0,"),
    ({"prompt": PROMPT, "min_tokens": 8, "max_tokens": 4}, "min_tokens", "the 4 tokens to generate"),
    ({"prompt": PROMPT, "min_tokens": 1, "stop_token_ids": list(range(100, 164))}, "min_tokens", "holds back 65"),
    ({"prompt": PROMPT, "logit_bias": {str(t): 1 for t in range(65)}}, "logit_bias", "65 entries, at most 64"),
    ({"prompt": PROMPT, "stop_token_ids": ["5"]}, "stop_token_ids", "must be a list of integer token ids"),
    ({"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": PROMPT, "logit_bias": {"1_0": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": PROMPT, "logit_bias": {" 5": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": PROMPT, "logit_bias": {"05": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"prompt": PROMPT, "logit_bias": {"5": "1"}}, "logit_bias", "[-100, 100]"),
    ({"prompt": PROMPT, "logit_bias": [5]}, "logit_bias", "an object"),
    ({"prompt": PROMPT, "logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
])
def test_bad_completion_requests_get_400_with_openai_error_body(drafter, body, param, needle):
    status, reply = post(drafter, "/v1/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"] and "\n" not in error["message"]


def test_requests_past_the_context_get_context_length_exceeded(drafter, grpc_stub):
    """OpenAI's code for a prompt, or prompt plus max_tokens, that the context cannot hold (the
    verifier's max_seq_len is 512 here: a prompt of P tokens leaves room for 513 - P); the
    largest max_tokens that fits is served to the end, and without max_tokens the server's
    default is cut short by the context as before."""
    ids = [5] * 500
    for path, body, param in (
            ("/v1/completions", {"prompt": ids, "max_tokens": 14}, "max_tokens"),
            ("/v1/completions", {"prompt": [5] * 512}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, "messages"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 6},
             "max_tokens"),
            ("/v1/completions", {"prompt": ids, "min_tokens": 14}, "min_tokens")):
        status, reply = post(drafter, path, body)
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert reply["error"]["param"] == param, reply
    status, reply = post(drafter, "/v1/completions", {"prompt": ids, "max_tokens": 13, "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 13, reply
    # min_tokens past the server's default (32 here) raises it, as vLLM's unset max_tokens takes the context.
    status, reply = post(drafter, "/v1/completions", {"prompt": [5] * 4, "min_tokens": 40, "temperature": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 40, reply
    with pytest.raises(grpc.RpcError) as info:
        grpc_stub.GenerateOnce(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=14), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 13 new tokens fit" in info.value.details()


def test_openai_defaults_and_lenient_values():
    """Unset temperature samples at OpenAI's 1 (the gRPC API's unset is greedy); vLLM's top_k -1
    is no top-k; tool_choice "auto" with no tools is no tool call."""
    req = parse_completion(json.dumps({"prompt": "x"}).encode()).choices[0]
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 1.0
    assert parse_completion(json.dumps({"prompt": "x", "temperature": 0}).encode()).choices[0].sampling.temperature == 0
    assert parse_completion(json.dumps({"prompt": "x", "top_k": -1}).encode()).choices[0].sampling.top_k == 0
    chat = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}
    assert parse_chat(json.dumps(chat).encode()).choices[0].sampling.temperature == 1.0


def test_ignore_eos_min_tokens_logit_bias_and_penalties_reach_every_choice():
    """vLLM's and SGLang's ignore_eos (benchmark clients send it), min_tokens, OpenAI's logit_bias and
    presence and frequency penalties, and vLLM's repetition_penalty are passed on to each generation."""
    assert not parse_completion(json.dumps({"prompt": "x"}).encode()).choices[0].ignore_eos
    completion = parse_completion(json.dumps({"prompt": ["x", "y"], "n": 2, "ignore_eos": True}).encode())
    assert len(completion.choices) == 4 and all(c.ignore_eos for c in completion.choices)
    chat = {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True, "min_tokens": 3}
    assert parse_chat(json.dumps(chat).encode()).choices[0].ignore_eos
    assert parse_chat(json.dumps(chat).encode()).choices[0].min_tokens == 3
    biased = parse_completion(json.dumps({"prompt": "x", "logit_bias": {"7": -100, "9": 2.5}}).encode())
    assert dict(biased.choices[0].logit_bias) == {7: -100.0, 9: 2.5}
    penalized = parse_chat(json.dumps({**chat, "n": 2, "presence_penalty": 0.5, "frequency_penalty": -1,
                                       "repetition_penalty": 1.25}).encode())
    for choice in penalized.choices:
        sampling = choice.sampling
        assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1, 1.25)
    assert not parse_chat(json.dumps(chat).encode()).choices[0].sampling.HasField("presence_penalty")


@pytest.mark.parametrize("body, needle", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "boolean"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "needs logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -3}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ({"messages": [{"role": "", "content": "hi"}]}, "empty role"),
])
def test_bad_chat_requests_get_400(drafter, body, needle):
    status, reply = post(drafter, "/v1/chat/completions", body)
    assert status == 400 and needle in reply["error"]["message"], reply


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True)
    assert info.value.status_code == 400 and "echo is not supported" in info.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], temperature=-2)


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_invalid_json_gets_400(drafter, data):
    status, reply = post(drafter, "/v1/completions", data)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"


def test_unknown_paths_and_methods_get_openai_error_bodies(drafter):
    status, reply = get(drafter, "/v1/nothing-here")
    assert status == 404 and "message" in reply["error"]
    status, reply = get(drafter, "/v1/completions")
    assert status == 405 and "message" in reply["error"]


def test_oversized_body_gets_413(drafter):
    limit = drafter.server.engine.cfg.max_message_mb << 20
    status, reply = post(drafter, "/v1/completions", json.dumps({"prompt": "x" * limit}).encode())
    assert status == 413 and "message" in reply["error"]


def test_health_follows_serving_state(drafter):
    assert get(drafter, "/health") == (200, {"status": "serving"})
    service = drafter.server.service
    service.draining = True  # what a shutdown sets: health reports not serving and new requests are refused
    try:
        assert get(drafter, "/health") == (503, {"status": "not serving"})
        status, reply = post(drafter, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert status == 503 and reply["error"]["code"] == "unavailable"
    finally:
        service.draining = False
    assert get(drafter, "/health")[0] == 200


def test_https_and_api_key_guard_the_http_api(tmp_path):
    """With --tls-cert the HTTP port speaks HTTPS only, and --api-key guards its /v1 endpoints."""
    from tests.test_tls import make_pki

    pki = make_pki(tmp_path / "pki", "http")
    target = shipped_target_with_template(tmp_path / MODEL_NAME)
    tls = ServerTls(cert=pki.server_cert, key=pki.server_key)
    with shipped_services(target, max_sessions=2, api_key="sesame-123", tls=tls) as (_, drafter):
        base = f"https://localhost:{drafter.server.http_port}/v1"

        context = ssl.create_default_context(cafile=pki.ca)

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=base, api_key=key, max_retries=0,
                                 http_client=openai.DefaultHttpxClient(verify=context))

        with client("wrong") as wrong, pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        with client("sesame-123") as right:
            # (greedy: OpenAI's default temperature 1 samples, and a first token of EOS ends at one)
            out = right.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0)
            assert out.usage.completion_tokens == 2
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is not answered
            get(drafter, "/health")
        with urllib.request.urlopen(f"https://localhost:{drafter.server.http_port}/health", context=context) as r:
            assert r.status == 200  # health needs no key


def grpc_logprobs(grpc_stub, n: int, **fields):
    once = grpc_stub.GenerateOnce(pb.GenerateRequest(max_new_tokens=24, logprobs=n, **fields), timeout=60)
    return once, [(t.token_id, t.logprob, [(a.token_id, a.logprob) for a in t.top]) for t in once.logprobs]


def test_completion_logprobs_equal_grpc(client, grpc_stub):
    """OpenAI's completions format (tokens, token_logprobs, top_logprobs, text_offset), streamed
    and not, carries the gRPC API's values; the tokens' texts make up the completion's text."""
    once, want = grpc_logprobs(grpc_stub, 3, text=PROMPT)
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([v for _, v, _ in want], abs=1e-6)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert [v for top in lp.top_logprobs for v in sorted(top.values(), reverse=True)] == pytest.approx(
        [v for _, _, alts in want for _, v in alts], abs=1e-6)
    assert "".join(lp.tokens) == whole.choices[0].text == once.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs is not None]
    assert [v for c in streamed for v in c.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset


def test_logprobs_of_tokens_that_split_a_character():
    """Completions' text_offset indexes the completion's text, and chat's bytes are each token's
    own bytes, also for tokens that hold part of a character (decoded alone: U+FFFD), as OpenAI's
    are: rounds of one and of several tokens."""
    tokenizer = load_tokenizer(PAIR / "target")
    text = "naïve 日本語 🙂 x"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text and any("\ufffd" in tokenizer.decode([t]) for t in ids)
    for rounds in ([ids], [[t] for t in ids], [ids[:3], ids[3:4], ids[4:]]):
        outs = {chat: _Output(ApiRequest(chat, (pb.GenerateRequest(),), 1, False, False), "m", tokenizer,
                              TokenBytes(tokenizer)) for chat in (False, True)}
        offsets, content = [], []
        for r in rounds:
            offsets += outs[False].logprobs([TokenLogprob(t, -1.0) for t in r])["text_offset"]
            content += outs[True].logprobs([TokenLogprob(t, -1.0) for t in r])["content"]
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
        for t, at in zip(ids, offsets):
            alone = tokenizer.decode([t])
            assert "\ufffd" in alone or text[at:at + len(alone)] == alone, (t, at, alone)
        assert bytes(b for c in content for b in c["bytes"]) == text.encode()


def test_chat_logprobs_equal_grpc(client, grpc_stub):
    """OpenAI's chat format: content entries with token, logprob, bytes and top_logprobs, seeded
    sampling included (the values are of the filtered distribution the tokens were drawn from)."""
    messages = [{"role": "user", "content": "write a function"}]
    sampling = dict(temperature=0.8, top_p=0.9, seed=5)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="write a function")])
    once, want = grpc_logprobs(grpc_stub, 2, chat=chat,
                               sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, seed=5))
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, logprobs=True,
                                           top_logprobs=2, **sampling)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([v for _, v, _ in want], abs=1e-6)
    assert [a.logprob for c in content for a in c.top_logprobs] == pytest.approx(
        [v for _, _, alts in want for _, v in alts], abs=1e-6)
    assert all(bytes(c.bytes).decode("utf-8") == c.token for c in content)
    assert whole.choices[0].message.content == once.text
    streamed = [e for c in client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24,
                                                          logprobs=True, top_logprobs=2, stream=True, **sampling)
                if c.choices and c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None


DEEP = b"[" * 100_000 + b"]" * 100_000  # deeper than Python's JSON parser goes


@pytest.mark.parametrize("path, data", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}'),  # a lone surrogate: valid JSON, not text
    ("/v1/completions", b'{"prompt": "def f(x):", "stop": ["\\udfff"], "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": ' + DEEP + b"}"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 4}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
                             b'{"\\udc00": "x"}, "max_tokens": 4}'),
    ("/v1/chat/completions", b'{"messages": ' + DEEP + b"}"),
])
def test_bodies_that_are_json_but_not_text_get_400_not_500(drafter, path, data, caplog):
    """A client's mistake, not the server's: 400 with one line, and no traceback in the log."""
    with caplog.at_level("ERROR"):
        status, reply = post(drafter, path, data)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert "\n" not in reply["error"]["message"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    fine = data.replace(b"\\ud800", b"x").replace(b"\\udfff", b"x").replace(b" \\ud83d", b"").replace(b"\\udc00", b"y")
    if DEEP not in data:  # the same body without the surrogate is served
        assert post(drafter, path, fine)[0] == 200


def test_seed_range_is_64_bits(drafter, client):
    """Any 64-bit seed is taken, as vLLM takes it: a negative one modulo 2^63 (the engine's range)."""
    for seed in (-(1 << 63) - 1, 1 << 63):
        status, reply = post(drafter, "/v1/completions", {"prompt": PROMPT, "seed": seed, "max_tokens": 2})
        assert status == 400 and "seed must be in [-2^63, 2^63)" in reply["error"]["message"], reply
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.9)
    assert client.completions.create(seed=-1, **kwargs).choices[0].text == \
        client.completions.create(seed=(1 << 63) - 1, **kwargs).choices[0].text
    assert client.completions.create(seed=-(1 << 63), **kwargs).choices[0].text == \
        client.completions.create(seed=0, **kwargs).choices[0].text


def test_shutdown_ends_running_requests_with_an_error(tmp_path):
    """On shutdown both ports stay open for the grace (/health and new requests get 503, gRPC
    health NOT_SERVING and new calls UNAVAILABLE); at its end a running stream ends with an error
    event and [DONE], a running whole request gets a 503, a running gRPC call UNAVAILABLE "the
    drafter is shutting down" (not gRPC's own cancellation)."""
    import http.client
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    target = shipped_target_with_template(tmp_path / MODEL_NAME)
    with shipped_services(target) as (_, drafter):
        scheduler = drafter.server.engine.scheduler
        receive = scheduler.link.receive

        def slow_receive(*args, **kwargs):  # rounds of 20 ms at least: the requests outlast the grace
            time.sleep(0.02)
            return receive(*args, **kwargs)
        scheduler.link.receive = slow_receive
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0}
        conn = http.client.HTTPConnection("127.0.0.1", drafter.server.http_port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body | {"stream": True}),
                     {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        channel = grpc.insecure_channel(f"127.0.0.1:{drafter.port}", options=CHANNEL_OPTIONS)
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text=PROMPT, max_new_tokens=400)
        grpc_stream = stub.Generate(request, timeout=60)
        assert next(grpc_stream).HasField("delta")
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(post, drafter, "/v1/completions", body)
            deadline = time.monotonic() + 30
            while len(scheduler._running) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(scheduler._running) == 3
            stopped = threading.Event()
            stopping = asyncio_call(drafter, drafter.server.stop(grace=1.0), stopped)
            time.sleep(0.2)  # within the grace
            assert get(drafter, "/health") == (503, {"status": "not serving"})
            assert post(drafter, "/v1/completions", body)[0] == 503
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:
                stub.GenerateOnce(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
            assert not stopped.is_set()
            stopping.result(30)
            rest = stream.read()  # to the end of the stream
            status, reply = whole.result(30)
            with pytest.raises(grpc.RpcError) as cut:
                list(grpc_stream)
        events = [line for line in rest.split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2] and b"unavailable" in events[-2], events[-3:]
        assert status == 503 and reply["error"]["code"] == "unavailable", reply
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
        assert cut.value.details() == "the drafter is shutting down", cut.value.details()
        conn.close()
        channel.close()


def asyncio_call(running, coro, done):
    """Run `coro` on a server's loop without waiting; `done` is set when it returns."""
    import asyncio

    async def run():
        try:
            await coro
        finally:
            done.set()
    return asyncio.run_coroutine_threadsafe(run(), running.loop)


def test_a_cancel_waits_for_its_tasks_even_when_cancelled_itself():
    """`_cancel` returns (or raises the cancel it got meanwhile) only once every task is done: the
    generators those tasks await may be closed only then."""
    from drafter_svc.http_api import _cancel

    async def slow_to_stop():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.1)  # cleanup that takes a while
            raise

    async def main():
        tasks = [asyncio.create_task(slow_to_stop()) for _ in range(3)]
        await asyncio.sleep(0)
        cancelling = asyncio.create_task(_cancel(tasks))
        await asyncio.sleep(0.02)
        cancelling.cancel()  # a second cancel, while it waits
        with pytest.raises(asyncio.CancelledError):
            await cancelling
        return [t.done() for t in tasks]

    assert asyncio.run(main()) == [True, True, True]
