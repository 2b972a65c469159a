"""Every bench script runs as `python bench/X.py`: its --help works, and bench/ is then off the
import path, so that none of its modules (bench/kernels.py, say) shadows an installed package of
the same name (transformers imports the PyPI package `kernels`)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())

# One interpreter runs every script's --help as `python bench/X.py --help` would (sys.path[0] is
# the script's directory), then reports what its path held afterwards.
PROBE = """
import json, os, runpy, sys
bench, out = sys.argv[1], {}
for name in sys.argv[2:]:
    sys.argv = [os.path.join(bench, name), "--help"]
    sys.path[0] = bench
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        out[name] = "no exit"
    except SystemExit as exc:
        out[name] = "bench on path" if bench in map(os.path.abspath, sys.path) else exc.code
print(json.dumps(out))
"""


def test_every_bench_script_has_help_and_keeps_bench_off_the_path():
    assert len(SCRIPTS) > 15
    done = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "bench"), *SCRIPTS], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {name: 0 for name in SCRIPTS}, {k: v for k, v in results.items() if v != 0}


def test_bench_arguments_are_checked_before_any_work(tmp_path, capsys):
    """A list that is not numbers, a value below its minimum or an --out-json folder that does not
    exist ends the script with one line before it runs (they used to end in a traceback, the last
    only after the whole run)."""
    import pytest

    from bench import acceptance, codec, round as round_bench, serve, transport

    cases = [
        (codec.main, ["--batches", "abc"], "--batches must be comma-separated integers"),
        (codec.main, ["--out-json", str(tmp_path / "missing" / "x.json")], "is not a writable folder"),
        (transport.main, ["--gaps-ms", "x"], "--gaps-ms must be comma-separated numbers"),
        (serve.parse_args, ["--small", "--quick", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (serve.parse_args, ["--small", "--quick", "--max-seq-len", "8"], "does not hold a request"),
        (round_bench.main, ["--small", "--modes", "ar,foo"], "--modes takes ar, chain and tree budgets"),
        (acceptance.main, ["--budgets", "-1"], "--budgets and --temperatures must be >= 0"),
        (acceptance.main, ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ]
    for main, argv, needle in cases:
        with pytest.raises(SystemExit) as caught:
            main(argv)
        err = capsys.readouterr().err
        assert caught.value.code != 0 and needle in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "missing").exists()
