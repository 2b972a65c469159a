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
