"""bench/codec.py runs end to end, with feature rows in bf16 and packed as fp8."""
from bench.codec import main


def test_codec_bench_times_both_feature_formats():
    plain = main(["--batches", "1,3", "--width", "64", "--reps", "2", "--nodes", "5"])
    packed = main(["--batches", "1,3", "--width", "64", "--reps", "2", "--nodes", "5", "--feature-wire", "fp8"])
    for a, b in zip(plain["rows"], packed["rows"]):
        assert b["reply_bytes"] < a["reply_bytes"]
        assert all(row[k] > 0 for row in (a, b) for k in ("encode_ms", "decode_ms", "walk_ms", "masks_ms"))
    assert packed["rows"][1]["reply_bytes"] - packed["rows"][0]["reply_bytes"] < 2 * 7 * (64 + 4) + 64
