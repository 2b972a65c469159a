"""The main job: start the verifier and the drafter on localhost, run the client, stop both.

    python scripts/demo.py --target DIR --draft DIR [--prompt TEXT] [client flags...]

Each service runs as its own process on a free port, exactly as it would on its own
machine; the script waits for both to report SERVING on the gRPC health service, streams
one generation through the public API, prints its stats, and shuts both down with SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
LOGS: dict[str, list[str]] = {}  # each service's output, shown when something fails


def start(name: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `python -m name args`, return the process and the address it prints when listening."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", name, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log = LOGS.setdefault(name, [])
    for line in proc.stdout:
        log.append(line)
        if " listening on " in line:
            print(f"[{name}] {line}", end="", file=sys.stderr)
            address = line.split(" listening on ")[1].split()[0]
            threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
            return proc, address.replace("0.0.0.0", "127.0.0.1")
    sys.stderr.writelines(log)
    raise SystemExit(f"error: {name} exited with code {proc.wait()} before listening")


def wait_healthy(address: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"error: {address} did not become healthy within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Flags it does not know go to the client (python -m drafter_svc.client), "
                                       "e.g. --max-new-tokens 96 --temperature 0.7.")
    p.add_argument("--target", default=str(ROOT / "models" / "default" / "target"), help="target checkpoint folder")
    p.add_argument("--draft", default=str(ROOT / "models" / "default" / "draft"), help="DFlash draft checkpoint folder")
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text")
    p.add_argument("--device", default=None, help="device of both services (default: cuda if available, else cpu)")
    p.add_argument("--verbose", action="store_true", help="print the services' logs at the end")
    a, client_args = p.parse_known_args()
    device = ["--device", a.device] if a.device else []
    procs = []
    try:
        verifier, v_addr = start("verifier_svc", ["--target", a.target, "--draft", a.draft, "--host", "127.0.0.1",
                                                  "--port", "0", *device])
        procs.append(verifier)
        wait_healthy(v_addr)
        drafter, d_addr = start("drafter_svc", ["--target", a.target, "--draft", a.draft, "--verifier", v_addr,
                                                "--host", "127.0.0.1", "--port", "0", *device])
        procs.append(drafter)
        wait_healthy(d_addr)
        sys.stdout.write(a.prompt)
        sys.stdout.flush()
        code = subprocess.call([sys.executable, "-m", "drafter_svc.client", "--server", d_addr, a.prompt, *client_args],
                               cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    finally:
        for proc in reversed(procs):
            stop(proc)
    if code != 0 or a.verbose:
        for name, lines in LOGS.items():
            sys.stderr.writelines(f"[{name}] {line}" for line in lines)
    print("both services stopped", file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
