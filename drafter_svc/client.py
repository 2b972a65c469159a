"""Command-line client of the Generation API: streams the text, then prints the stats.

    python -m drafter_svc.client --server HOST:PORT "prompt" [--max-new-tokens N] [--temperature T] ...

A thin user of `drafter_svc.client_lib`. `--chat` sends the prompt as one user message (after a
`--system` message, if given), rendered by the server with the model's chat template;
`--template-kwarg enable_thinking=false` sets a template variable ("true" and "false" are
booleans). `--ca` (with `--cert`/`--key` for mutual TLS) dials a drafter that serves TLS;
`--api-key` (or `--api-key-file`) presents its key. `--stats` adds a table of the rounds, from
what the stream carries.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from common.auth import ApiKeyError, read_api_key
from common.cli import FlagParser, add_penalty_flags, fail, number_list, penalty_options, token_biases
from common.rpc import pb
from common.tls import ChannelTls, TlsError
from drafter_svc import client_lib
from drafter_svc.client_lib import GenerationClient, GenerationDelta, GenerationError, GenerationResult


def request_options(a) -> dict:
    """`client_lib.build_request`'s arguments from the parsed flags (exits on a malformed one)."""
    options = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                   seed=a.seed, stop=a.stop or [], stop_token_ids=a.stop_token_id or [], tree_budget=a.tree_budget,
                   logprobs=a.logprobs, ignore_eos=a.ignore_eos, min_tokens=a.min_tokens,
                   logit_bias=token_biases(a.logit_bias, "--logit-bias"), **penalty_options(a))
    if a.prompt_ids is not None:
        options["token_ids"] = number_list(a.prompt_ids, "--prompt-ids")
    elif a.chat:
        system = [{"role": "system", "content": a.system}] if a.system is not None else []
        options["messages"] = [*system, {"role": "user", "content": a.prompt}]
        kwargs = {}
        for item in a.template_kwarg or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                fail(f"--template-kwarg must be KEY=VALUE, got {item!r}")
            kwargs[key] = value
        if kwargs:
            options["template_kwargs"] = kwargs
    else:
        options["prompt"] = a.prompt
    return options


