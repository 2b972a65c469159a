"""Bad input to the command-line tools exits non-zero with one line and no traceback."""
import json
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def dirs(qwen3_pair):
    return str(qwen3_pair[0]), str(qwen3_pair[1])


def test_generate_json_output(dirs):
    target, draft = dirs
    r = run("drafter_svc.generate", "--target", target, "--draft", draft, "--prompt-ids", "1,2,3",
            "--max-new-tokens", "8", "--tree-budget", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("tokens", "text", "acceptance_lengths", "rounds", "mean_acceptance", "tokens_per_s", "elapsed_s"):
        assert key in out
    assert len(out["tokens"]) == 8 and out["rounds"] == len(out["acceptance_lengths"])


@pytest.mark.parametrize("extra, needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--tree-budget", "-3"], "tree-budget"),
    (["--prompt-ids", "1,2,999999"], "outside the vocabulary"),
    (["--prompt-ids", "1,x"], "comma-separated"),
    (["--prompt-ids", "1,,2"], "comma-separated"),  # an empty item is a typo, not nothing
    (["--prompt", ""], "empty"),
])
def test_generate_rejects_bad_input(dirs, extra, needle):
    target, draft = dirs
    args = ["--target", target, "--draft", draft]
    if "--prompt-ids" not in extra and "--prompt" not in extra:
        args += ["--prompt-ids", "1,2"]
    r = run("drafter_svc.generate", *args, *extra)
    assert r.returncode != 0
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_generate_rejects_bad_checkpoints(dirs, tmp_path):
    target, draft = dirs
    for args, needle in [
        (["--target", str(tmp_path / "missing"), "--draft", draft], "not found"),
        (["--target", target, "--draft", target], "unsupported architecture"),
    ]:
        r = run("drafter_svc.generate", *args, "--prompt-ids", "1")
        assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr


def test_make_tiny_rejects_bad_layer_ids(tmp_path):
    r = run("common.make_tiny", "--out", str(tmp_path), "--target-layer-ids", "0,7")
    assert r.returncode != 0 and "target-layer-ids" in r.stderr and "Traceback" not in r.stderr


def test_every_flag_has_a_prefixed_environment_fallback(capsys, monkeypatch):
    """Each service's --help names one env variable per flag, prefixed with the service's name
    (the drafter's two verifier-facing ones, VERIFIER_ADDR and VERIFIER_WAIT_S, say whose they are);
    a variable sets the flag's default."""
    import re

    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    helps = {}
    for name, parse in (("drafter", drafter_cli.parse_args), ("verifier", verifier_cli.parse_config)):
        with pytest.raises(SystemExit):
            parse(["--help"])
        helps[name] = re.findall(r"\[env\s+([A-Z0-9_]+)\]", capsys.readouterr().out)
    assert helps["drafter"] and helps["verifier"]
    assert all(v.startswith("DRAFTER_") or v in ("VERIFIER_ADDR", "VERIFIER_WAIT_S") for v in helps["drafter"])
    assert all(v.startswith("VERIFIER_") for v in helps["verifier"])
    monkeypatch.setenv("DRAFTER_TREE_BUDGET", "5")
    monkeypatch.setenv("DRAFTER_MAX_CONCURRENT", "3")
    cfg = drafter_cli.parse_args(["--draft", "d", "--target", "t"])
    assert (cfg.tree_budget, cfg.max_concurrent) == (5, 3)


def test_http_and_metrics_ports_from_flags_and_environment(monkeypatch):
    """0 (the default) means off for the drafter's --http-port and the verifier's --metrics-port."""
    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    cfg = drafter_cli.parse_args(["--draft", "d", "--target", "models/t"])
    assert (cfg.http_port, cfg.model_name) == (0, "t")
    monkeypatch.setenv("DRAFTER_HTTP_PORT", "8000")
    monkeypatch.setenv("DRAFTER_SERVED_MODEL_NAME", "coder")
    cfg = drafter_cli.parse_args(["--draft", "d", "--target", "t"])
    assert (cfg.http_port, cfg.model_name) == (8000, "coder")
    assert drafter_cli.parse_args(["--draft", "d", "--target", "t", "--http-port", "9"]).http_port == 9
    with pytest.raises(SystemExit):
        drafter_cli.parse_args(["--draft", "d", "--target", "t", "--http-port", "70000"])
    assert verifier_cli.parse_config(["--target", "t", "--device", "cpu"]).metrics_port == 0
    monkeypatch.setenv("VERIFIER_METRICS_PORT", "9100")
    assert verifier_cli.parse_config(["--target", "t", "--device", "cpu"]).metrics_port == 9100


