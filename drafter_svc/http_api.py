"""The drafter's OpenAI-compatible HTTP API, on the drafter's event loop beside its gRPC server.

    GET  /v1/models             the one model served (`DrafterConfig.model_name`)
    POST /v1/completions        prompt: a string, a list of token ids, or a list of either (a batch)
    POST /v1/chat/completions   messages, rendered with the target's chat template (drafter_svc.chat)
    GET  /health                200 while the drafter serves (its verifier answers), else 503
    GET  /metrics               Prometheus text (common.metrics)

A request body is translated into the gRPC API's `GenerateRequest` (this module checks only
JSON types and the OpenAI fields it does not support) and goes through the very path gRPC
requests take, `GenerationService.generate`: the same validation, scheduler and stop strings.
`stream: true` answers with server-sent events in OpenAI's chunk format, ending with
`data: [DONE]`. Errors have OpenAI's body `{"error": {"message", "type", "param", "code"}}`;
the gRPC status a generation fails with maps to the HTTP status (`HTTP_STATUS`). An error
after a stream started is sent as one `data: {"error": ...}` event before `[DONE]`.

`n` choices per prompt, and for completions a list of prompts, run as that many generations
side by side (choice `index` = prompt x n + j; choice j > 0 of a seeded request samples with
seed + j, so that the choices differ; usage counts each prompt once, every choice's tokens).
Unknown fields are ignored, as OpenAI clients send fields for other servers; known ones
that would change the output and are not supported (echo, best_of, tools, ...)
get 400. `logit_bias` is OpenAI's (token id keys, values in [-100, 100]), as are
`presence_penalty` and `frequency_penalty` (in [-2, 2]). Logprobs
(completions: `logprobs` N; chat: `logprobs: true` with `top_logprobs` N; N <= 20) are those of
the gRPC API (`GenerateRequest.logprobs`), in OpenAI's formats, each token's text being the
token decoded alone. Extensions: `top_k`, `stop_token_ids`, `ignore_eos` (vLLM's and SGLang's:
the model's end-of-sequence tokens do not stop it), `min_tokens` (vLLM's: the first N tokens are
no stop token), `repetition_penalty` (vLLM's, in (0, 100]), `tree_budget`, and for chat
`chat_template_kwargs` and `add_generation_prompt`. With `--api-key` the /v1 endpoints need
`Authorization: Bearer <key>`; with `--tls-cert` the port speaks HTTPS only.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from common import metrics
from common.auth import presents_key
from common.grpc_server import MIB, bind_error_reason
from common.protocol import BIAS_LIMIT, MAX_LOGPROBS, SEED_LIMIT, ContextTooLong, StatusError, TokenLogprob
from common.rpc import pb
from drafter_svc.server import Finished, GenerationService, InFlight, TextDelta
from drafter_svc.session import QueueFull
from drafter_svc.text_stream import TextStream, TokenBytes

log = logging.getLogger("drafter_svc.http")

# The HTTP status (and OpenAI error type) of each gRPC status a generation can fail with.
HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}
INT32, UINT32 = 1 << 31, 1 << 32
MAX_CHOICES = 128  # generations one request may ask for: prompts x n (OpenAI's cap on n)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's, for requests that send none
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # SamplingParams' fields of these names
# OpenAI fields this server does not implement: a request may send them only with these values.
UNSUPPORTED = {
    "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"),  # with no tools (any given get 400), "auto" calls none
    "response_format": (None, {"type": "text"}),
}


class BadRequest(Exception):
    """A request this API refuses (HTTP 400 unless `status` says otherwise), with the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True)
class ApiRequest:
    """An OpenAI request, checked and translated for the generation path."""
    chat: bool                   # /v1/chat/completions (else /v1/completions)
    choices: tuple[pb.GenerateRequest, ...]  # one generation per choice, in `index` order
    n: int                       # choices per prompt: choice i is of prompt i // n
    stream: bool
    include_usage: bool          # stream_options.include_usage: a last chunk with the usage


# -- request bodies ---------------------------------------------------------------------------------

