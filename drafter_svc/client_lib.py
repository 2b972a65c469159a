"""A Python client of the drafter's Generation API: synchronous and asyncio, typed results.

    from drafter_svc.client_lib import GenerationClient

    with GenerationClient("localhost:50050") as client:
        result = client.generate("def fibonacci(n):", max_new_tokens=64)
        print(result.text, result.mean_acceptance)
        for item in client.stream(messages=[{"role": "user", "content": "hi"}]):
            print(item.text, end="")  # GenerationDelta items, then one GenerationResult

`AsyncGenerationClient` has the same methods as coroutines / async iterators (grpc.aio). A
prompt is text, token ids or chat messages (rendered by the server with the model's chat
template). TLS takes the CA that signed the drafter's certificate (plus a client certificate
and key for mutual TLS); `api_key` is sent as `authorization: Bearer KEY`. Every failure, a
request refused by the server or by the checks here, raises `GenerationError` carrying the gRPC
status code's name and its message. Closing a stream (or cancelling the task awaiting a call)
cancels the RPC, which frees the server's session at once.
"""
from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from common.auth import bearer_metadata
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc
from common.tls import ChannelTls, TlsError, open_channel

__all__ = ["AsyncGenerationClient", "ChatMessage", "GenerationClient", "GenerationDelta", "GenerationError",
           "GenerationResult", "TlsError", "build_request"]


class GenerationError(Exception):
    """A failed generation: `code` is the gRPC status code's name ("INVALID_ARGUMENT",
    "UNAVAILABLE", ...), `message` the server's one-line reason."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> "GenerationError":
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else None
        return cls(code.name if code is not None else "UNKNOWN", details or str(exc))


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation."""
    role: str
    content: str


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log probability, and the most likely tokens at its position
    ((token id, logprob) pairs, most likely first), when the request asks (`logprobs`)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_proto(cls, t: pb.TokenLogprob) -> "TokenLogprob":
        return cls(t.token_id, t.logprob, tuple((a.token_id, a.logprob) for a in t.top))


@dataclass(frozen=True)
class GenerationDelta:
    """New output of one round (round 0: the first token, from the prompt's prefill)."""
    text: str
    token_ids: tuple[int, ...]
    round: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asks


@dataclass(frozen=True)
class RoundStats:
    """Where one verify round's time went, as the drafter saw its step (ms)."""
    tokens: int
    tree_nodes: int
    draft_ms: float
    build_ms: float
    verify_ms: float
    network_ms: float


