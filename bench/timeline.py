"""Where a step's time goes across both services: host spans and device intervals on one clock.

    PYTHONPATH=. python bench/timeline.py DIR [--window 0.3,0.7] [--excerpt-ms 60] [--out-json F]

`bench/serve.py --timeline DIR` starts both roles (`bench/serve_roles.py --timeline DIR`) with
`install` applied (with `--colocate`, the drafter role, its verifier in process, records both):
a few methods of each service are wrapped to append, per process, lines `[name, start_ns, end_ns]`
to DIR/<pid>.jsonl, on CLOCK_MONOTONIC, which processes on one host share. Host spans ("v." the
verifier, "d." the drafter) time the calls themselves; device intervals ("g.") come from CUDA
events recorded before and after the call that queues the work (the verify step, a prefill,
the draft step) and converted to that clock, so a device interval starts when the stream
reaches the work (after what was queued before it) and ends when it is done. Two processes on
one GPU time-slice it: "both outstanding" is the time each had device work queued at once.

This script summarises the drafter that ran last and the verifier: per name, how often and
how long; the device's busy fraction (each service's and their union) over a window of the
run (by default its middle 40%, away from start-up and drain); the verifier's idle gaps between
stretches of its device work; its steps from one verify to the next, those with prompt work
(a prefill, prompt features into draft contexts) apart from the others, and for the others
where the time between two verifies goes; where a link message's own time goes, through gRPC
or the Unix socket (encodes, decodes, the way up and the way down, and the verifier's hold); and
an excerpt of the timeline.
Measurement only: the wrappers add a few microseconds per call.
"""
from __future__ import annotations

import os.path
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse
import functools
import glob
import json
import threading
import time
from collections import defaultdict

from bench.bench_timing import out_json

Interval = tuple[int, int]


