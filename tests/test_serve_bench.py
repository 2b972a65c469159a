"""bench/serve.py's own logic: the step breakdown from scraped histograms, the latencies, and --colocate's checks."""
from __future__ import annotations

import pytest

from bench.serve import (BUDGET, COMPILE_SECONDS, COMPILES, LINK_BYTES, ROUNDS, STEP_PARTS, TREES, Request,
                         parse_args, print_table, step_breakdown, summarise)


def sample(name: str, total_s: float, count: float) -> dict[str, float]:
    return {name + "_sum": total_s, name + "_count": count}


def test_step_breakdown_leaves_out_what_nothing_observed():
    """Per link message, in ms; a part nothing observed in the run (no verifier service, no draft
    in plain decoding) is None, and `other` is what the drafter's own parts leave of the step."""
    before = {**sample(STEP_PARTS["rpc"], 1.0, 10), **sample(STEP_PARTS["vstep"], 0.5, 10),
              **sample(STEP_PARTS["draft"], 0.0, 0)}
    after = {**sample(STEP_PARTS["rpc"], 1.5, 110), **sample(STEP_PARTS["vstep"], 0.5, 10),
             **sample(STEP_PARTS["draft"], 0.2, 100), **sample(STEP_PARTS["build"], 0.1, 100)}
    parts = step_breakdown(before, after, wall=1.0)
    assert parts["messages"] == 100 and parts["step_ms"] == pytest.approx(10.0)
    assert parts["rpc_ms"] == pytest.approx(5.0) and parts["draft_ms"] == pytest.approx(2.0)
    assert parts["build_ms"] == pytest.approx(1.0)
    assert parts["vstep_ms"] is None and parts["vfwd_ms"] is None  # unchanged / absent
    assert parts["other_ms"] == pytest.approx(2.0)
    plain = step_breakdown(before, {**after, **sample(STEP_PARTS["draft"], 0.0, 0),
                                    **sample(STEP_PARTS["build"], 0.0, 0)}, wall=1.0)
    assert plain["draft_ms"] is None and plain["other_ms"] == pytest.approx(5.0)
    assert step_breakdown(before, before, wall=1.0)["step_ms"] is None  # no message: nothing to split
    assert (parts["compiles"], parts["compile_ms"]) == (0, 0)  # services that count none (or older ones)
    assert parts["budget"] is None  # no adaptive budget


def test_step_breakdown_gives_the_adaptive_budgets_mean_choice():
    """The mean of the budgets the planner chose for the run's messages."""
    before = {**sample(STEP_PARTS["rpc"], 1.0, 10), **sample(BUDGET, 150.0, 10)}
    after = {**sample(STEP_PARTS["rpc"], 2.0, 50), **sample(BUDGET, 150.0 + 20 * 15 + 20 * 7, 50)}
    assert step_breakdown(before, after, wall=1.0)["budget"] == pytest.approx(11.0)


def test_step_breakdown_counts_the_kernel_compiles_of_the_run():
    """The kernel compiles while serving during the run, and their time, from the services' counters."""
    before = {**sample(STEP_PARTS["rpc"], 1.0, 10), COMPILES: 2.0, COMPILE_SECONDS: 0.5}
    after = {**sample(STEP_PARTS["rpc"], 2.0, 20), COMPILES: 4.0, COMPILE_SECONDS: 1.0}
    parts = step_breakdown(before, after, wall=1.0)
    assert parts["compiles"] == 2 and parts["compile_ms"] == pytest.approx(500.0)


def test_step_breakdown_splits_the_round_trip_into_step_link_and_queue():
    """Over a wire: link = the link's own time per message (gRPC and codecs), its share of the
    step, queue = rpc - vstep - link; the sessions' rounds a second, the messages with trees and
    their mean sessions. In process (no link histogram) link, its share and queue are None."""
    before = {**sample(STEP_PARTS["rpc"], 0.0, 0), **sample(STEP_PARTS["vstep"], 0.0, 0),
              **sample(STEP_PARTS["link"], 0.0, 0), ROUNDS: 50.0, **sample(TREES, 40.0, 5), LINK_BYTES: 1e6}
    after = {**sample(STEP_PARTS["rpc"], 1.0, 100), **sample(STEP_PARTS["vstep"], 0.6, 100),
             **sample(STEP_PARTS["link"], 0.1, 100), ROUNDS: 850.0, **sample(TREES, 790.0, 80), LINK_BYTES: 2.5e6}
    parts = step_breakdown(before, after, wall=2.0)
    assert parts["link_ms"] == pytest.approx(1.0) and parts["queue_ms"] == pytest.approx(3.0)
    assert parts["link_share"] == pytest.approx(0.05) and parts["rounds_per_s"] == pytest.approx(400.0)
    assert parts["tree_messages"] == 75 and parts["trees_per_message"] == pytest.approx(10.0)
    assert parts["down_kb"] == pytest.approx(15.0)  # 1.5 MB over 100 replies
    local = step_breakdown(before, {**after, **sample(STEP_PARTS["link"], 0.0, 0), LINK_BYTES: 1e6}, wall=2.0)
    assert local["link_ms"] is None and local["queue_ms"] is None and local["link_share"] is None
    assert local["down_kb"] is None


