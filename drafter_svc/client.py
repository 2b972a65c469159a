"""Command-line client of the Generation API: streams the text, then prints the stats.

    python -m drafter_svc.client --server HOST:PORT "prompt" [--max-new-tokens N] [--temperature T] ...

`--chat` sends the prompt as one user message (after a `--system` message, if given), rendered
by the server with the model's chat template; `--template-kwarg enable_thinking=false` sets a
template variable ("true" and "false" are booleans).
"""
from __future__ import annotations

import json
import sys

import grpc

from common.cli import FlagParser, fail
from common.rpc import CHANNEL_OPTIONS, pb, pb_grpc


def build_request(a) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    if a.seed is not None:
        sampling.seed = a.seed
    req = pb.GenerateRequest(sampling=sampling, stop_token_ids=a.stop_token_id or [], stop=a.stop or [],
                             max_new_tokens=a.max_new_tokens)
    if a.prompt_ids is not None:
        try:
            req.token_ids.ids.extend(int(x) for x in a.prompt_ids.split(",") if x.strip())
        except ValueError:
            fail(f"--prompt-ids must be comma-separated integers, got {a.prompt_ids!r}")
    elif a.chat:
        if a.system is not None:
            req.chat.messages.add(role="system", content=a.system)
        req.chat.messages.add(role="user", content=a.prompt)
        for item in a.template_kwarg or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                fail(f"--template-kwarg must be KEY=VALUE, got {item!r}")
            req.chat.template_kwargs[key] = value
    else:
        req.text = a.prompt
    if a.tree_budget is not None:
        req.tree_budget = a.tree_budget
    return req


def parse_args(argv=None):
    p = FlagParser(prog="python -m drafter_svc.client", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", help="prompt text")
    p.flag("--server", env="DRAFTER_ADDR", default="localhost:50050",
           help="drafter address HOST:PORT (default localhost:50050)")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids instead of text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message, in the model's chat template")
    p.add_argument("--system", help="with --chat: a system message before the prompt")
    p.add_argument("--template-kwarg", action="append", metavar="KEY=VALUE",
                   help="with --chat: a chat template variable, e.g. enable_thinking=false (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="below 1e-5 (0, the default) = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", help="stop token id (repeatable)")
    p.add_argument("--tree-budget", type=int, help="DDTree nodes per round (default: the server's)")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the call in seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    a = p.parse_args(argv)
    if (a.prompt is None) == (a.prompt_ids is None):
        fail("give a prompt text or --prompt-ids (one of them)")
    if (a.system is not None or a.template_kwarg) and not a.chat:
        fail("--system and --template-kwarg need --chat")
    if a.chat and a.prompt_ids is not None:
        fail("--chat sends the prompt text as a message: it does not take --prompt-ids")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    request = build_request(a)
    tokens, text, final = [], [], None
    with grpc.insecure_channel(a.server, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            for reply in stub.Generate(request, timeout=a.timeout):
                if reply.HasField("final"):
                    final = reply.final
                    continue
                tokens.extend(reply.delta.token_ids)
                text.append(reply.delta.text)
                if not a.json:
                    print(reply.delta.text, end="", flush=True)
        except grpc.RpcError as exc:
            fail(f"{exc.code().name}: {exc.details()}", code=1)
    s = final.stats
    if a.json:
        print(json.dumps({"tokens": tokens, "text": "".join(text), "finish_reason": final.finish_reason,
                          "prompt_tokens": final.usage.prompt_tokens,
                          "completion_tokens": final.usage.completion_tokens, "rounds": s.rounds,
                          "acceptance_lengths": list(s.acceptance_lengths), "mean_acceptance": s.mean_acceptance,
                          "time_to_first_token_s": s.time_to_first_token_s, "tokens_per_s": s.tokens_per_s,
                          "elapsed_s": s.elapsed_s}))
        return
    print()
    print(f"[{final.finish_reason}] {final.usage.completion_tokens} tokens in {s.rounds} rounds, mean acceptance "
          f"{s.mean_acceptance:.2f}, {s.tokens_per_s:.1f} tokens/s, first token {s.time_to_first_token_s * 1000:.0f} ms, "
          f"{s.elapsed_s:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