class Recorder:
    """Appends spans to DIR/<pid>.jsonl; device intervals once their end event has completed."""

    def __init__(self, out_dir: str, role: str):
        os.makedirs(out_dir, exist_ok=True)
        self._file = open(os.path.join(out_dir, f"{os.getpid()}.jsonl"), "a", buffering=1)
        self._lock = threading.RLock()
        self._pending: list[tuple[str, object, object]] = []  # (name, start event, end event)
        self._origin = None  # (event, monotonic ns) recorded together after a sync
        self._write(["role", role, 0])

    def _write(self, row: list) -> None:
        with self._lock:
            self._file.write(json.dumps(row) + "\n")

    def span(self, name: str, start_ns: int, end_ns: int) -> None:
        """A host span timed by the caller (CLOCK_MONOTONIC nanoseconds)."""
        self._write([name, start_ns, end_ns])

    def host(self, name: str, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            start = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self._write([name, start, time.monotonic_ns()])
        return wrapped

    def device(self, name: str, host_name: str, fn):
        """Host span `host_name` of the call, device interval `name` of the work it queues."""
        import torch

        if not torch.cuda.is_available():
            return self.host(host_name, fn)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if self._origin is None:
                torch.cuda.synchronize()
                origin = torch.cuda.Event(enable_timing=True)
                origin.record()
                torch.cuda.synchronize()
                self._origin = (origin, time.monotonic_ns())
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            start = time.monotonic_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self._write([host_name, start, time.monotonic_ns()])
                with self._lock:
                    self._pending.append((name, begin, end))
                    self._flush_device()
        return wrapped

    def _flush_device(self) -> None:
        origin, origin_ns = self._origin
        waiting = []
        for name, begin, end in self._pending:
            if end.query():
                self._write([name, origin_ns + int(origin.elapsed_time(begin) * 1e6),
                             origin_ns + int(origin.elapsed_time(end) * 1e6)])
            else:
                waiting.append((name, begin, end))
        self._pending = waiting


def install(out_dir: str, role: str) -> None:
    """Wrap the service's methods (call before the service starts). Role "colocated": a drafter
    with its verifier in process (`--verifier local`), one file holding both services' rows."""
    rec = Recorder(out_dir, role)
    if role in ("verifier", "colocated"):
        _install_verifier(rec, served=role == "verifier")
    if role in ("drafter", "colocated"):
        _install_drafter(rec)


def _install_verifier(rec: Recorder, served: bool) -> None:
    import verifier_svc.cuda_graphs as cuda_graphs
    import verifier_svc.target_runner as runner
    import verifier_svc.tree_verifier as tree_verifier

    target = runner.TargetRunner
    target.launch_verify = rec.device("g.verify", "v.launch", target.launch_verify)
    target.prefill = rec.device("g.prefill", "v.prefill", target.prefill)
    target.finish_verify = rec.host("v.results", target.finish_verify)  # wait for the results, read them out
    tree_verifier.walk_trees = rec.host("v.walk", tree_verifier.walk_trees)  # the trees' checks
    tree_verifier.ancestor_masks = rec.host("v.masks", tree_verifier.ancestor_masks)
    # An in-process drafter's trees: their fields built on the device, queued.
    cuda_graphs.BatchInputs._place_device_trees = rec.host("v.place", cuda_graphs.BatchInputs._place_device_trees)
    verifier = tree_verifier.TreeVerifier
    verifier._finish_verify = rec.host("v.commit", verifier._finish_verify)  # the results, then per-session commit
    if not served:  # in process: the drafter's link calls the verifier's step directly
        import drafter_svc.link as link

        link.LocalLink.send = rec.host("v.step", link.LocalLink.send)
        link.LocalLink._finish = rec.host("v.finish", link.LocalLink._finish)  # wait, commit, prefills read
        return
    import verifier_svc.scheduler as scheduler
    import verifier_svc.server as server

    worker = scheduler.ModelWorker
    worker._begin = rec.host("v.begin", worker._begin)  # tree checks, inputs, the verify queued
    worker._finish = rec.host("v.finish", worker._finish)  # wait for results, commit, answer
    server.decode_message = rec.host("v.parse", server.decode_message)  # a link message's bytes parsed
    server.decode_link_request = rec.host("v.decode", server.decode_link_request)
    scheduler.encode_link_response = rec.host("v.encode", scheduler.encode_link_response)
    scheduler.encode_link_notice = rec.host("v.notice", scheduler.encode_link_notice)  # first tokens ahead


def _install_drafter(rec: Recorder) -> None:
    import drafter_svc.ddtree as ddtree
    import drafter_svc.drafter as drafter
    import drafter_svc.draft_graphs as draft_graphs
    import drafter_svc.link as link
    import drafter_svc.oracle as oracle
    import drafter_svc.scheduler as scheduler
    import drafter_svc.text_stream as text_stream

    sched = scheduler.DraftScheduler
    sched._apply = rec.host("d.apply", sched._apply)  # a reply's results to their sessions
    sched._flush_outbox = rec.host("d.flush", sched._flush_outbox)  # updates to the clients' handlers
    scheduler.build_trees = rec.host("d.build", scheduler.build_trees)  # top-k, selection, the trees
    ddtree.DDTreeSelection.trees = rec.host("d.trees", ddtree.DDTreeSelection.trees)  # selected nodes -> DraftTrees
    draft_graphs.DraftInputs.fill = rec.host("d.fill", draft_graphs.DraftInputs.fill)  # the draft step's inputs
    oracle.ControlledAcceptance.__call__ = rec.host("d.oracle", oracle.ControlledAcceptance.__call__)
    # On the server's event loop, not the scheduler's thread: a round's tokens detokenized for its client.
    text_stream.TextStream.push = rec.host("l.text", text_stream.TextStream.push)
    sched._send_message = rec.host("d.send", sched._send_message)  # draft, trees, the message sent
    sched._receive = rec.host("d.receive", sched._receive)  # wait for the reply, apply it
    sched._notice = rec.host("d.notice", sched._notice)  # first tokens to the clients ahead of their reply
    drafter.DFlashProposer.propose = rec.device("g.draft", "d.propose", drafter.DFlashProposer.propose)
    # In process: the next draft step queued behind a verify, from its results on the device.
    drafter.DFlashProposer.propose_verified = rec.device("g.draft", "d.behind", drafter.DFlashProposer.propose_verified)
    drafter.select_ddtrees = rec.host("d.select", drafter.select_ddtrees)  # top-k, its copy, the selection
    ddtree.top_candidates = rec.host("d.topk", ddtree.top_candidates)  # its top-k and copy (waits for the GPU)
    # On a GPU: the selection on the device, and the copy of the trees (waits for the draft and top-k).
    ddtree._select_on_device = rec.host("d.select_dev", ddtree._select_on_device)
    # In process: the selection queued, its trees left on the device (nothing waits).
    drafter.select_device_trees = rec.host("d.select_queued", drafter.select_device_trees)
    link.GrpcLink.receive = rec.host("d.wait", link.GrpcLink.receive)  # blocked on the reply, then decode
    # Over gRPC, a message's own parts: encoded; the reply's bytes awaited, parsed and decoded.
    link.encode_link_request = rec.host("d.encode", link.encode_link_request)
    link.GrpcLink._next_reply = rec.host("d.next", link.GrpcLink._next_reply)
    link.parse_link_response = rec.host("d.parse", link.parse_link_response)
    link.decode_link_response = rec.host("d.decode", link.decode_link_response)
    # A reply's prompt chunks into their draft contexts.
    drafter.DFlashProposer.take_prompts = rec.host("d.prompts", drafter.DFlashProposer.take_prompts)


# -- report -------------------------------------------------------------------------------


VERIFIER_ROWS = ("v.", "g.verify", "g.prefill")  # a colocated file's rows of its verifier
PROMPT_WORK = ("g.prefill", "v.prefill", "d.prompts")  # a step with these has prompts to take in


def _load(directory: str) -> dict[str, tuple[str, list]]:
    """path -> (role, rows); a colocated file gives a drafter (path) and a verifier (path + "#verifier")."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if len(rows) > 1 and rows[0][0] == "role":
            role, rows = rows[0][1], rows[1:]
            if role == "colocated":
                runs[path + "#verifier"] = ("verifier", [r for r in rows if r[0].startswith(VERIFIER_ROWS)])
                runs[path] = ("drafter", [r for r in rows if not r[0].startswith(VERIFIER_ROWS)])
            else:
                runs[path] = (role, rows)
    return runs


def _union(spans: list[Interval], lo: int, hi: int) -> list[Interval]:
    out: list[list[int]] = []
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(x: list[Interval], y: list[Interval]) -> list[Interval]:
    i = j = 0
    out = []
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _total(spans: list[Interval]) -> int:
    return sum(b - a for a, b in spans)


def report(directory: str, window: tuple[float, float] = (0.3, 0.7), excerpt_ms: float = 60.0) -> dict:
    runs = _load(directory)
    drafters = [(max(e[2] for e in rows), path) for path, (role, rows) in runs.items() if role == "drafter"]
    if not drafters:
        raise SystemExit(f"error: {directory} holds no drafter and verifier timeline")
    drafter = max(drafters)[1]
    # The verifier service's, or the one in the drafter's own process (colocated).
    verifiers = ([drafter + "#verifier"] if drafter + "#verifier" in runs
                 else [path for path, (role, _) in runs.items() if role == "verifier" and "#" not in path])
    if not verifiers:
        raise SystemExit(f"error: {directory} holds no drafter and verifier timeline")
    sends = sorted(e[1] for e in runs[drafter][1] if e[0] == "d.send")
    if len(sends) < 2:
        raise SystemExit(f"error: the drafter in {drafter} sent fewer than two messages")
    lo = int(sends[0] + (sends[-1] - sends[0]) * window[0])
    hi = int(sends[0] + (sends[-1] - sends[0]) * window[1])
    span_ms = (hi - lo) / 1e6
    out = {"window_ms": span_ms, "services": {}, "device": {}}
    busy = {}
    for path in [*verifiers, drafter]:
        role, rows = runs[path]
        busy[role] = _union([(a, b) for name, a, b in rows if name.startswith("g.")], lo, hi)
        per_name = defaultdict(list)
        for name, a, b in rows:
            if lo <= a and b <= hi:
                per_name[name].append((b - a) / 1e6)
        out["services"][role] = {
            name: {"count": len(v), "per_s": len(v) / span_ms * 1e3, "mean_ms": sum(v) / len(v),
                   "p50_ms": sorted(v)[len(v) // 2], "max_ms": max(v), "share": sum(v) / span_ms}
            for name, v in sorted(per_name.items())}
    both = _intersection(busy.get("verifier", []), busy.get("drafter", []))
    out["device"] = {"verifier": _total(busy.get("verifier", [])) / 1e6 / span_ms,
                     "drafter": _total(busy.get("drafter", [])) / 1e6 / span_ms,
                     "union": _total(_union(busy.get("verifier", []) + busy.get("drafter", []), lo, hi))
                     / 1e6 / span_ms,
                     "both_outstanding": _total(both) / 1e6 / span_ms}
    # The verifier's idle gaps: from the end of one stretch of its device work to the next.
    verifier = busy.get("verifier", [])
    gaps = sorted((b[0] - a[1]) / 1e6 for a, b in zip(verifier, verifier[1:]))
    out["verifier_gaps_ms"] = ({"count": len(gaps), "mean": sum(gaps) / len(gaps), "p50": gaps[len(gaps) // 2],
                                "p90": gaps[int(len(gaps) * 0.9)], "max": gaps[-1]} if gaps else {"count": 0})
    out["steps"] = _steps(runs, verifiers, drafter, lo, hi)
    out["link"] = _link_messages(runs[verifiers[0]][1], runs[drafter][1], lo, hi)
    start = (lo + hi) // 2
    excerpt = []
    for path in [*verifiers, drafter]:
        role, rows = runs[path]
        excerpt += [((a - start) / 1e6, (b - start) / 1e6, role, name) for name, a, b in rows
                    if start <= a <= start + excerpt_ms * 1e6]
    out["excerpt"] = sorted(excerpt)
    return out


def _steps(runs: dict, verifiers: list[str], drafter: str, lo: int, hi: int) -> dict:
    """Verify to verify, split by whether prompt work (a prefill, prompt features into draft
    contexts) falls between: how many steps, their mean period, and for those without, where
    the time between two verifies goes (the wait for the draft, the draft, the rest: its top-k,
    the trees and the next verify's launch)."""
    rows = [row for path in [*verifiers, drafter] for row in runs[path][1]]
    verifies = sorted((a, b) for name, a, b in rows if name == "g.verify" and lo <= a and b <= hi)
    prompt_work = [(a, b) for name, a, b in rows if name in PROMPT_WORK]
    drafts = sorted((a, b) for name, a, b in rows if name == "g.draft")
    parts = {"with prompts": defaultdict(list), "without": defaultdict(list)}
    for (a, b), (c, _) in zip(verifies, verifies[1:]):
        kind = "with prompts" if any(x < c and y > a for x, y in prompt_work) else "without"
        step = parts[kind]
        step["period"].append((c - a) / 1e6)
        step["verify"].append((b - a) / 1e6)
        draft = next(((x, y) for x, y in drafts if b <= x < c), None)
        if kind == "without" and draft is not None:
            step["verify end -> draft"].append((draft[0] - b) / 1e6)
            step["draft"].append((draft[1] - draft[0]) / 1e6)
            step["draft end -> next verify"].append((c - draft[1]) / 1e6)
    return {kind: {"count": len(v.get("period", ())), **{name: sum(x) / len(x) for name, x in v.items() if x}}
            for kind, v in parts.items()}


LINK_PARTS = ("encode", "up", "verifier decode", "held", "verifier encode", "down", "down, reply awaited",
              "drafter decode")


def _link_messages(verifier: list, drafter: list, lo: int, hi: int) -> dict:
    """Over gRPC, where each link message's time went, p50 ms over the messages sent in the window:
    the drafter's encoding; up (from its end to the verifier's parse: serialisation, the request
    thread, gRPC, the servicer's read); the verifier's parse and decode; held (to its reply's
    encoding: the queue and the step); the reply's encoding; down (from its end to the drafter
    holding the bytes: the hand-off to the event loop, the write, gRPC, and the drafter's read,
    late when it was drafting), and down for the messages whose reply it was already awaiting;
    the drafter's parse and decode. Messages pair with the verifier's decodes and encodes in
    order (one link), and with the drafter's reads past any notice ahead of a reply."""
    rows = lambda who, name: sorted((a, b) for n, a, b in who if n == name)  # noqa: E731
    encodes = rows(drafter, "d.encode")
    if not encodes:
        return {"count": 0}  # in process: no wire
    since = lambda spans: [s for s in spans if s[0] >= encodes[0][0]]  # noqa: E731 (this drafter's link)
    parses, decodes, replies = since(rows(verifier, "v.parse")), since(rows(verifier, "v.decode")), since(
        rows(verifier, "v.encode"))
    notices = [a for a, _ in since(rows(verifier, "v.notice"))]
    reads, drafter_parses = rows(drafter, "d.next"), rows(drafter, "d.parse")
    drafter_decodes = rows(drafter, "d.decode")
    parts: dict[str, list[float]] = {name: [] for name in LINK_PARTS}
    late = 0
    read = iter(reads)
    previous_reply = encodes[0][0]
    for sent, decoded, reply in zip(encodes, decodes, replies):
        if any(previous_reply <= t < reply[0] for t in notices):
            next(read, None)  # the notice's read, ahead of the reply's
        previous_reply = reply[1]
        got = next(read, None)
        if got is None:
            break
        if not lo <= sent[0] <= hi:
            continue
        parse = max((p for p in parses if sent[1] <= p[0] <= decoded[0]), default=decoded)
        after = [d for d in drafter_parses if d[0] >= got[1]][:1] + [d for d in drafter_decodes if d[0] >= got[1]][:1]
        ms = lambda a, b: (b - a) / 1e6  # noqa: E731
        parts["encode"].append(ms(*sent))
        parts["up"].append(ms(sent[1], parse[0]))
        parts["verifier decode"].append(ms(parse[0], decoded[1]))
        parts["held"].append(ms(decoded[1], reply[0]))
        parts["verifier encode"].append(ms(*reply))
        parts["down"].append(ms(reply[1], got[1]))
        if got[0] <= reply[1]:
            parts["down, reply awaited"].append(ms(reply[1], got[1]))
        else:
            late += 1
        if len(after) == 2:
            parts["drafter decode"].append(ms(after[0][0], after[1][1]))
    count = len(parts["encode"])
    return {"count": count, "read_late_share": late / count if count else None,
            **{name: sorted(v)[len(v) // 2] if v else None for name, v in parts.items()}}


def print_report(res: dict) -> None:
    print(f"window: {res['window_ms']:.0f} ms of the last drafter's run")
    for role, names in res["services"].items():
        print(f"\n{role}: name, per second, mean / p50 / max ms, share of the window")
        for name, s in names.items():
            print(f"  {name:11s} {s['per_s']:7.1f}/s {s['mean_ms']:8.3f} {s['p50_ms']:8.3f} {s['max_ms']:8.3f}"
                  f" {s['share']:7.1%}")
    d = res["device"]
    print(f"\ndevice work queued: verifier {d['verifier']:.1%}, drafter {d['drafter']:.1%}, either {d['union']:.1%},"
          f" both {d['both_outstanding']:.1%} of the window")
    g = res["verifier_gaps_ms"]
    if g["count"]:
        print(f"the verifier's idle gaps between device work: {g['count']}, mean {g['mean']:.2f} ms, "
              f"p50 {g['p50']:.2f}, p90 {g['p90']:.2f}, max {g['max']:.2f}")
    print("\nverify to verify, ms (means):")
    for kind, step in res.get("steps", {}).items():
        print(f"  {kind:13s} {step['count']:5d} steps" + "".join(f", {name} {value:.3f}" for name, value in step.items()
                                                            if name != "count"))
    link = res.get("link", {})
    if link.get("count"):
        print(f"\na link message (gRPC or the Unix socket), p50 ms ({link['count']} messages; the drafter read "
              f"{link['read_late_share']:.0%} of the replies after they were encoded):")
        print("  " + ", ".join(f"{name} {link[name]:.3f}" for name in LINK_PARTS if link.get(name) is not None))
    print("\nexcerpt (ms from the window's middle; the drafter's rows indented)")
    for a, b, role, name in res["excerpt"]:
        print(f"{'' if role == 'verifier' else ' ' * 36}{a:8.2f} {b:8.2f} {b - a:6.2f} {name}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    p.add_argument("directory", help="what bench/serve.py --timeline wrote")
    p.add_argument("--window", default="0.3,0.7",
                   help="the part of the drafter's run to summarise, as fractions from its first to its last "
                        "message (default 0.3,0.7)")
    p.add_argument("--excerpt-ms", type=float, default=60.0, help="length of the printed excerpt (default 60)")
    p.add_argument("--out-json", type=out_json, help="write the summary here")
    a = p.parse_args(argv)
    try:
        lo, hi = (float(x) for x in a.window.split(","))
    except ValueError:
        p.error(f"--window takes two fractions, got {a.window!r}")
    if not 0.0 <= lo < hi <= 1.0:
        p.error(f"--window needs 0 <= start < end <= 1, got {a.window}")
    res = report(a.directory, (lo, hi), a.excerpt_ms)
    print_report(res)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
