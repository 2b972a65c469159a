#!/usr/bin/env python3
"""Check that compose.yaml (and the Dockerfile) give the deployment the project requires.

    python3 scripts/check_compose.py [--compose FILE] [--dockerfile FILE] [--schema JSON]

Run by scripts/check_compose.sh after `docker-compose config -q` has validated the file
against the compose schema. This script reads the YAML with PyYAML (anchors and `<<` merge
keys resolved), applies Compose's `${VAR:-default}` interpolation with an empty environment
(so it checks the defaults a bare `docker compose up` gets) and asserts:

- services verifier, drafter and jaeger exist; jaeger runs a pinned Jaeger v2 image;
- verifier and drafter are built from this repository into one shared image name, run
  `python -m verifier_svc` / `python -m drafter_svc`, reserve an NVIDIA GPU
  (deploy.resources.reservations.devices: driver nvidia, capabilities [gpu], count or
  device_ids chosen through an environment variable), mount ${MODEL_DIR:-./models/default}
  read-only, use host IPC or a shm size, export traces to http://jaeger:4317 under their own
  OTEL_SERVICE_NAME, and have a healthcheck that runs scripts/grpc_health_probe.py on their
  port with explicit interval, timeout, retries and start_period;
- the drafter reaches the verifier at ${VERIFIER_ADDR:-verifier:50051} and depends on it
  with condition service_healthy (and on jaeger);
- published ports: drafter 50050 and jaeger 16686; the verifier's internal port is not
  published to the world: unpublished, or bound to a loopback address by default;
- TLS: both model services mount ${TLS_DIR:-./certs} read-only at /certs; the verifier serves
  mutual TLS (--tls-cert, --tls-key, --tls-client-ca from /certs); the drafter dials it with a
  CA and a client certificate (--verifier-ca, --verifier-cert, --verifier-key from /certs);
  a healthcheck of a TLS port passes --ca (and a client certificate where one is required);
- the Dockerfile uses a pinned pytorch/pytorch CUDA runtime base, WORKDIR /app, a non-root
  USER, PYTHONUNBUFFERED=1, keeps torch through a pip constraint, and COPYs only paths that
  exist and that .dockerignore does not exclude.

With --schema it also validates the interpolated file against that compose JSON schema
(jsonschema needed; Debian's docker-compose package ships both). Exits 1 with one line per
problem on failure.
"""
from __future__ import annotations

import argparse
import fnmatch
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_SERVICES = {"verifier": ("verifier_svc", 50051), "drafter": ("drafter_svc", 50050)}
PUBLISHED = {"drafter": [50050], "jaeger": [16686]}
INTERNAL = {"verifier": 50051}  # never published beyond loopback by default
LOOPBACK = ("127.0.0.1", "::1", "[::1]", "localhost")
CERTS = "/certs"
DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
PROBE = "grpc_health_probe.py"


class InterpolationError(ValueError):
    pass


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?|:\+|\+)(?P<arg>.*))?$",
                     re.S)


