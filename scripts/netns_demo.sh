#!/usr/bin/env bash
# Both services on two "hosts" for real: network namespaces joined by veth pairs, mutual TLS on
# both hops, one generation on the shipped pair on CPU, then everything torn down.
#
#   sudo bash scripts/netns_demo.sh            # needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN)
#
#   root namespace (client) --veth 10.213.2.0/30-- drafter namespace --veth 10.213.1.0/30-- verifier namespace
#
# The verifier listens on 10.213.1.1 only, which the root namespace has no route to: only the
# drafter reaches it, with a client certificate. The client in the root namespace reaches the
# drafter at 10.213.2.2, with a client certificate too. The certificates come from a throwaway CA
# made here with the openssl CLI. A trap kills the two servers and deletes the namespaces (and the
# veth pairs with them) however the script ends: success, failure or Ctrl-C.
#
# Where network namespaces cannot be created (no privilege), it prints one line saying it is
# skipped and exits 0. Settings (environment): NETNS_DEMO_NET (first two octets, default 10.213),
# MODEL_DIR (default models/default), PYTHON (default .venv/bin/python, else python3),
# NETNS_DEMO_WAIT_S (start-up wait per service, default 120), NETNS_DEMO_TOKENS (default 32).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
NET=${NETNS_DEMO_NET:-10.213}
MODEL_DIR=${MODEL_DIR:-$ROOT/models/default}
WAIT_S=${NETNS_DEMO_WAIT_S:-120}
TOKENS=${NETNS_DEMO_TOKENS:-32}
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
# gRPC honours proxy variables; these addresses are local to this machine.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY grpc_proxy all_proxy ALL_PROXY || true

TAG=ddt$(( $$ % 100000 ))           # short: interface names are at most 15 characters
NS_VERIFIER=$TAG-verifier NS_DRAFTER=$TAG-drafter
VERIFIER_IP=$NET.1.1 DRAFTER_LINK_IP=$NET.1.2 ROOT_IP=$NET.2.1 DRAFTER_IP=$NET.2.2
say() { echo "netns demo: $*"; }

if ! command -v ip >/dev/null 2>&1; then
  say "skipped: the ip command (iproute2) is not installed"; exit 0
fi
if ! ip netns add "$NS_VERIFIER" 2>/dev/null; then
  say "skipped: cannot create network namespaces here (needs root or CAP_NET_ADMIN)"; exit 0
fi

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for ns in "$NS_VERIFIER" "$NS_DRAFTER"; do
    if ip netns list | grep -qw "$ns"; then
      # Anything still running in our namespaces was started by this script.
      for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  ip link del "${TAG}r" 2>/dev/null || true  # gone with its peer already; in case the namespace was not
  rm -rf "$WORK"
  say "cleaned up (namespaces $NS_VERIFIER and $NS_DRAFTER deleted, servers stopped)"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

command -v openssl >/dev/null 2>&1 || { echo "error: the openssl command is needed for the certificates" >&2; exit 1; }
[ -f "$MODEL_DIR/target/config.json" ] && [ -f "$MODEL_DIR/draft/config.json" ] || {
  echo "error: $MODEL_DIR has no target/ and draft/ checkpoints" >&2; exit 1; }

# -- network: verifier <-> drafter, drafter <-> root ------------------------------------------
ip netns add "$NS_DRAFTER"
ip link add "${TAG}v" type veth peer name "${TAG}dv"       # verifier side / drafter side
ip link set "${TAG}v" netns "$NS_VERIFIER"
ip link set "${TAG}dv" netns "$NS_DRAFTER"
ip link add "${TAG}r" type veth peer name "${TAG}dr"       # root side / drafter side
ip link set "${TAG}dr" netns "$NS_DRAFTER"
ip -n "$NS_VERIFIER" addr add "$VERIFIER_IP/30" dev "${TAG}v"
ip -n "$NS_DRAFTER" addr add "$DRAFTER_LINK_IP/30" dev "${TAG}dv"
ip -n "$NS_DRAFTER" addr add "$DRAFTER_IP/30" dev "${TAG}dr"
ip addr add "$ROOT_IP/30" dev "${TAG}r"
for ns in "$NS_VERIFIER" "$NS_DRAFTER"; do ip -n "$ns" link set lo up; done
ip -n "$NS_VERIFIER" link set "${TAG}v" up
ip -n "$NS_DRAFTER" link set "${TAG}dv" up
ip -n "$NS_DRAFTER" link set "${TAG}dr" up
ip link set "${TAG}r" up
say "verifier at $VERIFIER_IP ($NS_VERIFIER), drafter at $DRAFTER_LINK_IP / $DRAFTER_IP ($NS_DRAFTER), client at $ROOT_IP"