def build_request(a) -> pb.GenerateRequest:
    """The GenerateRequest of the parsed flags (exits with one line on a bad one)."""
    try:
        return client_lib.build_request(**request_options(a))
    except GenerationError as exc:
        fail(exc.message)


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
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-sequence tokens (stop ids and strings still stop)")
    p.add_argument("--logit-bias", action="append", metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to the target's logit of token ID, as OpenAI's logit_bias "
                        "(repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="the first N tokens are never a stop token id or (without --ignore-eos) an end-of-sequence "
                        "token: they are taken out of the target's distribution there (default 0)")
    add_penalty_flags(p)
    p.add_argument("--tree-budget", type=int, help="DDTree nodes per round (default: the server's)")
    p.add_argument("--logprobs", type=int, metavar="N",
                   help="also get each token's log probability and the N (0 to 20) most likely tokens at its "
                        "position: printed as a table after the text, or under \"logprobs\" with --json")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of the call in seconds (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.add_argument("--stats", action="store_true",
                   help="after the generation, print a table of its rounds (with --json: a per_round list)")
    p.flag("--ca", env="DDTREE_CA", default="", help="PEM CA bundle that signed the drafter's certificate: dial TLS")
    p.flag("--cert", env="DDTREE_CERT", default="", help="PEM client certificate (chain), for mutual TLS; needs --ca")
    p.flag("--key", env="DDTREE_KEY", default="", help="PEM private key of --cert")
    p.flag("--server-name", env="DDTREE_SERVER_NAME", default="",
           help="name the drafter's certificate must carry, when it is not the host of --server")
    p.flag("--api-key", env="DDTREE_API_KEY", default="", help="the drafter's API key (sent as 'authorization: Bearer')")
    p.flag("--api-key-file", env="DDTREE_API_KEY_FILE", default="", help="file holding the API key")
    a = p.parse_args(argv)
    if (a.prompt is None) == (a.prompt_ids is None):
        fail("give a prompt text or --prompt-ids (one of them)")
    if (a.system is not None or a.template_kwarg) and not a.chat:
        fail("--system and --template-kwarg need --chat")
    if a.chat and a.prompt_ids is not None:
        fail("--chat sends the prompt text as a message: it does not take --prompt-ids")
    if a.api_key and a.api_key_file:
        fail("give --api-key or --api-key-file, not both")
    a.tls = ChannelTls(ca=a.ca, cert=a.cert, key=a.key, server_name=a.server_name)
    try:
        a.tls.check()
        if a.api_key_file:
            a.api_key = read_api_key(a.api_key_file)
    except (TlsError, ApiKeyError) as exc:
        fail(str(exc))
    return a


@dataclass
class RoundRow:
    """One round: tokens emitted and where its time went (Stats.round_stats, ms), tokens and text
    streamed for it, and when its first delta arrived on the client's clock."""
    round: int
    emitted: int
    nodes: int | None = None
    draft_ms: float | None = None
    build_ms: float | None = None
    network_ms: float | None = None
    verify_ms: float | None = None
    delivered: int = 0
    text: str = ""
    arrived_s: float | None = None


ROUND_TABLE_NOTE = ("per round (round 0: the prefill's first token): emitted = tokens the round emitted, accepted "
                    "+ bonus; nodes = its tree's, root included; draft, build = the drafter's batched draft and tree "
                    "build of the round's step; network = its link round trip minus verify, the verifier's step "
                    "(ms; shared by the step's sessions); delivered = tokens streamed for it, after stop cuts; "
                    "arrived = client clock")


def round_rows(deltas: list[tuple[float, GenerationDelta]], result: GenerationResult) -> list[RoundRow]:
    """The per-round table of a finished stream: round 0 is the prefill, round i the i-th verify."""
    rows = [RoundRow(0, 1 if result.completion_tokens else 0)]
    rows += [RoundRow(i + 1, n) for i, n in enumerate(result.acceptance_lengths)]
    for row, stats in zip(rows[1:], result.round_stats):
        row.nodes, row.draft_ms, row.build_ms = stats.tree_nodes, stats.draft_ms, stats.build_ms
        row.network_ms, row.verify_ms = stats.network_ms, stats.verify_ms
    seen = 0
    for arrived, delta in deltas:
        # The text released at the end (no tokens) comes as round 0: it belongs to the last round seen.
        index = delta.round if delta.round > seen or delta.token_ids else seen
        if index >= len(rows):
            rows += [RoundRow(i, 0) for i in range(len(rows), index + 1)]
        row = rows[index]
        row.delivered += len(delta.token_ids)
        row.text += delta.text
        if row.arrived_s is None:
            row.arrived_s = arrived
        seen = max(seen, index)
    return rows


def print_round_table(rows: list[RoundRow], file) -> None:
    print(f"# {ROUND_TABLE_NOTE}", file=file)
    print(f"{'round':>5} {'emitted':>7} {'nodes':>5} {'draft':>7} {'build':>7} {'network':>7} {'verify':>7} "
          f"{'delivered':>9} {'total':>6} {'arrived_ms':>10}  text", file=file)
    total = 0

    def ms(value: float | None) -> str:
        return f"{value:7.2f}" if value is not None else f"{'-':>7}"

    for r in rows:
        total += r.delivered
        arrived = f"{r.arrived_s * 1000:.1f}" if r.arrived_s is not None else "-"
        text = repr(r.text) if len(r.text) <= 40 else repr(r.text[:37]) + "..."
        nodes = str(r.nodes) if r.nodes is not None else "-"
        print(f"{r.round:>5} {r.emitted:>7} {nodes:>5} {ms(r.draft_ms)} {ms(r.build_ms)} {ms(r.network_ms)} "
              f"{ms(r.verify_ms)} {r.delivered:>9} {total:>6} {arrived:>10}  {text}", file=file)


def main(argv=None) -> None:
    a = parse_args(argv)
    options = request_options(a)
    deltas: list[tuple[float, GenerationDelta]] = []
    result = None
    try:
        with GenerationClient(a.server, tls=a.tls, api_key=a.api_key) as client:
            started = time.perf_counter()
            for item in client.stream(timeout=a.timeout, **options):
                if isinstance(item, GenerationResult):
                    result = item
                    continue
                deltas.append((time.perf_counter() - started, item))
                if not a.json:
                    print(item.text, end="", flush=True)
    except GenerationError as exc:
        fail(f"{exc.code}: {exc.message}", code=1)
    if result is None:
        fail("the stream ended without a final message", code=1)
    rows = round_rows(deltas, result) if a.stats else []
    if a.json:
        out = {"tokens": list(result.token_ids), "text": result.text, "finish_reason": result.finish_reason,
               "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
               "rounds": result.rounds, "acceptance_lengths": list(result.acceptance_lengths),
               "mean_acceptance": result.mean_acceptance, "time_to_first_token_s": result.time_to_first_token_s,
               "tokens_per_s": result.tokens_per_s, "elapsed_s": result.elapsed_s}
        if a.stats:
            out["per_round"] = [vars(r) for r in rows]
        if result.logprobs is not None:
            out["logprobs"] = [{"token": t.token_id, "logprob": t.logprob, "top": [list(x) for x in t.top]}
                               for t in result.logprobs]
        print(json.dumps(out))
        return
    print()
    print(f"[{result.finish_reason}] {result.completion_tokens} tokens in {result.rounds} rounds, mean acceptance "
          f"{result.mean_acceptance:.2f}, {result.tokens_per_s:.1f} tokens/s, first token "
          f"{result.time_to_first_token_s * 1000:.0f} ms, {result.elapsed_s:.2f} s", file=sys.stderr)
    if a.stats:
        print_round_table(rows, sys.stderr)
    if result.logprobs is not None:
        print_logprobs(result.logprobs, sys.stderr)


def print_logprobs(logprobs, file) -> None:
    """One line per token: its id, its logprob and the most likely tokens there."""
    print(f"{'token':>8} {'logprob':>9}  top", file=file)
    for t in logprobs:
        top = " ".join(f"{i}:{v:.3f}" for i, v in t.top)
        print(f"{t.token_id:>8} {t.logprob:>9.4f}  {top}", file=file)


if __name__ == "__main__":
    main()