@dataclass(frozen=True)
class GenerationResult:
    """A finished generation: its output, why it ended, and the server's statistics."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str                 # "stop" (EOS, a stop token or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    rounds: int                        # verify rounds (each emits accepted tokens plus one bonus)
    mean_acceptance: float             # tokens emitted per round
    acceptance_lengths: tuple[int, ...] = field(default=())  # tokens emitted by each round, bonus included
    round_stats: tuple[RoundStats, ...] = field(default=())  # one per verify round
    time_to_first_token_s: float = 0.0
    tokens_per_s: float = 0.0
    elapsed_s: float = 0.0
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token id, when the request asks

    @classmethod
    def from_final(cls, final: pb.GenerateFinal, text: str, token_ids: Sequence[int],
                   logprobs: Sequence[TokenLogprob] | None = None) -> "GenerationResult":
        s = final.stats
        return cls(text=text, token_ids=tuple(token_ids), finish_reason=final.finish_reason,
                   logprobs=tuple(logprobs) if logprobs is not None else None,
                   prompt_tokens=final.usage.prompt_tokens, completion_tokens=final.usage.completion_tokens,
                   rounds=s.rounds, mean_acceptance=s.mean_acceptance,
                   acceptance_lengths=tuple(s.acceptance_lengths),
                   round_stats=tuple(RoundStats(r.tokens, r.tree_nodes, r.draft_ms, r.build_ms, r.verify_ms,
                                                r.network_ms) for r in s.round_stats),
                   time_to_first_token_s=s.time_to_first_token_s,
                   tokens_per_s=s.tokens_per_s, elapsed_s=s.elapsed_s)


Message = ChatMessage | Mapping[str, str] | tuple[str, str]


def _chat_message(message: Message) -> pb.ChatMessage:
    if isinstance(message, ChatMessage):
        role, content = message.role, message.content
    elif isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
    elif isinstance(message, tuple) and len(message) == 2:
        role, content = message
    else:
        raise ValueError(f"a chat message is a ChatMessage, a {{role, content}} mapping or a (role, content) "
                         f"pair, got {type(message).__name__}")
    if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError("a chat message needs a string role and a string content")
    return pb.ChatMessage(role=role, content=content)


def build_request(prompt: str | None = None, *, token_ids: Sequence[int] | None = None,
                  messages: Sequence[Message] | None = None, max_new_tokens: int | None = None,
                  temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  tree_budget: int | None = None, add_generation_prompt: bool | None = None,
                  template_kwargs: Mapping[str, str] | None = None, logprobs: int | None = None,
                  ignore_eos: bool = False, min_tokens: int = 0,
                  logit_bias: Mapping[int, float] | None = None, presence_penalty: float | None = None,
                  frequency_penalty: float | None = None,
                  repetition_penalty: float | None = None) -> pb.GenerateRequest:
    """The GenerateRequest of these arguments; exactly one of `prompt` (text), `token_ids` and
    `messages` (chat). None leaves a field unset (the server's default; for `logprobs`, none:
    N in 0..20 asks for each token's logprob and the N most likely tokens). `ignore_eos`: the
    model's end-of-sequence tokens do not end the generation; `min_tokens`: the first N tokens
    are no stop token (nor, without ignore_eos, an end-of-sequence token); `logit_bias`: token id
    -> a bias in [-100, 100] added to the target's logit, as OpenAI's; `presence_penalty`,
    `frequency_penalty` (OpenAI's) and `repetition_penalty` (vLLM's): the repetition penalties
    (`SamplingParams`; None or their neutral value leaves them off). GenerationError
    INVALID_ARGUMENT when they cannot form a request (the server checks the values further)."""
    try:
        if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
            raise ValueError("give exactly one of prompt (text), token_ids and messages (chat)")
        if (add_generation_prompt is not None or template_kwargs) and messages is None:
            raise ValueError("add_generation_prompt and template_kwargs go with messages (chat)")
        if isinstance(stop, str):
            stop = [stop]
        req = pb.GenerateRequest(stop=list(stop), ignore_eos=bool(ignore_eos))
        _field(lambda: req.stop_token_ids.extend(int(t) for t in stop_token_ids), "stop_token_ids")
        _field(lambda: req.logit_bias.update({int(t): float(v) for t, v in (logit_bias or {}).items()}), "logit_bias")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
            req.text = prompt
        elif token_ids is not None:
            _field(lambda: req.token_ids.ids.extend(int(t) for t in token_ids), "token_ids")
            req.token_ids.SetInParent()  # an empty list is still a token_ids prompt (the server refuses it)
        else:
            req.chat.messages.extend(_chat_message(m) for m in messages)
            req.chat.SetInParent()
            if add_generation_prompt is not None:
                req.chat.add_generation_prompt = bool(add_generation_prompt)
            for key, value in (template_kwargs or {}).items():
                req.chat.template_kwargs[key] = value if isinstance(value, str) else str(value).lower()
        for name, value in (("max_new_tokens", max_new_tokens), ("tree_budget", tree_budget), ("logprobs", logprobs),
                            ("min_tokens", min_tokens or None)):
            if value is not None:
                _field(functools.partial(setattr, req, name, value), name)
        req.sampling.SetInParent()
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed),
                            ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                            ("repetition_penalty", repetition_penalty)):
            if value is not None:
                _field(functools.partial(setattr, req.sampling, name, value), name)
    except (ValueError, TypeError) as exc:
        raise GenerationError("INVALID_ARGUMENT", str(exc)) from None
    return req


def _field(write: Callable[[], None], name: str) -> None:
    """Run `write`, which sets one field of the request: protobuf refuses out-of-range and mistyped
    values with a message that does not name the field ("Value out of range: -1"); name it."""
    try:
        write()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None


class _Accumulator:
    """Turns the stream's replies into typed deltas and the final result."""

    def __init__(self, request: pb.GenerateRequest):
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.HasField("logprobs") else None

    def reply(self, reply: pb.GenerateResponse) -> GenerationDelta | GenerationResult:
        if reply.HasField("final"):
            return GenerationResult.from_final(reply.final, "".join(self.text), self.tokens, self.logprobs)
        delta = reply.delta
        self.text.append(delta.text)
        self.tokens.extend(delta.token_ids)
        logprobs = tuple(TokenLogprob.from_proto(t) for t in delta.logprobs)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs)
        return GenerationDelta(text=delta.text, token_ids=tuple(delta.token_ids), round=delta.round,
                               logprobs=logprobs)