def _typed(body: dict, name: str, kinds: tuple[type, ...], what: str):
    """body[name] if it is of one of `kinds` (booleans are not numbers), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise BadRequest(f"{name} must be {what}, got {type(value).__name__}", name)
    return value


def _number(body: dict, name: str) -> float | None:
    value = _typed(body, name, (int, float), "a number")
    return None if value is None else float(value)


def _integer(body: dict, name: str, low: int, high: int, high_text: str = "", low_text: str = "") -> int | None:
    """An integer in [low, high) (the range the protobuf field takes, or the domain's where the
    field's is wider); `high_text` and `low_text` write them in the message (e.g. 2^63)."""
    value = _typed(body, name, (int,), "an integer")
    if value is not None and not low <= value < high:
        raise BadRequest(f"{name} must be in [{low_text or low}, {high_text or high}), got {value}", name)
    return value


def _token_ids(value: Any, name: str, what: str = "a string or a list of integer token ids") -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name} must be {what}", name)
    if any(not -(1 << 63) <= t < 1 << 63 for t in value):
        raise BadRequest(f"{name} has token ids out of range", name)
    return value


def _strings(body: dict, name: str) -> list[str]:
    """A string or a list of strings (stop)."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise BadRequest(f"{name} must be a string or a list of strings", name)


def _is_default(value: Any, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed` (0.0 equals 0, but 0 is not False)."""
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


def _check_unsupported(body: dict) -> None:
    for name, allowed in UNSUPPORTED.items():
        if not _is_default(body.get(name), allowed):
            raise BadRequest(f"{name} is not supported", name)


def _fill_common(body: dict, req: pb.GenerateRequest, max_tokens: int | None) -> tuple[bool, bool]:
    """The fields completions and chat share; returns (stream, include_usage)."""
    _check_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    if max_tokens is not None:
        req.max_new_tokens = max_tokens
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    top_k = _integer(body, "top_k", -INT32, INT32)
    # Any 64-bit seed, as vLLM takes: a negative one is taken modulo 2^63 (the engine's range).
    seed = _integer(body, "seed", -SEED_LIMIT, SEED_LIMIT, "2^63", "-2^63")
    # OpenAI samples at temperature 1 unless told otherwise (the gRPC API's unset is greedy).
    req.sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    if top_k == -1:  # vLLM's "no top-k"
        top_k = 0
    if top_p is not None:
        req.sampling.top_p = top_p
    if top_k is not None:
        req.sampling.top_k = top_k
    if seed is not None:
        req.sampling.seed = seed % SEED_LIMIT
    for name in PENALTIES:
        value = _number(body, name)
        if value is not None:
            setattr(req.sampling, name, value)
    req.stop.extend(_strings(body, "stop"))
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise BadRequest("stop_token_ids must be a list of integer token ids", "stop_token_ids")
        req.stop_token_ids.extend(_token_ids(stop_ids, "stop_token_ids", "a list of integer token ids"))
    req.ignore_eos = bool(_typed(body, "ignore_eos", (bool,), "a boolean"))
    req.min_tokens = _integer(body, "min_tokens", 0, UINT32) or 0
    for token, value in _logit_bias(body).items():
        req.logit_bias[token] = value
    budget = _integer(body, "tree_budget", 0, UINT32)
    if budget is not None:
        req.tree_budget = budget
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    options = _typed(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    include_usage = bool(_typed(options or {}, "include_usage", (bool,), "a boolean"))
    return stream, include_usage


_TOKEN_ID = re.compile(r"-?(0|[1-9][0-9]*)")


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to biases in [-100, 100]."""
    value = _typed(body, "logit_bias", (dict,), "an object of token ids to numbers") or {}
    out = {}
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(key):  # not int()'s " 5", "+5", "1_0" or other scripts' digits
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token = int(key)
        if not -(1 << 63) <= token < 1 << 63:
            raise BadRequest("logit_bias has token ids out of range", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= BIAS_LIMIT:
            raise BadRequest(f"logit_bias values must be numbers in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bias!r}",
                             "logit_bias")
        out[token] = float(bias)
    return out


def _object(data: bytes) -> dict:
    """The body as a JSON object whose strings are all text: JSON lets a string hold a lone UTF-16
    surrogate (an escape such as \\ud800), which no UTF-8 tokenizer or protobuf string takes."""
    try:
        body = json.loads(data)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError at a lone surrogate
    except UnicodeEncodeError:
        raise BadRequest("the body holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff), which is "
                         "not text") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _choices(body: dict, req: pb.GenerateRequest, prompts: list[pb.GenerateRequest | None]) -> tuple:
    """The request's generations: `n` per prompt (`prompts`: each prompt's fields, or None: the
    chat's one conversation, already in `req`), with seed + j for choice j > 0 of a seeded request."""
    n = _integer(body, "n", 1, MAX_CHOICES + 1)
    n = 1 if n is None else n
    if len(prompts) * n > MAX_CHOICES:
        raise BadRequest(f"at most {MAX_CHOICES} choices a request: {len(prompts)} prompts x n {n}", "n")
    choices = []
    for prompt in prompts:
        for j in range(n):
            choice = pb.GenerateRequest()
            choice.CopyFrom(req)
            if prompt is not None:
                choice.MergeFrom(prompt)
            if j and req.sampling.HasField("seed"):
                choice.sampling.seed = (req.sampling.seed + j) % SEED_LIMIT
            choices.append(choice)
    return tuple(choices), n


def _prompt(prompt: Any) -> pb.GenerateRequest:
    """One completions prompt (a string or a list of token ids) as the fields of a request."""
    req = pb.GenerateRequest()
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, list):
        req.token_ids.SetInParent()
        req.token_ids.ids.extend(_token_ids(prompt, "prompt"))
    else:
        raise BadRequest("prompt is required: a string, a list of integer token ids, or a list of either", "prompt")
    return req


