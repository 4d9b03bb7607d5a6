#!/usr/bin/env bash
# The pip arguments that install the CPU build of torch, one a line: where torch comes
# from, then the pinned requirement. .ci/setup.sh passes them to every pip install, so pip
# never pulls the multi-GB CUDA build. Which source it chose goes to stderr.
#   TORCH_WHEELS     a local wheel directory (default /opt/wheels): --find-links it when it
#                    holds a wheel of the pinned version;
#   TORCH_INDEX_URL  otherwise this PEP 503 index, --extra-index-url (default the PyTorch
#                    CPU wheel index, https://download.pytorch.org/whl/cpu; a mirror of it
#                    works too; tests/test_ci_setup.py points it at a local one).
set -euo pipefail
TORCH_VERSION="2.13.0+cpu"
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
# The pinned version's wheel, not any CPU torch: a directory holding only another one would
# win over the index, and pip, finding the pin neither there nor on PyPI, would fail.
if compgen -G "$TORCH_WHEELS/torch-$TORCH_VERSION-*.whl" >/dev/null; then
  printf '%s\n' --find-links "$TORCH_WHEELS"
  echo "setup: CPU torch from $TORCH_WHEELS" >&2
else
  printf '%s\n' --extra-index-url "$TORCH_INDEX_URL"
  echo "setup: no torch $TORCH_VERSION wheel in $TORCH_WHEELS; CPU torch from $TORCH_INDEX_URL" >&2
fi
printf '%s\n' "torch==$TORCH_VERSION"