def test_colocate_takes_no_link_options(capsys):
    a = parse_args(["--models", "qwen3-8b", "--small", "--colocate", "--quick"])
    assert a.colocate
    for extra in (["--delay-ms", "5"], ["--lockstep"], ["--verifier-tp", "2"], ["--ring-ab"], ["--no-feature-ring"]):
        with pytest.raises(SystemExit):
            parse_args(["--models", "qwen3-8b", "--small", "--colocate", "--quick", *extra])
        assert "--colocate" in capsys.readouterr().err


def test_ring_ab_runs_each_setting_again_with_its_rows_inline():
    """--ring-ab: each controlled-acceptance setting (and each budget of it) has an -inline twin, whose
    drafter takes its rows inline (--no-feature-ring), beside the lockstep twins of --lockstep."""
    from bench.serve import oracle_settings

    a = parse_args(["--models", "qwen3-8b", "--small", "--quick", "--taus", "3,6", "--ring-ab", "--lockstep",
                    "--budgets", "8,adaptive"])
    settings = oracle_settings(a, block_size=8)
    assert [s.name for s in settings[:4]] == ["tau~3 b8", "tau~3 adaptive", "tau~3-inline b8", "tau~3-inline adaptive"]
    assert len(settings) == 16 and sum(s.inline for s in settings) == 8 and sum(s.lockstep for s in settings) == 8
    assert all(s.adaptive == s.name.endswith("adaptive") for s in settings)
    assert [(s.lockstep, s.inline) for s in settings[::2]] == [(False, False), (False, True), (True, False),
                                                             (True, True)] * 2


def test_repeated_runs_are_summarised_by_their_median():
    """--repeats: each (setting, mode, N) keeps every run; the summary gives the median, the
    extremes and the spread, and speed-ups are over plain decoding's median at the same N."""
    from bench.serve import add_speedups, repeat_summary

    def row(mode, n, tok_s, repeat):
        return {"setting": "ar" if mode == "ar" else "tau~6", "mode": mode, "concurrency": n,
                "tokens_per_s": tok_s, "repeat": repeat}

    rows = [row("ar", 1, 100.0, 0), row("ar", 1, 300.0, 1), row("ar", 1, 200.0, 2),
            row("tree", 1, 500.0, 0), row("tree", 1, 400.0, 1), row("tree", 1, 600.0, 2),
            row("ar", 8, 800.0, 0), row("tree", 8, 1200.0, 0)]
    add_speedups(rows)
    assert [r["speedup_vs_ar"] for r in rows[:6]] == pytest.approx([0.5, 1.5, 1.0, 2.5, 2.0, 3.0])
    assert rows[7]["speedup_vs_ar"] == pytest.approx(1.5)
    summary = {(r["mode"], r["concurrency"]): r for r in repeat_summary(rows)}
    tree = summary[("tree", 1)]
    assert (tree["runs"], tree["tokens_per_s_median"], tree["tokens_per_s_min"], tree["tokens_per_s_max"]) == \
        (3, 500.0, 400.0, 600.0)
    assert tree["spread"] == pytest.approx(0.4) and tree["speedup_vs_ar"] == pytest.approx(2.5)
    assert summary[("ar", 8)]["runs"] == 1 and summary[("ar", 8)]["spread"] == 0.0