def test_client_flags_have_prefixed_environment_fallbacks(capsys):
    """The client's variables carry DDTREE_ (DRAFTER_ADDR, the address, says whose it is)."""
    import re

    from drafter_svc import client

    with pytest.raises(SystemExit):
        client.parse_args(["--help"])
    names = re.findall(r"\[env\s+([A-Z0-9_]+)\]", capsys.readouterr().out)
    assert {"DDTREE_CA", "DDTREE_CERT", "DDTREE_KEY", "DDTREE_API_KEY"} <= set(names)
    assert all(v.startswith("DDTREE_") or v == "DRAFTER_ADDR" for v in names)


def test_console_scripts_name_importable_mains(capsys):
    """pyproject's [project.scripts] (ddtree-verifier, ddtree-drafter, ddtree-client) point at
    main(argv=None) functions that parse the command line."""
    import importlib
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    scripts = pyproject["project"]["scripts"]
    assert scripts == {"ddtree-verifier": "verifier_svc.__main__:main", "ddtree-drafter": "drafter_svc.__main__:main",
                       "ddtree-client": "drafter_svc.client:main"}
    for target in scripts.values():
        module, _, name = target.partition(":")
        main = getattr(importlib.import_module(module), name)
        with pytest.raises(SystemExit) as caught:
            main(["--help"])
        assert caught.value.code == 0 and "[env " in capsys.readouterr().out


def test_admission_limits_from_the_environment(monkeypatch):
    """The verifier's open timeout and the drafter's queue bound fall back to their variables."""
    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    monkeypatch.setenv("VERIFIER_OPEN_TIMEOUT_S", "2.5")
    monkeypatch.setenv("DRAFTER_MAX_QUEUE", "7")
    assert verifier_cli.parse_config(["--target", "t", "--device", "cpu"]).open_timeout_s == 2.5
    assert drafter_cli.parse_args(["--draft", "d", "--target", "t"]).max_queue == 7


def test_local_verifier_takes_the_verifier_flags(qwen3_pair, monkeypatch, capsys):
    """--verifier local: the in-process verifier gets the drafter's target, draft, device and
    --max-concurrent, then --local-verifier-flags through the verifier's own parser (its checks,
    its VERIFIER_* fallbacks); bad ones end start-up with one line."""
    import drafter_svc.__main__ as drafter_cli
    from common.config import load_draft_config

    target, draft = map(str, qwen3_pair)
    base = ["--draft", draft, "--target", target, "--device", "cpu", "--max-concurrent", "6", "--verifier", "local"]
    local = drafter_cli.parse_args(base).local_verifier
    assert (local.target_dir, local.projection_dir, local.device, local.max_sessions) == (target, draft, "cpu", 6)
    assert local.feature_layer_ids == load_draft_config(draft).target_layer_ids
    monkeypatch.setenv("VERIFIER_MAX_TREE_NODES", "33")
    local = drafter_cli.parse_args(base + ["--local-verifier-flags",
                                          "--max-seq-len 256 --graph-batches 1,2 --raw-features"]).local_verifier
    assert (local.max_seq_len, local.graph_batches, local.projection_dir, local.max_tree_nodes) == (256, (1, 2), "", 33)
    assert drafter_cli.parse_args(["--draft", draft, "--target", target]).local_verifier is None
    capsys.readouterr()
    for bad in (base + ["--local-verifier-flags", "--max-seq-len 1"], base + ["--local-verifier-flags", "--nope"],
                base + ["--local-verifier-flags", '"unclosed'], base + ["--pipelining", "on"],
                ["--draft", draft, "--target", target, "--local-verifier-flags", "--max-seq-len 256"]):
        with pytest.raises(SystemExit) as caught:
            drafter_cli.parse_args(bad)
        err = capsys.readouterr().err
        assert caught.value.code != 0 and err.strip() and "Traceback" not in err