# -- a throwaway CA and three certificates ---------------------------------------------------
PKI=$WORK/pki
mkdir -p "$PKI"
issue() {  # name, extendedKeyUsage, subjectAltName (or "")
  local name=$1 usage=$2 san=$3
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$name" \
    -keyout "$PKI/$name.key" -out "$PKI/$name.csr" 2>/dev/null
  { echo "basicConstraints=critical,CA:FALSE"; echo "extendedKeyUsage=$usage"
    [ -n "$san" ] && echo "subjectAltName=$san"; } > "$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 1 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 -sha256 \
  -subj "/CN=ddtree demo CA" -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" -keyout "$PKI/ca.key" -out "$PKI/ca.crt" 2>/dev/null
issue verifier serverAuth "DNS:verifier,IP:$VERIFIER_IP"
issue drafter serverAuth,clientAuth "DNS:drafter,IP:$DRAFTER_IP"   # serves clients, and is the verifier's client
issue client clientAuth ""
say "certificates made (CA, verifier, drafter, client)"

# -- the two servers ---------------------------------------------------------------------------
wait_for() {  # log file, line to wait for, pid
  local log=$1 line=$2 pid=$3 deadline=$((SECONDS + WAIT_S))
  until grep -q "$line" "$log" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "error: it exited:" >&2; tail -n 20 "$log" >&2; return 1; fi
    if [ "$SECONDS" -ge "$deadline" ]; then echo "error: not up within $WAIT_S s:" >&2; tail -n 20 "$log" >&2; return 1; fi
    sleep 0.5
  done
}

ip netns exec "$NS_VERIFIER" "$PYTHON" -m verifier_svc --target "$MODEL_DIR/target" --draft "$MODEL_DIR/draft" \
  --host "$VERIFIER_IP" --port 50051 --device cpu --max-sessions 2 --max-seq-len 512 \
  --tls-cert "$PKI/verifier.crt" --tls-key "$PKI/verifier.key" --tls-client-ca "$PKI/ca.crt" \
  > "$WORK/verifier.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/verifier.log" "verifier listening" "${PIDS[-1]}"
say "verifier up (mutual TLS)"

ip netns exec "$NS_DRAFTER" "$PYTHON" -m drafter_svc --target "$MODEL_DIR/target" --draft "$MODEL_DIR/draft" \
  --verifier "$VERIFIER_IP:50051" --verifier-ca "$PKI/ca.crt" \
  --verifier-cert "$PKI/drafter.crt" --verifier-key "$PKI/drafter.key" --verifier-wait "$WAIT_S" \
  --host "$DRAFTER_IP" --port 50050 --device cpu \
  --tls-cert "$PKI/drafter.crt" --tls-key "$PKI/drafter.key" --tls-client-ca "$PKI/ca.crt" \
  > "$WORK/drafter.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/drafter.log" "drafter listening" "${PIDS[-1]}"
say "drafter up (mutual TLS to its clients and to the verifier)"

# The root namespace has no route to the verifier's network: only the drafter reaches it.
if timeout 2 bash -c "exec 3<>/dev/tcp/$VERIFIER_IP/50051" 2>/dev/null; then
  echo "error: the verifier is reachable from the root namespace" >&2; exit 1
fi
say "verifier unreachable from the root namespace, as it should be"

# -- one generation from the root namespace ----------------------------------------------------
say "generating from the root namespace:"
"$PYTHON" -m drafter_svc.client --server "$DRAFTER_IP:50050" --ca "$PKI/ca.crt" \
  --cert "$PKI/client.crt" --key "$PKI/client.key" --max-new-tokens "$TOKENS" --timeout 120 "def fibonacci(n):"
say "ok"