def _once_result(request: pb.GenerateRequest, reply: pb.GenerateOnceResponse) -> GenerationResult:
    logprobs = [TokenLogprob.from_proto(t) for t in reply.logprobs] if request.HasField("logprobs") else None
    return GenerationResult.from_final(reply.final, reply.text, reply.token_ids, logprobs)


def _checked_tls(tls: ChannelTls | None, ca: str, cert: str, key: str, server_name: str) -> ChannelTls:
    tls = tls or ChannelTls(ca=ca, cert=cert, key=key, server_name=server_name)
    tls.check()  # TlsError (a ValueError), one line, before any call
    return tls


class GenerationClient:
    """A blocking client of one drafter (a channel; close it, or use the client as a context manager).

    TLS: `ca` (the CA bundle that signed the drafter's certificate), `cert` and `key` (a client
    certificate, for mutual TLS) and `server_name` (the name in the drafter's certificate when it is
    not the address's host), or a ready `tls`. Raises TlsError at once when they cannot work."""

    def __init__(self, address: str, *, ca: str = "", cert: str = "", key: str = "", server_name: str = "",
                 api_key: str = "", tls: ChannelTls | None = None):
        self.address = address
        self._channel = open_channel(address, _checked_tls(tls, ca, cert, key, server_name), CHANNEL_OPTIONS)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = bearer_metadata(api_key)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **options) -> GenerationResult:
        """The whole generation in one call (GenerateOnce). `options` are `build_request`'s."""
        request = build_request(prompt, **options)
        try:
            return _once_result(request, self._stub.GenerateOnce(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as exc:
            raise GenerationError.from_rpc(exc) from None

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **options) -> Iterator[GenerationDelta | GenerationResult]:
        """Yield a GenerationDelta per round with new output, then the GenerationResult. The call
        starts with the first item asked for; closing the iterator cancels it."""
        request = build_request(prompt, **options)
        return self._stream(request, timeout)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[GenerationDelta | GenerationResult]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        acc = _Accumulator(request)
        try:
            for reply in call:
                yield acc.reply(reply)
        except grpc.RpcError as exc:
            raise GenerationError.from_rpc(exc) from None
        finally:
            call.cancel()  # a no-op once the call has ended; otherwise the consumer went away

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "GenerationClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _aio_channel(address: str, tls: ChannelTls) -> grpc.aio.Channel:
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*CHANNEL_OPTIONS, *tls.channel_options()])


class AsyncGenerationClient:
    """The asyncio client (grpc.aio): the same arguments and methods as `GenerationClient`, awaited.
    Create it inside the event loop that uses it; `await client.close()` or `async with`."""

    def __init__(self, address: str, *, ca: str = "", cert: str = "", key: str = "", server_name: str = "",
                 api_key: str = "", tls: ChannelTls | None = None):
        self.address = address
        self._channel = _aio_channel(address, _checked_tls(tls, ca, cert, key, server_name))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = bearer_metadata(api_key)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **options) -> GenerationResult:
        """The whole generation in one call; cancelling the awaiting task cancels the RPC."""
        request = build_request(prompt, **options)
        call = self._stub.GenerateOnce(request, timeout=timeout, metadata=self._metadata)
        try:
            return _once_result(request, await call)
        except grpc.RpcError as exc:
            raise GenerationError.from_rpc(exc) from None
        finally:
            call.cancel()  # a no-op once answered; cancels the RPC when the task was cancelled

    async def stream(self, prompt: str | None = None, *, timeout: float | None = None,
                     **options) -> AsyncIterator[GenerationDelta | GenerationResult]:
        """Yield a GenerationDelta per round, then the GenerationResult; closing the iterator
        (`aclose`, leaving `async for` early through `contextlib.aclosing`) or cancelling the
        task cancels the RPC."""
        request = build_request(prompt, **options)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        acc = _Accumulator(request)
        try:
            async for reply in call:
                yield acc.reply(reply)
        except grpc.RpcError as exc:
            raise GenerationError.from_rpc(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncGenerationClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