def parse_completion(data: bytes) -> ApiRequest:
    """A /v1/completions body; BadRequest when it is not one this server takes."""
    body = _object(data)
    req = pb.GenerateRequest()
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    if batch and len(prompt) > MAX_CHOICES:
        raise BadRequest(f"at most {MAX_CHOICES} prompts a request, got {len(prompt)}", "prompt")
    prompts = [_prompt(p) for p in prompt] if batch else [_prompt(prompt)]
    stream, include_usage = _fill_common(body, req, _integer(body, "max_tokens", 1, UINT32))
    logprobs = _integer(body, "logprobs", 0, MAX_LOGPROBS + 1)
    if logprobs is not None:
        req.logprobs = logprobs
    choices, n = _choices(body, req, prompts)
    return ApiRequest(False, choices, n, stream, include_usage)


def _content(message: dict, i: int) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(data: bytes) -> ApiRequest:
    """A /v1/chat/completions body; BadRequest when it is not one this server takes."""
    body = _object(data)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    req = pb.GenerateRequest()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", f"messages[{i}]")
        if m.get("tool_calls") or m.get("function_call"):
            raise BadRequest("tool calls are not supported", f"messages[{i}]")
        req.chat.messages.add(role=m["role"], content=_content(m, i))
    add_prompt = _typed(body, "add_generation_prompt", (bool,), "a boolean")
    if add_prompt is not None:
        req.chat.add_generation_prompt = add_prompt
    kwargs = _typed(body, "chat_template_kwargs", (dict,), "an object")
    for key, value in (kwargs or {}).items():
        if not isinstance(value, (str, bool)):
            raise BadRequest(f"chat_template_kwargs[{key!r}] must be a string or a boolean", "chat_template_kwargs")
        req.chat.template_kwargs[key] = value if isinstance(value, str) else str(value).lower()
    max_tokens = _integer(body, "max_completion_tokens", 1, UINT32)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, UINT32)
    stream, include_usage = _fill_common(body, req, max_tokens)
    wanted = _typed(body, "logprobs", (bool,), "a boolean")
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS + 1)
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
    if wanted:
        req.logprobs = top or 0
    choices, n = _choices(body, req, [None])
    return ApiRequest(True, choices, n, stream, include_usage)


# -- responses --------------------------------------------------------------------------------------

def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> web.Response:
    return _json(error_body(message, kind, param, code), status)


# The request field a refusal from the generation path names first, as this API calls it (the
# prompt is the chat's messages): the first of these names that begins the message.
_PARAMS = (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
           ("max_new_tokens", "max_tokens"), ("tree_budget", "tree_budget"), ("logprobs", "logprobs"),
           ("min_tokens", "min_tokens"), ("logit_bias", "logit_bias"),
           *((name, name) for name in PENALTIES),
           ("stop token ids", "stop_token_ids"), ("stop", "stop"), ("prompt", "prompt"))