def interpolate_str(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ..."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        b = _BRACED.match(m.group("braced"))
        if not b:
            raise InterpolationError(f"invalid interpolation format {m.group(0)!r}")
        name, op, arg = b.group("name"), b.group("op"), b.group("arg") or ""
        val = env.get(name)
        if op is None:
            return val or ""
        if op == ":-":
            return val if val else interpolate_str(arg, env)
        if op == "-":
            return val if val is not None else interpolate_str(arg, env)
        if op in (":?", "?"):
            if (op == ":?" and not val) or val is None:
                raise InterpolationError(f"required variable {name} is unset: {arg}")
            return val
        if op == ":+":
            return interpolate_str(arg, env) if val else ""
        return interpolate_str(arg, env) if val is not None else ""  # "+"
    return _VAR.sub(sub, text)


def interpolate(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate_str(node, env)
    if isinstance(node, list):
        return [interpolate(x, env) for x in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def command_argv(cmd) -> list[str]:
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(x) for x in cmd]


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def env_dict(env) -> dict[str, str]:
    if isinstance(env, dict):
        return {str(k): "" if v is None else str(v) for k, v in env.items()}
    out = {}
    for item in env or []:
        k, _, v = str(item).partition("=")
        out[k] = v
    return out


def published_bindings(ports) -> dict[int, tuple[str, str]]:
    """container port -> (host address, "" = all interfaces; published host port as text), for
    short and long syntax."""
    out: dict[int, tuple[str, str]] = {}
    for p in ports or []:
        if isinstance(p, dict):
            if p.get("published") is not None:
                out[int(str(p["target"]).split("/")[0])] = (str(p.get("host_ip") or ""), str(p["published"]))
            continue
        parts = str(p).split("/")[0].rsplit(":", 2)
        if len(parts) >= 2:
            out[int(parts[-1].split("-")[0])] = (parts[0] if len(parts) == 3 else "", parts[-2])
    return out


def published_ports(ports) -> dict[int, str]:
    """container port -> published host port (as text) for short and long syntax."""
    return {port: host_port for port, (_, host_port) in published_bindings(ports).items()}


class Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def need(self, cond, message: str) -> bool:
        if not cond:
            self.problems.append(message)
        return bool(cond)


def check_compose(raw: dict, c: Checker, compose_path: Path) -> None:
    try:
        doc = interpolate(raw, {})
    except InterpolationError as exc:
        c.need(False, f"interpolation with an empty environment fails: {exc}")
        return
    services = doc.get("services")
    raw_services = raw.get("services") or {}
    if not c.need(isinstance(services, dict), "no top-level `services` mapping"):
        return
    for name in ("verifier", "drafter", "jaeger"):
        c.need(isinstance(services.get(name), dict), f"service `{name}` is missing")
    if c.problems:
        return

    for name, svc in services.items():
        deps = svc.get("depends_on") if isinstance(svc, dict) else None
        for dep in (deps if isinstance(deps, (list, dict)) else []):
            c.need(dep in services, f"services.{name}.depends_on names an undefined service {dep!r}")

    images = {}
    for name, (module, port) in MODEL_SERVICES.items():
        svc, rsvc, where = services[name], raw_services[name], f"services.{name}"
        # image: built from this repo, one shared name
        build = svc.get("build")
        ctx = build if isinstance(build, str) else (build or {}).get("context")
        c.need(ctx is not None, f"{where}: no `build` (the image is built from this repository)")
        if ctx is not None:
            c.need((compose_path.parent / ctx).resolve() == compose_path.parent.resolve(),
                   f"{where}.build context must be the repository root ('.'), got {ctx!r}")
        images[name] = svc.get("image")
        c.need(images[name], f"{where}: no `image` name (both model services share one)")

        # command
        argv = command_argv(svc.get("command"))
        c.need(argv[:3] in (["python", "-m", module], ["python3", "-m", module]),
               f"{where}.command must start with `python -m {module}`, got {argv[:3]}")
        c.need(flag_value(argv, "--target") and flag_value(argv, "--target").startswith("/models"),
               f"{where}.command: --target must point into the /models mount")
        if name == "drafter":
            c.need(flag_value(argv, "--draft") and flag_value(argv, "--draft").startswith("/models"),
                   f"{where}.command: --draft must point into the /models mount")
        pflag = flag_value(argv, "--port")
        c.need(pflag is None or pflag == str(port), f"{where}.command: --port must be {port}")
        hflag = flag_value(argv, "--host")
        c.need(hflag in (None, "0.0.0.0", "::", "[::]"),
               f"{where}.command: --host {hflag} is not reachable from other containers")

        # GPU reservation
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations")
                   or {}).get("devices")
        rdevices = (((rsvc.get("deploy") or {}).get("resources") or {}).get("reservations")
                    or {}).get("devices")
        gpus = [(d, r) for d, r in zip(devices or [], rdevices or [])
                if isinstance(d, dict) and d.get("driver") == "nvidia"]
        if c.need(gpus, f"{where}: no deploy.resources.reservations.devices entry with driver nvidia"):
            d, r = gpus[0]
            c.need("gpu" in (d.get("capabilities") or []),
                   f"{where}: GPU reservation needs capabilities [gpu]")
            has_count, has_ids = "count" in d, "device_ids" in d
            c.need(has_count != has_ids,
                   f"{where}: GPU reservation needs exactly one of count / device_ids")
            if has_count:
                c.need(str(d["count"]) == "all" or str(d["count"]).isdigit() and int(d["count"]) >= 1,
                       f"{where}: GPU count must be a positive integer or 'all', got {d['count']!r}")
            if has_ids:
                c.need(d["device_ids"] and all(str(i).strip() for i in d["device_ids"]),
                       f"{where}: device_ids defaults to an empty id")
            chosen = r.get("device_ids") if has_ids else r.get("count")
            c.need("${" in str(chosen),
                   f"{where}: GPU choice ({'device_ids' if has_ids else 'count'}) is not set "
                   "through an environment variable")

        # model folder, read-only
        mounts = []
        for v, rv in zip(svc.get("volumes") or [], rsvc.get("volumes") or []):
            if isinstance(v, dict):
                mounts.append((v.get("source"), v.get("target"), bool(v.get("read_only")),
                               str(rv.get("source"))))
            else:
                parts = str(v).split(":")
                if len(parts) >= 2:
                    mounts.append((parts[0], parts[1], "ro" in parts[2:], str(rv).split(":")[0]))
        model = [m for m in mounts if m[1] == "/models"]
        if c.need(model, f"{where}: no volume mounted at /models"):
            src, _, ro, rsrc = model[0]
            c.need(ro, f"{where}: the /models mount must be read-only")
            c.need("MODEL_DIR" in rsrc and src == "./models/default",
                   f"{where}: /models must come from ${{MODEL_DIR:-./models/default}}, got {rsrc!r}")

        c.need(svc.get("ipc") == "host" or svc.get("shm_size"),
               f"{where}: set `ipc: host` or `shm_size` (the default 64 MB /dev/shm is too small)")

        # tracing
        env = env_dict(svc.get("environment"))
        c.need(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == "http://jaeger:4317",
               f"{where}: OTEL_EXPORTER_OTLP_ENDPOINT must default to http://jaeger:4317, "
               f"got {env.get('OTEL_EXPORTER_OTLP_ENDPOINT')!r}")
        c.need(env.get("OTEL_SERVICE_NAME"), f"{where}: OTEL_SERVICE_NAME is not set")

        # healthcheck
        hc = svc.get("healthcheck")
        if c.need(isinstance(hc, dict) and not hc.get("disable"), f"{where}: no healthcheck"):
            test = hc.get("test")
            targv = (command_argv(test) if isinstance(test, str)
                     else [str(x) for x in (test or [])])
            c.need(targv and targv[0] in ("CMD", "CMD-SHELL"),
                   f"{where}.healthcheck.test must be a CMD or CMD-SHELL list")
            if targv and targv[0] == "CMD-SHELL":
                targv = ["CMD-SHELL", *command_argv(" ".join(targv[1:]))]
            probe = [a for a in targv if a.endswith(PROBE)]
            if c.need(probe, f"{where}.healthcheck.test does not run scripts/{PROBE}"):
                c.need((ROOT / "scripts" / PROBE).is_file(), f"scripts/{PROBE} does not exist")
                c.need(probe[0] in (f"/app/scripts/{PROBE}", f"scripts/{PROBE}"),
                       f"{where}.healthcheck runs {probe[0]}, not the image's /app/scripts/{PROBE}")
                addr = flag_value(targv, "--addr") or ""
                c.need(addr.rsplit(":", 1)[-1] == str(port),
                       f"{where}.healthcheck probes {addr!r}, not the service's port {port}")
            for key in ("interval", "timeout", "retries", "start_period"):
                c.need(key in hc, f"{where}.healthcheck.{key} must be set explicitly")
            for key in ("interval", "timeout", "start_period"):
                if key in hc:
                    c.need(DURATION.match(str(hc[key])),
                           f"{where}.healthcheck.{key}={hc[key]!r} is not a duration like 10s")
            if "retries" in hc:
                c.need(isinstance(hc["retries"], int) and hc["retries"] >= 1,
                       f"{where}.healthcheck.retries must be a positive integer")
            ptimeout = flag_value(targv, "--timeout")
            if ptimeout and DURATION.match(str(hc.get("timeout", ""))):
                c.need(float(ptimeout) < duration_s(str(hc["timeout"])),
                       f"{where}: the probe's --timeout {ptimeout} must be below "
                       f"healthcheck.timeout {hc['timeout']} (else Docker kills it first)")

    if images.get("verifier") and images.get("drafter"):
        c.need(images["verifier"] == images["drafter"],
               f"verifier and drafter must share one image name, got {images}")
    names = [env_dict(services[n].get("environment")).get("OTEL_SERVICE_NAME") for n in MODEL_SERVICES]
    c.need(len(set(names)) == len(names), f"OTEL_SERVICE_NAME must differ per service, got {names}")

    # drafter -> verifier
    drafter, rdrafter = services["drafter"], raw_services["drafter"]
    dargv = command_argv(drafter.get("command"))
    vflag = flag_value(dargv, "--verifier")
    raw_vflag = flag_value(command_argv(rdrafter.get("command")), "--verifier")
    denv = env_dict(drafter.get("environment"))
    raw_denv = env_dict(rdrafter.get("environment"))
    if vflag is not None:  # an explicit flag wins over the VERIFIER_ADDR environment fallback
        c.need(vflag == "verifier:50051",
               f"services.drafter: --verifier must default to verifier:50051, got {vflag!r}")
        c.need("${VERIFIER_ADDR" in str(raw_vflag),
               f"services.drafter: --verifier {raw_vflag} is not taken from ${{VERIFIER_ADDR}}")
    else:
        c.need(denv.get("VERIFIER_ADDR") == "verifier:50051"
               and "${VERIFIER_ADDR" in raw_denv.get("VERIFIER_ADDR", ""),
               "services.drafter: set --verifier or environment VERIFIER_ADDR from "
               "${VERIFIER_ADDR:-verifier:50051}")
    deps = drafter.get("depends_on")
    if c.need(isinstance(deps, dict) and "verifier" in deps,
              "services.drafter.depends_on must name verifier (long form with a condition)"):
        c.need((deps["verifier"] or {}).get("condition") == "service_healthy",
               "services.drafter.depends_on.verifier.condition must be service_healthy")
        c.need("jaeger" in deps, "services.drafter.depends_on must include jaeger")

    # jaeger
    jaeger = services["jaeger"]
    c.need(re.fullmatch(r"(?:[\w.-]+(?::\d+)?/)?jaegertracing/jaeger:2\.\d+(?:\.\d+)*", str(jaeger.get("image"))),
           f"services.jaeger.image must be a pinned Jaeger v2 tag (jaegertracing/jaeger:2.x.y), "
           f"got {jaeger.get('image')!r}")

    for name, want in PUBLISHED.items():
        got = published_ports(services[name].get("ports"))
        for port in want:
            c.need(got.get(port) == str(port),
                   f"services.{name} must publish {port} (as {port} by default), got {got}")
    for name, port in INTERNAL.items():
        binding = published_bindings(services[name].get("ports")).get(port)
        c.need(binding is None or binding[0] in LOOPBACK,
               f"services.{name} publishes its internal port {port} on all interfaces by default "
               f"({binding}): bind it to 127.0.0.1 (or do not publish it)")

    check_tls(services, raw_services, c)


def check_tls(services: dict, raw_services: dict, c: Checker) -> None:
    """Mutual TLS on the drafter-verifier link, certificates from a read-only mount, and
    healthchecks that speak TLS where the port does."""
    for name in MODEL_SERVICES:
        svc, rsvc, where = services[name], raw_services[name], f"services.{name}"
        mounts = [(v.get("target"), bool(v.get("read_only")), str(rv.get("source"))) if isinstance(v, dict)
                  else (str(v).split(":")[1] if ":" in str(v) else None, "ro" in str(v).split(":")[2:],
                        str(rv).split(":")[0])
                  for v, rv in zip(svc.get("volumes") or [], rsvc.get("volumes") or [])]
        certs = [m for m in mounts if m[0] == CERTS]
        if c.need(certs, f"{where}: no volume mounted at {CERTS} (the TLS certificates and keys)"):
            c.need(certs[0][1], f"{where}: the {CERTS} mount must be read-only")
            c.need("${TLS_DIR" in certs[0][2], f"{where}: {CERTS} must come from ${{TLS_DIR:-...}}")

    def files(argv: list[str], env: dict[str, str], flags: dict[str, str], where: str) -> dict[str, str]:
        """flag -> file, from the command or its environment fallback; each must lie in /certs."""
        got = {}
        for flag, var in flags.items():
            value = flag_value(argv, flag) or env.get(var, "")
            if c.need(value, f"{where}: {flag} (or {var}) is not set: the link must be mutual TLS"):
                c.need(value.startswith(CERTS + "/"), f"{where}: {flag} {value} is not in the {CERTS} mount")
                got[flag] = value
        return got

    verifier, drafter = services["verifier"], services["drafter"]
    vargv, dargv = command_argv(verifier.get("command")), command_argv(drafter.get("command"))
    venv, denv = env_dict(verifier.get("environment")), env_dict(drafter.get("environment"))
    files(vargv, venv, {"--tls-cert": "VERIFIER_TLS_CERT", "--tls-key": "VERIFIER_TLS_KEY",
                        "--tls-client-ca": "VERIFIER_TLS_CLIENT_CA"}, "services.verifier")
    files(dargv, denv, {"--verifier-ca": "DRAFTER_VERIFIER_CA", "--verifier-cert": "DRAFTER_VERIFIER_CERT",
                        "--verifier-key": "DRAFTER_VERIFIER_KEY"}, "services.drafter")

    # A TLS port answers no plaintext probe: the healthcheck must dial TLS (and present a
    # certificate where the port requires one).
    for name, svc, argv, env, prefix in (("verifier", verifier, vargv, venv, "VERIFIER_"),
                                         ("drafter", drafter, dargv, denv, "DRAFTER_")):
        tls = flag_value(argv, "--tls-cert") or env.get(prefix + "TLS_CERT")
        client_ca = flag_value(argv, "--tls-client-ca") or env.get(prefix + "TLS_CLIENT_CA")
        test = (svc.get("healthcheck") or {}).get("test") or []
        targv = command_argv(test) if isinstance(test, str) else [str(x) for x in test]
        if targv and targv[0] == "CMD-SHELL":
            targv = command_argv(" ".join(targv[1:]))
        where = f"services.{name}.healthcheck"
        if tls:
            c.need(flag_value(targv, "--ca"), f"{where}: the port speaks TLS, so the probe needs --ca")
            for flag in ("--ca", "--cert", "--key"):
                value = flag_value(targv, flag)
                c.need(value is None or value.startswith(CERTS + "/"), f"{where}: {flag} {value} is not in {CERTS}")
        if client_ca:
            c.need(flag_value(targv, "--cert") and flag_value(targv, "--key"),
                   f"{where}: the port requires client certificates, so the probe needs --cert and --key")


def duration_s(text: str) -> float:
    unit = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * unit[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)", text))


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Rough .dockerignore match for a top-level COPY source (last matching rule wins)."""
    ignored = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        pat = pat.strip("/")
        if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
            ignored = not neg
    return ignored


def check_dockerfile(path: Path, c: Checker) -> None:
    if not c.need(path.is_file(), f"{path} does not exist"):
        return
    lines, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        if buf + line.strip():
            lines.append((buf + line).strip())
        buf = ""
    args, base, users, workdirs, envs, copies, runs = {}, None, [], [], [], [], []
    for ln in lines:
        instr, _, rest = ln.partition(" ")
        instr = instr.upper()
        if instr == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip().strip('"')
        elif instr == "FROM":
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0])
        elif instr == "USER":
            users.append(rest.strip())
        elif instr == "WORKDIR":
            workdirs.append(rest.strip())
        elif instr == "ENV":
            envs.append(rest)
        elif instr == "COPY":
            copies.append(rest.split())
        elif instr == "RUN":
            runs.append(rest)
    where = path.name
    c.need(base and re.fullmatch(r"pytorch/pytorch:\d+\.\d+(\.\d+)?-cuda[\d.]+-cudnn\d+-runtime", base),
           f"{where}: base must be a pinned pytorch/pytorch CUDA runtime tag, got {base!r}")
    c.need(workdirs and workdirs[-1] == "/app", f"{where}: WORKDIR must be /app")
    c.need(users and users[-1].split(":")[0] not in ("root", "0"), f"{where}: must end on a non-root USER")
    c.need(any(re.search(r"\bPYTHONUNBUFFERED=1\b", e) for e in envs), f"{where}: ENV PYTHONUNBUFFERED=1 missing")
    pip_runs = [r for r in runs if "pip install" in r]
    c.need(pip_runs and all(re.search(r"(-c|--constraint)\s+\S+", r) for r in pip_runs),
           f"{where}: every pip install must keep the base image's torch through a constraint (-c)")
    c.need(any(re.search(r"pip install\b.*\s\.(\s|$)", r) for r in pip_runs),
           f"{where}: the project itself is never pip-installed (`pip install ... .`)")
    ignore_file = path.parent / ".dockerignore"
    patterns = []
    if ignore_file.is_file():
        patterns = [ln.strip() for ln in ignore_file.read_text().splitlines()
                    if ln.strip() and not ln.lstrip().startswith("#")]
    for parts in copies:
        srcs = [p for p in parts[:-1] if not p.startswith("--")]
        for src in srcs:
            rel = src.lstrip("./") or "."
            c.need((path.parent / rel).exists(), f"{where}: COPY source {src} does not exist")
            c.need(rel == "." or not dockerignored(rel, patterns),
                   f"{where}: COPY source {src} is excluded by .dockerignore")
    if patterns:
        for needed in ("pyproject.toml", "README.md"):
            c.need(not dockerignored(needed, patterns), f".dockerignore excludes {needed}, which pip install needs")


def check_schema(doc: dict, schema_path: Path, c: Checker) -> None:
    import json
    try:
        import jsonschema
    except ImportError:
        c.need(False, f"--schema given but jsonschema is not installed for {sys.executable}")
        return
    schema = json.loads(schema_path.read_text())
    # Draft 4, as docker-compose v1 validates this schema (its ids are draft-4 style); all
    # its $refs point inside the file itself.
    validator = jsonschema.Draft4Validator(schema)
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
        c.need(False, f"schema: {where}: {err.message[:300]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compose", default=str(ROOT / "compose.yaml"),
                   help="the compose file to check (default the repository's)")
    p.add_argument("--dockerfile", default=str(ROOT / "Dockerfile"),
                   help="Dockerfile to lint ('' to skip)")
    p.add_argument("--schema", default="", help="compose JSON schema to validate against as well")
    args = p.parse_args(argv)

    try:
        import yaml
    except ImportError:
        print(f"error: PyYAML is not installed for {sys.executable}", file=sys.stderr)
        return 1
    compose_path = Path(args.compose)
    c = Checker()
    try:
        raw = yaml.safe_load(compose_path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        print(f"FAIL {compose_path}: cannot read YAML: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    if not isinstance(raw, dict):
        print(f"FAIL {compose_path}: not a YAML mapping", file=sys.stderr)
        return 1
    check_compose(raw, c, compose_path)
    if args.schema:
        try:
            doc = interpolate(raw, {})
        except InterpolationError:
            doc = None  # already reported
        if doc is not None:
            check_schema(doc, Path(args.schema), c)
    if args.dockerfile:
        check_dockerfile(Path(args.dockerfile), c)

    if c.problems:
        print(f"FAIL {compose_path}: {len(c.problems)} problem(s)", file=sys.stderr)
        for prob in c.problems:
            print(f"  - {prob}", file=sys.stderr)
        return 1
    checked = "compose requirements" + (", compose schema" if args.schema else "") + \
        (", Dockerfile" if args.dockerfile else "")
    print(f"ok {compose_path.name}: {checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
