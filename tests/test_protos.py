"""The committed generated gRPC code matches protos/ (regenerate with scripts/gen_protos.py)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in gen.generate(tmp_path)}
    committed_root = ROOT / "common" / "gen"
    committed = {p.relative_to(committed_root): p.read_bytes() for p in committed_root.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert sorted(fresh) == sorted(committed)
    stale = [str(name) for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale} differ from protos/"