def status_error_body(exc: StatusError, chat: bool = False, where: str = "") -> tuple[int, dict]:
    """An error from the generation path: its HTTP status and OpenAI's body, with the field at
    fault (`param`) where the message names one, and `context_length_exceeded` as its `code` for
    a context the request overflows (else the gRPC status, lowercased); `where` goes before the
    message (which prompt of a batch)."""
    status, kind = HTTP_STATUS.get(exc.status, (500, "server_error"))
    if isinstance(exc, ContextTooLong):
        param, code = dict(_PARAMS)[exc.field], "context_length_exceeded"
    else:
        param = next((ours for theirs, ours in _PARAMS
                      if exc.status == "INVALID_ARGUMENT" and exc.message.startswith(theirs)), None)
        code = exc.status.lower()
    return status, error_body(where + exc.message, kind, "messages" if chat and param == "prompt" else param, code)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json")


def _usage(ends: list[Finished], n: int) -> dict:
    """OpenAI's usage: each prompt's tokens once (choice i is of prompt i // n), every choice's tokens."""
    prompt = sum(end.prompt_tokens for end in ends[::n])
    completion = sum(len(end.result.tokens) for end in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Output:
    """The response objects of one request, in the completions or chat format."""

    def __init__(self, req: ApiRequest, model: str, tokenizer, token_bytes: TokenBytes):
        self.req, self.model, self.tokenizer, self.token_bytes = req, model, tokenizer, token_bytes
        # completions' text_offset: where each token's text begins in its choice's text, by the
        # same incremental decoding (a token ending part of a character begins where it does)
        self._texts = [TextStream(tokenizer) for _ in req.choices]
        self._offsets = [0] * len(req.choices)
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if req.chat else "text_completion"

    def _frame(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def logprobs(self, logprobs: list[TokenLogprob] | None, index: int = 0) -> dict | None:
        """Choice `index`'s `logprobs` object for these tokens (None when the request did not ask)."""
        if logprobs is None:
            return None
        text = self.tokenizer.decode
        if self.req.chat:
            def entry(token: int, value: float) -> dict:
                return {"token": text([token]), "logprob": value, "bytes": list(self.token_bytes(token))}

            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                                for t in logprobs], "refusal": None}
        tokens = [text([t.token]) for t in logprobs]
        offsets = []
        for t in logprobs:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(self._texts[index].push([t.token])[1])
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{text([i]): v for i, v in t.top} for t in logprobs], "text_offset": offsets}

    def whole(self, texts: list[str], ends: list[Finished]) -> dict:
        """The non-streamed response: each choice's text and end."""
        choices = []
        for index, (text, end) in enumerate(zip(texts, ends)):
            reason, logprobs = end.result.finish_reason, self.logprobs(end.result.logprobs, index)
            if self.req.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        frame = self._frame(choices, usage=_usage(ends, self.req.n))
        frame["object"] = "chat.completion" if self.req.chat else "text_completion"
        return frame

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False,
              logprobs: list[TokenLogprob] | None = None, index: int = 0) -> dict:
        """One streamed chunk of choice `index`: new text (and its tokens' logprobs), or (text None)
        the finish reason."""
        lp = self.logprobs(logprobs, index) if logprobs else None
        if self.req.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
        return self._frame([choice], **({"usage": None} if self.req.include_usage else {}))

    def usage_chunk(self, ends: list[Finished]) -> dict:
        return self._frame([], usage=_usage(ends, self.req.n))


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


# -- the handlers -----------------------------------------------------------------------------------

