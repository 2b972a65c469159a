"""Regenerate the Python gRPC code under common/gen from protos/ (needs grpcio-tools).

    python scripts/gen_protos.py [--out DIR]

The generated files are committed; tests/test_protos.py checks they are up to date.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "ddtree/v1/ddtree.proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--pyi_out={out}", str(ROOT / "protos" / PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit("error: protoc failed")
    pkg = out / "ddtree" / "v1"
    for init in (out / "ddtree" / "__init__.py", pkg / "__init__.py"):
        init.touch()
    return sorted(p for p in out.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "common" / "gen"), help="output folder (default common/gen)")
    files = generate(Path(p.parse_args().out))
    print(f"wrote {len(files)} files", file=sys.stderr)


if __name__ == "__main__":
    main()
