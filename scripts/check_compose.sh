#!/usr/bin/env bash
# Validates compose.yaml without a Docker engine (CI, or any Debian/Ubuntu machine).
#
#   bash scripts/check_compose.sh [COMPOSE_FILE]     # default: compose.yaml of this repo
#
# 1. `docker-compose config -q` (Compose v1, Debian's docker-compose package 1.29; installed
#    with apt when missing and running as root): YAML syntax, the compose-spec JSON schema,
#    variable interpolation, references between services. Run with an empty environment
#    and no .env file, so it checks the defaults.
# 2. scripts/check_compose.py: what the deployment needs (services, GPU reservations,
#    healthchecks, depends_on service_healthy, VERIFIER_ADDR, MODEL_DIR, tracing, ports),
#    the same schema again through jsonschema, and a lint of the Dockerfile.
# Exits non-zero with the validator's message on the first failing step.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FILE=${1:-$ROOT/compose.yaml}
[ -f "$FILE" ] || { echo "error: compose file $FILE not found" >&2; exit 1; }
FILE=$(cd "$(dirname "$FILE")" && pwd)/$(basename "$FILE")

if ! command -v docker-compose >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "error: docker-compose not found; install Debian's package: apt-get install docker-compose" >&2
    exit 1
  fi
  echo "installing docker-compose (Debian package, without the engine)"
  aptlog=$(mktemp)
  # --no-install-recommends: the validator only, not docker.io/containerd.
  if ! { DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose
       } >"$aptlog" 2>&1; then
    echo "error: apt-get could not install docker-compose:" >&2
    tail -n 20 "$aptlog" >&2
    rm -f "$aptlog"
    exit 1
  fi
  rm -f "$aptlog"
fi
version=$(docker-compose version --short 2>/dev/null || docker-compose --version)

log=$(mktemp)
noenv=$(mktemp)
trap 'rm -f "$log" "$noenv"' EXIT
# env -i: no VERIFIER_ADDR, MODEL_DIR... from the caller; an empty --env-file: no .env file.
if ! env -i PATH="$PATH" HOME="${HOME:-/root}" \
    docker-compose --env-file "$noenv" -f "$FILE" --project-directory "$(dirname "$FILE")" \
    config -q >"$log" 2>&1; then
  echo "FAIL $FILE: docker-compose $version config rejects it:" >&2
  sed 's/^/  /' "$log" >&2
  exit 1
fi
echo "ok $(basename "$FILE"): docker-compose $version config (schema, interpolation, references)"

# A Python with PyYAML: Debian's (python3-yaml and python3-jsonschema come with
# docker-compose), else the project's .venv, else whatever python3 is first on PATH.
PY=
for cand in /usr/bin/python3 "$ROOT/.venv/bin/python" python3; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import yaml" 2>/dev/null; then
    PY=$cand; break
  fi
done
[ -n "$PY" ] || { echo "error: no python3 with PyYAML (apt-get install python3-yaml)" >&2; exit 1; }

schema_args=()
for schema in /usr/lib/python3/dist-packages/compose/config/compose_spec.json; do
  if [ -f "$schema" ] && "$PY" -c "import jsonschema" 2>/dev/null; then
    schema_args=(--schema "$schema")
  fi
done
"$PY" "$ROOT/scripts/check_compose.py" --compose "$FILE" "${schema_args[@]}"