class OpenAIApi:
    """The HTTP endpoints over one `GenerationService`."""

    def __init__(self, service: GenerationService):
        self.service = service
        cfg = service.engine.cfg
        self.model = cfg.model_name
        self.api_key = cfg.api_key
        self.started = int(time.time())
        self.token_bytes = TokenBytes(service.engine.tokenizer)

    def _authorized(self, request: web.Request) -> bool:
        return not self.api_key or presents_key(request.headers.get("Authorization"), self.api_key)

    async def health(self, _request: web.Request) -> web.Response:
        serving = self.service.serving
        return _json({"status": "serving" if serving else "not serving"}, 200 if serving else 503)

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _unauthorized()
        card = {"id": self.model, "object": "model", "created": self.started, "owned_by": "ddtree-serve"}
        if "model" in request.match_info:
            if request.match_info["model"] != self.model:
                return error_response(404, f"model {request.match_info['model']!r} does not exist; this server "
                                           f"serves {self.model!r}", param="model", code="model_not_found")
            return _json(card)
        return _json({"object": "list", "data": [card]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: web.Request, parse: Callable[[bytes], ApiRequest]) -> web.StreamResponse:
        if not self._authorized(request):
            return _unauthorized()
        try:
            data = await request.read()
            req = await asyncio.to_thread(parse, data)  # a large body takes a while to parse
        except BadRequest as exc:
            metrics.REQUESTS.labels("http", "none", "INVALID_ARGUMENT").inc()
            return error_response(exc.status, exc.message, param=exc.param)
        except Exception:  # a bug: the middleware answers 500 and logs it
            metrics.REQUESTS.labels("http", "none", "INTERNAL").inc()
            raise
        slots = self.service.engine.scheduler.max_sessions
        if len(req.choices) > slots:  # its choices could never all run (nor all wait within the queue timeout)
            metrics.REQUESTS.labels("http", "none", "INVALID_ARGUMENT").inc()
            return error_response(400, f"{len(req.choices)} choices (prompts x n) are more than the {slots} "
                                       f"generations this server runs at once", param="n")
        out = _Output(req, self.model, self.service.engine.tokenizer, self.token_bytes)
        async with contextlib.AsyncExitStack() as stack:  # closing a generation cancels it
            gens = [await stack.enter_async_context(contextlib.aclosing(self.service.generate(choice, "http")))
                    for choice in req.choices]
            try:
                # validation, queueing and each choice's first token: errors keep their status
                firsts = await _together([anext(g) for g in gens])
            except _ChoiceFailed as failed:
                status, body = status_error_body(failed.error, req.chat, self._where(req, failed.index))
                response = _json(body, status)
                if isinstance(failed.error, QueueFull):  # the queue is full: when to try again, in whole seconds
                    response.headers["Retry-After"] = str(math.ceil(failed.error.retry_after_s))
                return response
            if req.stream:
                return await self._stream(request, out, firsts, gens)
            try:
                outputs = await _together([_whole(first, g) for first, g in zip(firsts, gens)])
            except _ChoiceFailed as failed:
                status, body = status_error_body(failed.error, req.chat, self._where(req, failed.index))
                return _json(body, status)
            return _json(out.whole([text for text, _ in outputs], [end for _, end in outputs]))

    @staticmethod
    def _where(req: ApiRequest, index: int) -> str:
        """Which prompt of a batch an error is of ("" for one prompt)."""
        return f"prompt {index // req.n} of the batch: " if len(req.choices) > req.n else ""

    async def _stream(self, request: web.Request, out: _Output, firsts: list[TextDelta | Finished],
                      gens: list) -> web.StreamResponse:
        """The choices' chunks as they come (each choice's in order), each choice's finish, then the
        usage when asked for, and [DONE]; a failed choice ends the stream with its error event."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        items: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, item: TextDelta | Finished, g) -> None:
            try:
                await items.put((index, item))
                while not isinstance(item, Finished):
                    item = await anext(g)
                    await items.put((index, item))
            except Exception as exc:  # StatusError: the choice failed; another: a bug, raised below
                await items.put((index, exc))

        pumps = [asyncio.create_task(pump(i, first, g)) for i, (first, g) in enumerate(zip(firsts, gens))]
        try:
            if out.req.chat:
                for index in range(len(gens)):
                    await response.write(_event(out.chunk(None, role=True, index=index)))
            ends: dict[int, Finished] = {}
            while len(ends) < len(gens):
                index, item = await items.get()
                if isinstance(item, Exception) and not isinstance(item, StatusError):
                    raise item
                if isinstance(item, StatusError):
                    await response.write(_event(status_error_body(item, out.req.chat, self._where(out.req, index))[1]))
                    break
                if isinstance(item, Finished):
                    ends[index] = item
                    await response.write(_event(out.chunk(None, item.result.finish_reason, index=index)))
                elif item.text or item.logprobs:
                    await response.write(_event(out.chunk(item.text, logprobs=item.logprobs, index=index)))
            else:
                if out.req.include_usage:
                    await response.write(_event(out.usage_chunk([ends[i] for i in range(len(gens))])))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:  # the client went away: closing the generators cancels the generations
            pass
        finally:
            await _cancel(pumps)
        return response


async def _whole(first: TextDelta | Finished, gen) -> tuple[str, Finished]:
    """A choice's whole text and its end, from its first item on."""
    text, item = [], first
    while not isinstance(item, Finished):
        text.append(item.text)
        item = await anext(gen)
    return "".join(text), item


class _ChoiceFailed(Exception):
    """Choice `index` of a request failed with `error`."""

    def __init__(self, index: int, error: StatusError):
        super().__init__(error.message)
        self.index, self.error = index, error


async def _together(awaitables: list[Awaitable]) -> list:
    """Run them side by side; their results in order. A StatusError of one raises _ChoiceFailed
    (another exception itself) once the others are cancelled: a generation's generator may be
    closed only when nothing awaits it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for index, task in enumerate(tasks):
            if task.done() and (error := task.exception()) is not None:
                raise _ChoiceFailed(index, error) if isinstance(error, StatusError) else error
        return [task.result() for task in tasks]
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    """Cancel the tasks not done and wait until they are (a gather cancelled meanwhile still waits
    for its tasks before it raises)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _unauthorized() -> web.Response:
    return error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                          kind="authentication_error", code="invalid_api_key")


