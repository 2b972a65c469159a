"""bench/transport.py runs end to end: the real verifier service over a canned forward, the echo beside it."""
from bench.transport import FEATURE_DIM, STAGES, main


def test_transport_bench_times_messages_with_their_feature_rows(tmp_path):
    """The rows travel in the replies, or (a ring) beside them, and the messages through gRPC or
    the verifier's Unix socket; they arrive every way."""
    res = main(["--batches", "2", "--nodes", "8", "--feature-rows", "3", "--rounds", "10", "--gaps-ms", "0",
                "--out-json", str(tmp_path / "t.json")])
    rows = {(row["feature_ring"], row["unix_socket"]): row for row in res["rows"]}
    assert sorted(rows) == [("off", "off"), ("off", "on"), ("on", "off"), ("on", "on")]
    inline, ring = rows["off", "off"], rows["on", "off"]
    for row in rows.values():
        assert row["batch"] == 2 and row["link"]["feature_rows"] == 2 * 3
        assert row["link"]["median_ms"] > 0 and row["echo"]["median_ms"] > 0
        # the link's time splits into the verifier's hold and the rest (both measured, both positive)
        assert 0 < row["link"]["wire_median_ms"] < row["link"]["median_ms"]
        assert 0 < row["link"]["held_median_ms"] < row["link"]["median_ms"]
    assert inline["reply_bytes"] > 2 * 3 * FEATURE_DIM * 2  # the rows travel, at the 8B width
    assert ring["reply_bytes"] < 1000  # only where they lie
    for ring_on in ("off", "on"):  # the same bytes through the socket as through gRPC
        assert rows[ring_on, "on"]["reply_bytes"] == rows[ring_on, "off"]["reply_bytes"]
        assert rows[ring_on, "on"]["request_bytes"] == rows[ring_on, "off"]["request_bytes"]


def test_stages_split_a_message_s_way_into_its_parts(tmp_path):
    """--stages: every part of a message's way is timed, each a positive share of the total, through
    gRPC and through the Unix socket."""
    res = main(["--batches", "2", "--nodes", "8", "--feature-rows", "3", "--rounds", "20", "--gaps-ms", "0",
                "--stages", "--feature-rings", "off"])
    assert [row["unix_socket"] for row in res["rows"]] == ["off", "on"]
    for row in res["rows"]:
        stages = row["link"]["stages_ms"]
        assert set(stages) == {name for name, _, _ in STAGES}
        parts = [v for name, v in stages.items() if name != "total"]
        assert all(v > 0 for v in parts), stages
        assert max(parts) < stages["total"] <= 1.5 * sum(parts)


def test_packed_feature_rows_travel_in_about_half_the_bytes(tmp_path):
    """--feature-wire fp8: the same rows go packed (F + 4 bytes each, not 2F), and arrive."""
    res = main(["--batches", "2", "--nodes", "8", "--feature-rows", "3", "--rounds", "10", "--gaps-ms", "0",
                "--feature-wire", "fp8", "--feature-rings", "off", "--unix-sockets", "off"])
    (row,) = res["rows"]
    assert res["feature_wire"] == "fp8" and row["link"]["feature_rows"] == 2 * 3
    assert 2 * 3 * (FEATURE_DIM + 4) < row["reply_bytes"] < 2 * 3 * FEATURE_DIM * 2 * 0.55
