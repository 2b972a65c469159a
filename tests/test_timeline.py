"""bench/timeline.py: the recorder's lines and the report's arithmetic on a synthetic timeline."""
import json

import pytest

from bench.timeline import Recorder, report

MS = 1_000_000


def write(path, role, rows):
    with open(path, "w") as f:
        f.write(json.dumps(["role", role, 0]) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_report_device_fractions_and_window(tmp_path):
    # Drafter messages every 10 ms from 0 to 100 ms: the default window is 30..70 ms.
    sends = [["d.send", t * MS, t * MS + 2 * MS] for t in range(0, 101, 10)]
    drafts = [["g.draft", t * MS + 1 * MS, t * MS + 3 * MS] for t in range(0, 101, 10)]  # 2 of every 10 ms
    verifies = [["g.verify", t * MS + 2 * MS, t * MS + 8 * MS] for t in range(0, 101, 10)]  # 6 of every 10 ms
    write(tmp_path / "1.jsonl", "verifier", verifies)
    write(tmp_path / "2.jsonl", "drafter", sends + drafts)
    res = report(str(tmp_path))
    assert res["window_ms"] == pytest.approx(40.0)
    device = res["device"]
    assert device["verifier"] == pytest.approx(0.6)
    assert device["drafter"] == pytest.approx(0.2)
    assert device["both_outstanding"] == pytest.approx(0.1)  # 2..3 ms of every 10
    assert device["union"] == pytest.approx(0.7)  # 1..8 ms of every 10
    gaps = res["verifier_gaps_ms"]  # the verifier idles 8..12 ms of every 10-ms period
    assert gaps["count"] == 3 and gaps["max"] == pytest.approx(4.0) and gaps["p50"] == pytest.approx(4.0)
    sends_seen = res["services"]["drafter"]["d.send"]
    assert sends_seen["count"] == 4 and sends_seen["mean_ms"] == pytest.approx(2.0)  # 30, 40, 50, 60 (70 ends past)
    assert [name for *_, name in res["excerpt"]][:2] == ["d.send", "g.draft"]


def test_report_takes_the_drafter_that_ran_last(tmp_path):
    write(tmp_path / "1.jsonl", "verifier", [["g.verify", 0, 100 * MS]])
    write(tmp_path / "2.jsonl", "drafter", [["d.send", 0, MS], ["d.send", 10 * MS, 11 * MS]])
    write(tmp_path / "3.jsonl", "drafter", [["d.send", 50 * MS, 51 * MS], ["d.send", 90 * MS, 91 * MS]])
    res = report(str(tmp_path), (0.0, 1.0))
    assert res["window_ms"] == pytest.approx(40.0)
    assert res["device"]["verifier"] == pytest.approx(1.0)


def test_report_refuses_a_directory_without_both_services(tmp_path):
    write(tmp_path / "1.jsonl", "verifier", [["g.verify", 0, MS]])
    with pytest.raises(SystemExit):
        report(str(tmp_path))


def test_recorder_writes_host_spans(tmp_path):
    rec = Recorder(str(tmp_path), "drafter")
    wrapped = rec.host("d.x", lambda x: x + 1)
    assert wrapped(1) == 2
    rows = [json.loads(line) for f in tmp_path.iterdir() for line in f.read_text().splitlines()]
    assert rows[0] == ["role", "drafter", 0]
    assert rows[1][0] == "d.x" and rows[1][1] <= rows[1][2]


def test_report_splits_a_colocated_file_and_takes_its_own_verifier(tmp_path):
    # A verifier service's file from an earlier run is not the colocated drafter's verifier.
    write(tmp_path / "1.jsonl", "verifier", [["g.verify", 0, 100 * MS]])
    sends = [["d.send", t * MS, t * MS + 1 * MS] for t in range(0, 101, 10)]
    steps = [["v.step", t * MS + 1 * MS, t * MS + 9 * MS] for t in range(0, 101, 10)]
    verifies = [["g.verify", t * MS + 2 * MS, t * MS + 7 * MS] for t in range(0, 101, 10)]  # 5 of every 10 ms
    write(tmp_path / "2.jsonl", "colocated", sends + steps + verifies)
    res = report(str(tmp_path), (0.0, 1.0))
    assert res["device"]["verifier"] == pytest.approx(0.5, abs=0.01)
    assert set(res["services"]["verifier"]) == {"v.step", "g.verify"}
    assert set(res["services"]["drafter"]) == {"d.send"}
    assert res["verifier_gaps_ms"]["p50"] == pytest.approx(5.0)


def test_report_splits_steps_by_prompt_work(tmp_path):
    # A verify every 10 ms (6 ms), the draft right behind it (2 ms); a prefill in the 5th and 7th
    # steps makes those 14 ms long. The last verify ends past the last message: out of the window.
    rows, t = [], 0
    for i in range(10):
        period = 14 if i in (4, 6) else 10
        rows += [["d.send", t * MS, t * MS + MS], ["g.verify", t * MS, (t + 6) * MS],
                 ["g.draft", (t + 6) * MS, (t + 8) * MS]]
        if period == 14:
            rows.append(["g.prefill", (t + 8) * MS, (t + 12) * MS])
        t += period
    write(tmp_path / "1.jsonl", "colocated", rows)
    steps = report(str(tmp_path), (0.0, 1.0))["steps"]
    assert steps["with prompts"]["count"] == 2 and steps["with prompts"]["period"] == pytest.approx(14.0)
    without = steps["without"]
    assert without["count"] == 6 and without["period"] == pytest.approx(10.0)
    assert without["verify"] == pytest.approx(6.0) and without["verify end -> draft"] == pytest.approx(0.0)
    assert without["draft"] == pytest.approx(2.0) and without["draft end -> next verify"] == pytest.approx(2.0)


def test_report_splits_each_link_message_over_grpc(tmp_path):
    """Per message over gRPC: the drafter's encode, up to the verifier's parse, its decode, the
    hold, the reply's encode, down to the drafter's read (late when it was drafting), and the
    drafter's decode; a notice's read ahead of a reply is skipped."""
    verifier, drafter = [], []
    for k in range(10):  # a message every 10 ms
        t = k * 10 * MS
        drafter += [["d.send", t, t + MS], ["d.encode", t, t + MS // 2]]
        verifier += [["v.parse", t + MS, t + MS + MS // 10], ["v.decode", t + MS + MS // 10, t + 2 * MS],
                     ["v.encode", t + 6 * MS, t + 7 * MS]]
        if k == 4:  # a notice ahead of this reply, read first
            verifier.append(["v.notice", t + 5 * MS, t + 5 * MS + MS // 10])
            drafter.append(["d.next", t + 5 * MS, t + 5 * MS + MS // 2])
        read_from = t + 8 * MS if k % 2 else t + 3 * MS  # odd messages: read after the reply was encoded
        drafter += [["d.next", read_from, t + 9 * MS], ["d.parse", t + 9 * MS, t + 9 * MS + MS // 10],
                    ["d.decode", t + 9 * MS + MS // 10, t + 9 * MS + MS // 2]]
    write(tmp_path / "1.jsonl", "verifier", verifier)
    write(tmp_path / "2.jsonl", "drafter", drafter)
    link = report(str(tmp_path), (0.0, 1.0))["link"]
    assert link["count"] == 10 and link["read_late_share"] == pytest.approx(0.5)
    assert link["encode"] == pytest.approx(0.5) and link["up"] == pytest.approx(0.5)
    assert link["verifier decode"] == pytest.approx(1.0) and link["held"] == pytest.approx(4.0)
    assert link["verifier encode"] == pytest.approx(1.0) and link["down"] == pytest.approx(2.0)
    assert link["down, reply awaited"] == pytest.approx(2.0) and link["drafter decode"] == pytest.approx(0.5)


def test_report_has_no_link_split_in_process(tmp_path):
    write(tmp_path / "1.jsonl", "verifier", [["g.verify", 0, 100 * MS]])
    write(tmp_path / "2.jsonl", "drafter", [["d.send", 0, MS], ["d.send", 10 * MS, 11 * MS]])
    assert report(str(tmp_path), (0.0, 1.0))["link"] == {"count": 0}