# -- the server -------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _InProgress:
    """An app middleware: counts the requests in progress (for a graceful stop) and gives every
    error OpenAI's body (aiohttp's own 404, 405 and 413 included)."""

    def __init__(self):
        self.requests = InFlight()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.requests.enter()
        try:
            response = await self._answer(request, handler)
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            metrics.HTTP_REQUESTS.labels(route, str(response.status)).inc()
            return response
        finally:
            self.requests.leave()

    @staticmethod
    async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.text or exc.reason)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            log.exception("HTTP handler failed")
            return error_response(500, "internal error in the drafter; see its log", kind="server_error")


class HttpServer:
    """A running HTTP API. Shutdown is in two parts: `drain(grace)` lets the requests in progress
    finish for `grace` seconds while the port stays open (new requests and /health get 503: the
    service is draining); `close()`, once the scheduler has failed whatever still runs (each
    stream then ends with an error event and [DONE], each other request with a 503), closes the
    port and the connections."""

    # How long `close` waits for handlers to write the errors of the sessions the scheduler failed.
    CLOSE_WAIT_S = 2.0

    def __init__(self, runner: web.AppRunner, port: int, in_progress: _InProgress):
        self.runner, self.port, self._in_progress = runner, port, in_progress

    async def drain(self, grace: float) -> None:
        await self._in_progress.requests.wait_idle(grace)

    async def close(self) -> None:
        await self.drain(self.CLOSE_WAIT_S)
        for site in list(self.runner.sites):  # no new connections
            await site.stop()
        await self.runner.cleanup()  # closes the connections; handlers still running are cancelled


def _ssl_context(tls) -> ssl.SSLContext | None:
    """The server side of `common.tls.ServerTls` for HTTPS (mutual TLS with a client CA)."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca:
        context.load_verify_locations(tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def serve_http(service: GenerationService, host: str, port: int) -> HttpServer:
    """Start the HTTP API on host:port (0 = any free port) on the running loop. OSError when the
    address cannot be bound."""
    api = OpenAIApi(service)
    in_progress = _InProgress()
    app = web.Application(client_max_size=service.engine.cfg.max_message_mb * MIB,
                          middlewares=[in_progress.middleware])
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model:.+}", api.models)  # names may hold "/" (org/model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", metrics.metrics_handler("drafter"))
    # handler_cancellation: a client that goes away cancels its handler, and so its generation.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=_ssl_context(service.engine.cfg.tls), reuse_port=False)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen on {host}:{port} (HTTP): {bind_error_reason(exc)}") from None
    return HttpServer(runner, runner.addresses[0][1], in_progress)
