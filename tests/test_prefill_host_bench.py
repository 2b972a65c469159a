"""bench/prefill_host.py runs on the CPU and reports each past's host and device times."""
import json

from bench.prefill_host import main


def test_small_run_reports_every_past_and_two_calls_in_a_row(tmp_path):
    out = tmp_path / "ph.json"
    res = main(["--small", "--device", "cpu", "--chunk", "8", "--pasts", "0,16", "--reps", "1",
                "--out-json", str(out)])
    assert [r["past"] for r in res["rows"]] == [0, 16] and res["chunk"] == 8
    for row in res["rows"]:
        # on the CPU a call returns with its work done; two in a row return one after the other
        assert 0 < row["host_ms"] <= row["device_ms"]
        assert 0 < row["two_first_returned_ms"] <= row["two_second_returned_ms"] <= row["two_device_ms"]
        assert row["syncs"] == []  # only CUDA's sync debug mode lists them
        assert row["host_mask_ms"] > 0
    assert json.loads(out.read_text())["rows"] == res["rows"]
