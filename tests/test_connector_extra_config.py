"""ec_connector_extra_config: a misspelt key refuses the connector (before: ignored,
so ``socket_pth`` silently fell back to the default socket), LMCache's own keys are
accepted with one info line. The module alone, then vLLM's real VllmConfig and
ECConnectorBase constructing the real connector."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from lmcache_ec_broker.connector.vllm.extra_config import KEYS, RETIRED, check_extra_config

LOG = logging.getLogger("test.extra_config")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"socket_pth": "/x"}, "socket_pth (did you mean socket_path?)"),
        ({"lease_msec": 5}, "lease_msec (did you mean lease_ms?)"),
        ({"lmcache.chunk_sise": 256}, "lmcache.chunk_sise (did you mean lmcache.chunk_size?)"),
        ({"remote_serd": "naive"}, "remote_serd (did you mean remote_serde?)"),
        ({"colour": 1, "socket_path": "/x"}, "unknown key colour;"),
    ],
)
def test_unknown_keys_are_refused_with_the_closest_name(extra, expected) -> None:
    with pytest.raises(ValueError, match="ec_connector_extra_config: unknown key") as exc:
        check_extra_config(extra, LOG)
    assert expected in str(exc.value) and "socket_path" in str(exc.value), exc.value


def test_lmcache_keys_are_accepted_with_one_info_line(caplog) -> None:
    extra = {
        "socket_path": "/x",
        "lease_ms": 5,
        "chunk_size": 256,
        "lmcache.remote_serde": "naive",
        "lmcache.local_cpu": True,
    }
    with caplog.at_level(logging.INFO, logger=LOG.name):
        check_extra_config(extra, LOG)
        check_extra_config({"socket_path": "/x", "model_name": "m"}, LOG)  # nothing to say
        check_extra_config(extra, None)  # a worker: says nothing
    (line,) = [r.getMessage() for r in caplog.records]
    assert "chunk_size, lmcache.local_cpu, lmcache.remote_serde" in line, line
    assert "socket_path" not in line and "lease_ms" not in line


def test_the_keys_are_exactly_those_the_connector_reads() -> None:
    src = Path(__file__).resolve().parent.parent / "lmcache_ec_broker" / "connector" / "vllm" / "connector.py"
    read = set(re.findall(r'\bextra\(\s*"([a-z_]+)"', src.read_text()))
    assert read == set(KEYS) | RETIRED


# ---------------------------------------------------------------- the real connector

vllm_config = pytest.importorskip("vllm.config")


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory):
    from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    path = build_tiny_qwen2vl(root)
    return vllm_config.ModelConfig(model=str(path), dtype="bfloat16", max_model_len=512)


def _connector(model_config, role_name: str, extra: dict):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from lmcache_ec_broker.connector.vllm import ECBrokerConnector

    cfg = vllm_config.VllmConfig(
        model_config=model_config,
        ec_transfer_config=vllm_config.ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role="ec_both",
            ec_connector_module_path="lmcache_ec_broker.connector.vllm",
            ec_connector_extra_config=extra,
        ),
    )
    return ECBrokerConnector(cfg, getattr(ECConnectorRole, role_name))


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_a_misspelt_socket_path(model_config, role, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"socket_pth \(did you mean socket_path\?\)"):
        _connector(model_config, role, {"socket_pth": str(tmp_path / "b.sock")})


def test_the_connector_accepts_lmcache_keys_and_names_them_once(
    model_config, tmp_path, caplog
) -> None:
    sock = str(tmp_path / "b.sock")
    extra = {"socket_path": sock, "lmcache.chunk_size": 256, "remote_serde": "naive"}
    with caplog.at_level(logging.INFO):
        for role in ("SCHEDULER", "WORKER"):
            assert _connector(model_config, role, extra)._socket_path == sock
    lines = [r.getMessage() for r in caplog.records if "lmcache.chunk_size" in r.getMessage()]
    assert len(lines) == 1 and "remote_serde" in lines[0], lines
