"""scripts/netns_demo.sh: the verifier and the drafter in two network namespaces, mutual TLS on
both hops, a client in the root namespace; and nothing left behind, also when it fails.

Creating network namespaces needs privileges (root or CAP_NET_ADMIN): where the host refuses,
these tests are skipped with that reason.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "netns_demo.sh"


def namespaces_refused() -> str:
    """Why network namespaces cannot be used here ("" when they can)."""
    for tool in ("ip", "openssl"):
        if shutil.which(tool) is None:
            return f"the {tool} command is not installed"
    probe = f"ddtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip() or 'refused'}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


REFUSED = namespaces_refused()
pytestmark = pytest.mark.skipif(bool(REFUSED), reason=REFUSED)


def run_demo(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    work = tmp_path / "tmp"
    work.mkdir()
    environ = os.environ | {"TMPDIR": str(work), "NETNS_DEMO_TOKENS": "24"} | env
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=540, env=environ)


def assert_nothing_left(result: subprocess.CompletedProcess, tmp_path: Path) -> None:
    names = re.search(r"namespaces (\S+) and (\S+) deleted", result.stdout)
    assert names, result.stdout + result.stderr
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert names[1] not in listed and names[2] not in listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    tag = names[1].removesuffix("-verifier")
    assert f" {tag}r" not in links and f" {tag}r@" not in links
    left = [p.name for p in (tmp_path / "tmp").glob("tmp.*")]  # mktemp -d's (torch adds folders of its own)
    assert not left, f"the script's work folder is left: {left}"
    # No process of the demo is left: theirs are the only command lines naming its work folder.
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        assert str(tmp_path / "tmp") not in text, f"left running: {text}"


@pytest.mark.timeout(600)
def test_demo_generates_over_mutual_tls_across_namespaces(tmp_path):
    result = run_demo(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "verifier up (mutual TLS)" in out and "verifier unreachable from the root namespace" in out
    generated = out.split("generating from the root namespace:\n", 1)[1].split("netns demo: ok", 1)[0]
    assert generated.strip(), out
    assert "24 tokens" in result.stderr  # the client's stats line
    assert_nothing_left(result, tmp_path)


@pytest.mark.timeout(600)
def test_demo_cleans_up_when_it_fails(tmp_path):
    # Both servers start, then the client's request is refused (max_new_tokens 0): the trap must
    # still stop both servers and delete the namespaces.
    result = run_demo(tmp_path, NETNS_DEMO_TOKENS="0")
    assert result.returncode != 0
    assert "drafter up" in result.stdout, result.stdout + result.stderr
    assert_nothing_left(result, tmp_path)