def test_our_packages_shadow_no_installed_distribution():
    """Each top-level package this project installs belongs to it alone: a name another installed
    distribution also provides (transformers imports the PyPI package `kernels`) would shadow it."""
    import importlib.metadata
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    ours = [p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]]
    providers = importlib.metadata.packages_distributions()
    for name in ours:
        others = {d for d in providers.get(name, []) if d != config["project"]["name"]}
        assert not others, f"package {name!r} is also installed by {sorted(others)}"


@pytest.mark.parametrize("service, env, value, needle", [
    ("verifier_svc", "VERIFIER_LOG_LEVEL", "bogus", "VERIFIER_LOG_LEVEL='bogus': invalid choice for --log-level"),
    ("verifier_svc", "VERIFIER_LOG_FORMAT", "xml", "VERIFIER_LOG_FORMAT='xml': invalid choice for --log-format"),
    ("verifier_svc", "VERIFIER_SAMPLING", "exact", "invalid choice for --sampling"),
    ("drafter_svc", "DRAFTER_LOG_LEVEL", "loud", "DRAFTER_LOG_LEVEL='loud': invalid choice for --log-level"),
    ("drafter_svc", "DRAFTER_DTYPE", "bogus", "DRAFTER_DTYPE='bogus': invalid choice for --dtype"),
    ("drafter_svc", "DRAFTER_PIPELINING", "maybe", "invalid choice for --pipelining"),
])
def test_environment_values_pass_the_flags_choices(capsys, monkeypatch, service, env, value, needle):
    """argparse checks a flag's choices on the command line only; a value from the environment
    (a default to argparse) is checked too, and its error names the variable."""
    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as caught:
        if service == "drafter_svc":
            drafter_cli.parse_args(["--draft", "d", "--target", "t"])
        else:
            verifier_cli.parse_config(["--target", "t", "--device", "cpu"])
    err = capsys.readouterr().err
    assert caught.value.code != 0 and needle in err and len(err.strip().splitlines()) == 1, err


def test_environment_values_in_the_choices_are_taken(monkeypatch):
    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    monkeypatch.setenv("VERIFIER_LOG_LEVEL", "debug")  # the flag's type (upper-casing) applies as on the command line
    monkeypatch.setenv("DRAFTER_LOG_FORMAT", "JSON")
    assert verifier_cli.parse_config(["--target", "t", "--device", "cpu"]).log_level == "DEBUG"
    flags = ["--target", "t", "--device", "cpu", "--log-level", "warning"]
    assert verifier_cli.parse_config(flags).log_level == "WARNING"
    assert drafter_cli.parse_args(["--draft", "d", "--target", "t"]).log_format == "json"


@pytest.mark.parametrize("service, args, needle", [
    ("drafter", ["--port", "99999"], "--port must be in [0, 65535], got 99999"),  # it used to wrap around
    ("drafter", ["--port", "-1"], "--port must be in [0, 65535], got -1"),
    ("drafter", ["--device", "bogus"], "--device: bad device 'bogus'"),
    ("drafter", ["--device", "cuda:99"], "--device: device 'cuda:99' asked for"),
    ("verifier", ["--grace", "-5"], "grace_s must be >= 0, got -5.0"),
    ("verifier", ["--stall-timeout", "-1"], "stall_timeout_s must be >= 0, got -1.0"),
    ("verifier", ["--graph-batches", "0"], "batch_buckets must be non-empty and >= 1"),  # graphs or not
    ("verifier", ["--graph-trees", "0,-3"], "tree_buckets must be non-empty and >= 0"),
    ("verifier", ["--device", "cuda:99"], "device 'cuda:99' asked for"),
])
def test_services_refuse_bad_ports_devices_grace_and_graph_buckets(capsys, service, args, needle):
    """One line, before anything loads, on every machine (CUDA graphs or not)."""
    import drafter_svc.__main__ as drafter_cli
    import verifier_svc.__main__ as verifier_cli

    with pytest.raises(SystemExit) as caught:
        if service == "drafter":
            drafter_cli.parse_args(["--draft", "d", "--target", "t", *args])
        else:
            verifier_cli.parse_config(["--target", "t", *args])
    err = capsys.readouterr().err
    assert caught.value.code != 0 and needle in err and len(err.strip().splitlines()) == 1, err


