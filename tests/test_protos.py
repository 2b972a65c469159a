"""The committed generated gRPC code matches protos/ (regenerate with scripts/gen_protos.py), and
it imports as the package `common.gen` without any sys.path edit."""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GEN = ROOT / "common" / "gen"


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_generated_code_is_up_to_date(tmp_path):
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in load_generator().generate(tmp_path)}
    committed = {p.relative_to(GEN): p.read_bytes() for p in GEN.rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert sorted(fresh) == sorted(committed)
    stale = [str(name) for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"regenerate with `python scripts/gen_protos.py`: {stale} differ from protos/"


def test_generated_imports_name_the_package():
    gen = load_generator()
    sample = ("from ddtree.v1 import ddtree_pb2 as ddtree_dot_v1_dot_ddtree__pb2\n"
              "import ddtree.v1.other_pb2\n"
              "from google.protobuf import descriptor as _descriptor\n"
              "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'ddtree.v1.ddtree_pb2', _globals)\n")
    assert gen.package_imports(sample) == (
        "from common.gen.ddtree.v1 import ddtree_pb2 as ddtree_dot_v1_dot_ddtree__pb2\n"
        "import common.gen.ddtree.v1.other_pb2\n"
        "from google.protobuf import descriptor as _descriptor\n"
        "_builder.BuildTopDescriptorsAndMessages(DESCRIPTOR, 'common.gen.ddtree.v1.ddtree_pb2', _globals)\n")
    for path in GEN.rglob("*.py*"):
        if path.suffix in (".py", ".pyi") and "__pycache__" not in path.parts:
            lines = path.read_text(encoding="utf-8").splitlines()
            assert not [line for line in lines if line.startswith(("from ddtree", "import ddtree"))], path


def test_stubs_import_without_a_path_edit():
    """Importing the stubs (directly or through common.rpc) adds nothing to sys.path and no
    top-level `ddtree` module, so another project's `ddtree` can be imported beside them."""
    probe = (
        "import importlib.util, sys\n"
        "before = list(sys.path)\n"
        "from common.gen.ddtree.v1 import ddtree_pb2, ddtree_pb2_grpc\n"
        "import common.rpc as rpc\n"
        "assert sys.path == before, set(sys.path) ^ set(before)\n"
        "assert not [m for m in sys.modules if m == 'ddtree' or m.startswith('ddtree.')]\n"
        "assert importlib.util.find_spec('ddtree') is None\n"
        "assert rpc.pb is ddtree_pb2 and rpc.pb_grpc is ddtree_pb2_grpc\n"
        "assert ddtree_pb2.GenerateRequest.__module__ == 'common.gen.ddtree.v1.ddtree_pb2'\n"
        "assert rpc.GENERATION_SERVICE == 'ddtree.v1.Generation'\n"
        "assert ddtree_pb2_grpc.GenerationStub and ddtree_pb2_grpc.VerifierServicer\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
