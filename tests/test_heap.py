"""common/heap.py: the services' heap is frozen once they serve, and the process still exits cleanly."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import gc
import torch
try:
    import triton  # native bindings that report objects left alive at exit
except ImportError:
    pass
from common.heap import YOUNG_THRESHOLD, freeze_startup_heap

freeze_startup_heap()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
assert gc.get_threshold()[0] == YOUNG_THRESHOLD
print("frozen", flush=True)
"""


def test_the_startup_heap_is_frozen_and_released_at_exit():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "frozen", r.stderr
    assert "leaked" not in r.stderr, r.stderr  # the frozen objects are collected at exit after all