def test_list_defaults_show_and_parse_as_written(capsys):
    """A list flag's default appears in --help as it is typed (1,2,4), and parses back to itself."""
    import verifier_svc.__main__ as verifier_cli
    from verifier_svc.server import VerifierConfig

    with pytest.raises(SystemExit):
        verifier_cli.parse_config(["--help"])
    out = capsys.readouterr().out
    assert "(default: " + ",".join(map(str, VerifierConfig.graph_batches)) + ")" in " ".join(out.split())
    assert verifier_cli.parse_config(["--target", "t", "--device", "cpu"]).graph_batches == VerifierConfig.graph_batches


def test_a_single_local_verifier_flag_needs_no_quoting_trick(qwen3_pair):
    """--local-verifier-flags --deterministic: the word after it is its value, though it begins with '-'."""
    import drafter_svc.__main__ as drafter_cli

    target, draft = map(str, qwen3_pair)
    base = ["--draft", draft, "--target", target, "--device", "cpu", "--verifier", "local"]
    assert drafter_cli.parse_args(base + ["--local-verifier-flags", "--deterministic"]).local_verifier.deterministic
    assert drafter_cli.parse_args(base + ["--local-verifier-flags", "--max-seq-len 256",
                                          "--max-concurrent", "3"]).local_verifier.max_seq_len == 256


@pytest.mark.parametrize("args, needle", [
    (["--kv-heads", "0"], "--kv-heads must be >= 1"),
    (["--hidden", "-8"], "--hidden must be >= 1"),
    (["--draft-layers", "0"], "--draft-layers must be >= 1"),
    (["--shards", "0"], "--shards must be >= 1"),
    (["--head-dim", "7"], "--head-dim must be even"),
    (["--vocab", "10"], "--vocab must be >= 258"),  # it used to write 258 without a word
])
def test_make_tiny_refuses_sizes_no_model_runs_with(tmp_path, capsys, args, needle):
    from common import make_tiny

    with pytest.raises(SystemExit) as caught:
        make_tiny.main(["--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert caught.value.code != 0 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not any(tmp_path.iterdir())  # refused before anything is written


@pytest.mark.parametrize("args, needle", [
    (["--device", "bogus"], "--device: bad device 'bogus'"),
    (["--device", "cuda:99"], "--device: device 'cuda:99' asked for"),
])
def test_generate_refuses_bad_devices(dirs, capsys, args, needle):
    from drafter_svc import generate

    target, draft = dirs
    with pytest.raises(SystemExit) as caught:
        generate.main(["--target", target, "--draft", draft, "--prompt-ids", "1,2", *args])
    err = capsys.readouterr().err
    assert caught.value.code != 0 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, needle", [
    (["--verifier", "local,127.0.0.1:50051"], "'local' (the target in this process) stands alone"),
    (["--verifier", "LOCAL"], "'local' (the target in this process) stands alone"),
    (["--verifier", "local", "--local-verifier-flags", "--port 9999 --max-seq-len 256"], "--port would have no effect"),
    (["--verifier", "local", "--local-verifier-flags", "--tensor-parallel=2"], "--tensor-parallel=2 would have no"),
    (["--verifier", "local", "--local-verifier-flags", "--feature-wire fp8"], "--feature-wire would have no effect"),
])
def test_local_verifier_mixups_are_refused(qwen3_pair, capsys, args, needle):
    """'local' among replica addresses was dialled as a host name; service-only flags in
    --local-verifier-flags were dropped without a word."""
    import drafter_svc.__main__ as drafter_cli

    target, draft = map(str, qwen3_pair)
    with pytest.raises(SystemExit) as caught:
        drafter_cli.parse_args(["--draft", draft, "--target", target, "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert caught.value.code != 0 and needle in err and len(err.strip().splitlines()) == 1, err


def test_make_tiny_files_take_the_umask(tmp_path):
    """safetensors writes 0600; a container running as another user could not read the pair."""
    import os

    from common import make_tiny

    old = os.umask(0o022)
    try:
        make_tiny.main(["--out", str(tmp_path), "--shards", "2"])
    finally:
        os.umask(old)
    files = list(tmp_path.glob("*/model*.safetensors*"))
    assert len(files) == 4 and all(f.stat().st_mode & 0o777 == 0o644 for f in files), files