def test_repeats_must_be_positive(capsys):
    assert parse_args(["--small", "--quick", "--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        parse_args(["--small", "--quick", "--repeats", "0"])
    assert "--repeats" in capsys.readouterr().err


def test_a_requests_whole_latency_is_summarised_beside_its_first_token(capsys):
    # Request 1's first token comes soonest but its stream ends last: the TTFT and the latency disagree.
    timed = [Request([1], tokens=[5] * 4, ttft_s=0.010, itl_s=[0.050] * 3, elapsed_s=0.160),
             Request([2], tokens=[5] * 4, ttft_s=0.030, itl_s=[0.010] * 3, elapsed_s=0.060),
             Request([3], tokens=[5] * 4, ttft_s=0.020, itl_s=[0.020] * 3, elapsed_s=0.080),
             Request([4], error="UNAVAILABLE: gone", elapsed_s=9.0)]  # a failed request counts in neither
    row = summarise("tree", None, 3, timed, wall=0.2, reference=None)
    assert row["ttft_p50_ms"] == pytest.approx(20.0) and row["latency_p50_ms"] == pytest.approx(80.0)
    assert row["latency_p99_ms"] == pytest.approx(80.0 + (160.0 - 80.0) * 0.98)
    print_table({"setup": "s", "device": "cpu", "torch": "t", "runs": [row], "breakdowns": [],
                 "options": {"dtype": "float32", "prompt_len": 1, "max_new_tokens": 4, "tree_budget": 15,
                             "requests_per_client": 1}})
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    header = next(words for words in lines if words[:1] == ["setting"])
    cells = next(words for words in lines if words[1:2] == ["tree"])
    assert {"lat50", "lat99"} <= set(header) and {"80.0", "158.4"} <= set(cells)


def test_the_random_models_placeholder_tokenizer_serves_the_http_api():
    """The benchmark's drafter serves the HTTP API over a tokenizer with no vocabulary: a logprob's
    bytes are its token's placeholder text, and a text prompt is refused (a ValueError, so
    INVALID_ARGUMENT), not an AttributeError."""
    from types import SimpleNamespace

    from bench.serve_roles import PlaceholderTokenizer
    from drafter_svc.server import DrafterEngine, longest_token_bytes
    from drafter_svc.text_stream import TokenBytes

    tokenizer = PlaceholderTokenizer()
    assert TokenBytes(tokenizer)(5) == b"<5>"
    stand_in = SimpleNamespace(cfg=SimpleNamespace(max_prompt_bytes=100), tokenizer=tokenizer,
                               longest_token_bytes=longest_token_bytes(tokenizer))
    assert stand_in.longest_token_bytes == 0  # no vocabulary: no bound
    with pytest.raises(ValueError, match="token_ids"):
        DrafterEngine.tokenize(stand_in, "hello")


def test_the_steady_window_runs_from_the_last_clients_first_token_to_the_first_clients_end():
    """Three clients whose requests stream at set times: the window opens when the slowest client's
    first timed token comes and closes when the first client has ended, and counts only the tokens
    streamed in between (`SteadyWindow`; no /metrics here)."""
    import asyncio

    from bench.serve import SteadyWindow, client
    from common.rpc import pb

    class Stub:  # each request streams `per_request` deltas of one token, `gap_s` apart, after `delay_s`
        def __init__(self, delay_s: float, gap_s: float, per_request: int):
            self.delay_s, self.gap_s, self.per_request = delay_s, gap_s, per_request

        async def Generate(self, request, timeout=None):
            await asyncio.sleep(self.delay_s)
            for i in range(self.per_request):
                yield pb.GenerateResponse(delta=pb.TokenDelta(token_ids=[i]))
                await asyncio.sleep(self.gap_s)
            yield pb.GenerateResponse(final=pb.GenerateFinal(finish_reason="length"))

    async def run():
        window = SteadyWindow(3, [])
        stubs = [Stub(0.0, 0.01, 10), Stub(0.05, 0.01, 10), Stub(0.1, 0.01, 20)]
        out = await asyncio.gather(*(client(stub, [[1], [2]], 0, 8, 10.0, window) for stub in stubs))
        await window.done()
        return window, [r for per_client in out for r in per_client]

    window, timed = asyncio.run(run())
    (t0, _), (t1, _) = window.begin, window.end
    first_tokens = [r.deltas[0][0] for r in timed[::2]]  # each client's first timed token
    ends = [timed[i + 1].deltas[-1][0] for i in range(0, len(timed), 2)]  # each client's last token
    assert t0 >= max(first_tokens) and t1 >= min(ends)
    assert t0 - max(first_tokens) < 0.05 and t1 - min(ends) < 0.05  # marked at once (no scrape to wait for)
    steady = window.summary(timed)
    inside = sum(1 for r in timed for t, _ in r.deltas if t0 <= t <= t1)
    assert 0 < inside < sum(len(r.deltas) for r in timed)
    assert steady["completion_tokens"] == inside
    assert steady["window_s"] == pytest.approx(t1 - t0)
    assert steady["tokens_per_s"] == pytest.approx(inside / (t1 - t0))
    assert "rounds_per_s" not in steady  # no /metrics scraped


def test_no_steady_window_when_the_first_client_ends_before_the_last_begins():
    import asyncio

    from bench.serve import SteadyWindow

    async def run():
        window = SteadyWindow(2, [])
        window.first_token()
        window.client_done()  # a client ended while another had not started: no window
        window.first_token()
        await window.done()
        return window

    window = asyncio.run(run())
    assert window.begin is None and window.end is None and window.summary([]) is None
