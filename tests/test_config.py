"""Configuration: precedence of every layer, LMCache keys, and refusals before start."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import shm_segments

from lmcache_ec_broker.config_sources import load_config
from lmcache_ec_broker.sizes import GiB, MiB


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("LMCACHE_EC_") or var == "LMCACHE_CONFIG_FILE":
            monkeypatch.delenv(var)


def write_yaml(tmp_path: Path, text: str, name: str = "lmcache.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


LMCACHE_YAML = """\
chunk_size: 256
local_cpu: true
max_local_cpu_size: 2
local_disk: "file:///var/lmcache/ec"
max_local_disk_size: 16
"""


# ---------------------------------------------------------------- precedence


def test_defaults_when_nothing_is_set():
    cfg, sources = load_config({})
    assert cfg.shm_size == 2 * GiB and cfg.local_disk is None and cfg.max_local_disk_size == 0
    assert set(sources.values()) == {"default"}


def test_plain_yaml_overrides_defaults_and_lmcache_keys_map(tmp_path):
    path = write_yaml(tmp_path, LMCACHE_YAML)
    cfg, sources = load_config({}, path)
    assert cfg.shm_size == 2 * GiB  # max_local_cpu_size, GiB
    assert cfg.local_disk == "/var/lmcache/ec"  # file:// URL -> path
    assert cfg.max_local_disk_size == 16 * GiB
    assert sources["shm_size"] == f"yaml {path}: max_local_cpu_size"
    assert sources["local_disk"] == f"yaml {path}: local_disk"
    assert sources["block_size"] == "default"


def test_ec_prefixed_yaml_overrides_plain_yaml(tmp_path):
    path = write_yaml(tmp_path, LMCACHE_YAML + "ec_max_local_disk_size: 64\nec_shm_size: 512MiB\n")
    cfg, sources = load_config({}, path)
    assert cfg.max_local_disk_size == 64 * GiB
    assert cfg.shm_size == 512 * MiB
    assert sources["max_local_disk_size"] == f"yaml {path}: ec_max_local_disk_size"


def test_env_overrides_ec_prefixed_yaml(tmp_path, monkeypatch):
    path = write_yaml(tmp_path, LMCACHE_YAML + "ec_max_local_disk_size: 64\n")
    monkeypatch.setenv("LMCACHE_EC_MAX_LOCAL_DISK_SIZE", "128")
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", str(tmp_path / "d"))
    cfg, sources = load_config({}, path)
    assert cfg.max_local_disk_size == 128 * GiB
    assert cfg.local_disk == str(tmp_path / "d")
    assert sources["max_local_disk_size"] == "env LMCACHE_EC_MAX_LOCAL_DISK_SIZE"


def test_cli_overrides_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_SHM_SIZE", "1GiB")
    monkeypatch.setenv("LMCACHE_EC_BROKER_SOCKET", str(tmp_path / "env.sock"))
    cfg, sources = load_config({"shm_size": 64 * MiB, "socket_path": str(tmp_path / "cli.sock")})
    assert cfg.shm_size == 64 * MiB and sources["shm_size"] == "cli"
    assert cfg.socket_path == str(tmp_path / "cli.sock") and sources["socket_path"] == "cli"


def test_socket_env_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_BROKER_SOCKET", str(tmp_path / "a.sock"))
    cfg, sources = load_config({})
    assert cfg.socket_path == str(tmp_path / "a.sock")
    assert sources["socket_path"] == "env LMCACHE_EC_BROKER_SOCKET"
    monkeypatch.setenv("LMCACHE_EC_SOCKET_PATH", str(tmp_path / "b.sock"))
    cfg, sources = load_config({})
    assert cfg.socket_path == str(tmp_path / "b.sock")


def test_config_file_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", write_yaml(tmp_path, "ec_max_key_length: 1234\n"))
    cfg, sources = load_config({})
    assert cfg.max_key_length == 1234
    explicit = write_yaml(tmp_path, "ec_max_key_length: 99\n", "other.yaml")
    cfg, _ = load_config({}, explicit)  # --config wins over LMCACHE_CONFIG_FILE
    assert cfg.max_key_length == 99


def test_env_empty_local_disk_turns_the_disk_tier_off(tmp_path, monkeypatch):
    path = write_yaml(tmp_path, LMCACHE_YAML)
    monkeypatch.setenv("LMCACHE_EC_LOCAL_DISK", "")
    cfg, sources = load_config({}, path)
    assert cfg.local_disk is None and sources["local_disk"] == "env LMCACHE_EC_LOCAL_DISK"


# ---------------------------------------------------------------- values


def test_sizes_accept_units_and_fractions(tmp_path, monkeypatch):
    path = write_yaml(
        tmp_path, "max_local_cpu_size: 0.5\nblock_size: 128KiB\nmax_entry_size: 65536\n"
    )
    monkeypatch.setenv("LMCACHE_EC_MAX_FRAME_BYTES", "2MiB")
    cfg, _ = load_config({}, path)
    assert cfg.shm_size == GiB // 2
    assert cfg.block_size == 128 * 1024
    assert cfg.max_entry_size == 65536  # plain numbers are bytes except for capacities
    assert cfg.max_frame_bytes == 2 * MiB


def test_other_types_from_text(tmp_path, monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_SOCKET_MODE", "0666")
    monkeypatch.setenv("LMCACHE_EC_ALLOWED_UIDS", "1000, 1001")
    monkeypatch.setenv("LMCACHE_EC_MAX_KEY_LENGTH", "16384")
    cfg, _ = load_config({})
    assert cfg.socket_mode == 0o666 and cfg.allowed_uids == [1000, 1001]
    assert cfg.max_key_length == 16384


def test_relative_local_disk_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_config({"local_disk": "cache/ec", "max_local_disk_size": GiB})
    assert cfg.local_disk == str(tmp_path / "cache" / "ec")


def test_lmcache_keys_get_one_info_line_and_change_nothing(tmp_path, monkeypatch, caplog):
    # LMCache's own keys (its LMCacheEngineConfig) and its LMCACHE_EC_<key> overrides:
    # accepted, named once, no warning. remote_url is not among them: it is ours too.
    path = write_yaml(
        tmp_path,
        LMCACHE_YAML
        + "remote_serde: naive\nec_use_layerwise: true\nec:\n  save_unfull_chunk: true\n",
    )
    monkeypatch.setenv("LMCACHE_EC_CHUNK_SIZE", "512")
    with caplog.at_level(logging.INFO, logger="lmcache_ec_broker.config"):
        cfg, _ = load_config({}, path)
    assert cfg.shm_size == 2 * GiB and cfg.max_local_disk_size == 16 * GiB
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    (line,) = [r.getMessage() for r in caplog.records]
    for name in (
        "chunk_size", "local_cpu", "remote_serde", "ec_use_layerwise", "ec.save_unfull_chunk",
        "LMCACHE_EC_CHUNK_SIZE",
    ):  # fmt: skip
        assert name in line, line
    assert "max_local_cpu_size" not in line and "local_disk" not in line  # those are used


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("local_disc: /tmp/x\nmax_local_disk_size: 1\n", "local_disc (did you mean local_disk?)"),
        ("ec_shm_sise: 1\n", "ec_shm_sise (did you mean ec_shm_size?)"),
        ("ec:\n  shm_sise: 1\n", "ec.shm_sise (did you mean ec.shm_size?)"),
        ("remote_serd: naive\n", "remote_serd (did you mean remote_serde?)"),
        ("colour: blue\n", "unknown key colour;"),
    ],
)
def test_unknown_yaml_keys_refuse_the_start_with_a_suggestion(tmp_path, yaml_text, expected):
    path = write_yaml(tmp_path, yaml_text)
    with pytest.raises(ValueError, match="unknown key") as exc:
        load_config({}, path)
    assert expected in str(exc.value) and path in str(exc.value), exc.value


@pytest.mark.parametrize(
    ("var", "expected"),
    [
        ("LMCACHE_EC_SHM_SIZEE", "LMCACHE_EC_SHM_SIZEE (did you mean LMCACHE_EC_SHM_SIZE?)"),
        ("LMCACHE_EC_LOCAL_DISC", "LMCACHE_EC_LOCAL_DISC (did you mean LMCACHE_EC_LOCAL_DISK?)"),
        ("LMCACHE_EC_BROKER_SOCKETT", "did you mean LMCACHE_EC_BROKER_SOCKET?"),
        ("LMCACHE_EC_COLOUR", "environment variable LMCACHE_EC_COLOUR: not a broker setting"),
    ],
)
def test_unknown_environment_variables_refuse_the_start(monkeypatch, var, expected):
    monkeypatch.setenv(var, "4GiB")
    with pytest.raises(ValueError, match="not a broker setting") as exc:
        load_config({})
    assert expected in str(exc.value), exc.value


def test_the_projects_other_variables_are_not_settings_and_not_refused(monkeypatch):
    # Read by clients, the remote tier and the test harness: never typos.
    for var in (
        "LMCACHE_EC_BROKER_SOCKET", "LMCACHE_EC_BROKER_UID", "LMCACHE_EC_REMOTE_PASSWORD",
        "LMCACHE_EC_TEST_MODELS", "LMCACHE_EC_KEEP_E2E_LOGS", "LMCACHE_EC_VLLM_LOCK",
    ):  # fmt: skip
        monkeypatch.setenv(var, "/tmp/x")
    load_config({})


def test_every_lmcache_ec_variable_the_repository_names_is_known():
    # A new variable read anywhere in the project must be a setting or in OTHER_ENV,
    # or a broker started with it in its environment would refuse to start.
    import re

    from lmcache_ec_broker.config import BrokerConfig
    from lmcache_ec_broker.config_lmcache import LMCACHE_KEYS
    from lmcache_ec_broker.config_sources import (
        _ALIASES,
        _RETIRED,
        OTHER_ENV,
        OTHER_ENV_PREFIXES,
    )

    root = Path(__file__).resolve().parent.parent
    skip = {Path(__file__).resolve(), root / "lmcache_ec_broker" / "config_sources.py"}  # typos on purpose
    named: set[str] = set()
    for path in root.rglob("*"):
        if ".venv" in path.parts or path in skip or not path.is_file():
            continue
        if path.suffix in (".py", ".md", ".sh", ".yaml", ".yml", ".service"):
            text = path.read_text(errors="replace")
            named |= set(re.findall(r"LMCACHE_EC_[A-Z0-9_]*[A-Z0-9]", text))
    names = {f.name for f in msgspec.structs.fields(BrokerConfig)}
    names |= set(_ALIASES) | set(_RETIRED) | LMCACHE_KEYS
    ours = {"LMCACHE_EC_" + n.upper() for n in names}
    docs_typo = {"LMCACHE_EC_SHM_SIZEE"}  # the misspelling docs/disk-and-config.md shows
    stray = {
        v
        for v in named - ours - OTHER_ENV - docs_typo
        if not (v + "_").startswith(OTHER_ENV_PREFIXES)  # LMCACHE_EC_TEST_* in the docs too
    }
    assert stray == set(), f"name them in config_sources.OTHER_ENV or make them settings: {sorted(stray)}"


def test_retired_keys_warn_what_to_do_and_change_nothing(tmp_path, monkeypatch, caplog):
    # lease_ms and prefault were accepted by earlier releases but never read.
    path = write_yaml(tmp_path, "lease_ms: 5000\nec_prefault: false\nshm_size: 1\n")
    monkeypatch.setenv("LMCACHE_EC_LEASE_MS", "500")
    with caplog.at_level(logging.WARNING, logger="lmcache_ec_broker.config"):
        cfg, sources = load_config({}, path)
    assert cfg.shm_size == GiB
    assert "lease_ms" not in sources and "prefault" not in sources
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3, warnings
    lease = [w for w in warnings if "lease_ms is no longer a broker setting" in w]
    assert len(lease) == 2 and all("ec_connector_extra_config" in w for w in lease)
    assert any("LMCACHE_EC_LEASE_MS" in w for w in lease)
    assert any("ec_prefault" in w and "prefault is no longer" in w for w in warnings)
    assert not any("unknown" in w for w in warnings)


@pytest.mark.parametrize(
    ("yaml_text", "env", "expected"),
    [
        ("max_local_disk_size: -1\n", {}, "must not be negative"),
        ("", {"LMCACHE_EC_SHM_SIZE": "-2GiB"}, "LMCACHE_EC_SHM_SIZE"),
        ("", {"LMCACHE_EC_SHM_SIZE": "lots"}, "cannot parse size"),
        ('local_disk: "s3://bucket/ec"\nmax_local_disk_size: 1\n', {}, "unsupported URL scheme"),
        ('local_disk: "file://otherhost/x"\nmax_local_disk_size: 1\n', {}, "only local"),
        ('local_disk: "/tmp/x"\n', {}, "max_local_disk_size is 0"),
        ("", {"LMCACHE_EC_MAX_CONNECTIONS": "many"}, "max_connections"),
        ("", {"LMCACHE_EC_METRICS_PORT": "99999"}, "metrics_port"),
        ("shm_size: 1\nmax_local_cpu_size: 2\n", {}, "sets shm_size twice"),
        ("- a\n- b\n", {}, "must be a mapping"),
        ("a: [\n", {}, "not valid YAML"),
    ],
)
def test_invalid_values_are_refused_with_their_source(
    tmp_path, monkeypatch, yaml_text, env, expected
):
    path = write_yaml(tmp_path, yaml_text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=expected):
        load_config({}, path)


def test_unusable_local_disk_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        load_config({"local_disk": str(blocker), "max_local_disk_size": GiB})
    with pytest.raises(ValueError, match="cannot be created"):
        load_config({"local_disk": str(blocker / "sub"), "max_local_disk_size": GiB})


def test_missing_config_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read config file"):
        load_config({}, str(tmp_path / "nope.yaml"))


# ---------------------------------------------------------------- through the CLI


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    return subprocess.run(
        [sys.executable, "-m", "lmcache_ec_broker.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def test_print_config_shows_each_layer(tmp_path):
    path = write_yaml(tmp_path, LMCACHE_YAML + "ec_max_local_disk_size: 64\nremote_serde: naive\n")
    sock = str(tmp_path / "b.sock")
    r = _cli(
        "start", "--print-config", "--socket", sock, "--config", path,
        env={"LMCACHE_EC_MAX_CONNECTIONS": "500", "LMCACHE_EC_LOCAL_DISK": str(tmp_path / "disk")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert lines["socket_path"].endswith("(cli)")
    assert "(env LMCACHE_EC_MAX_CONNECTIONS)" in lines["max_connections"]
    assert "lease_ms" not in lines and "prefault" not in lines
    assert "64.00 GiB" in lines["max_local_disk_size"]
    assert "ec_max_local_disk_size" in lines["max_local_disk_size"]
    assert f"(yaml {path}: max_local_cpu_size)" in lines["shm_size"]
    assert "(default)" in lines["block_size"]
    assert "remote_serde" in r.stderr and "chunk_size" in r.stderr  # the LMCache-only keys
    assert not os.path.exists(sock) and not (tmp_path / "disk").exists()


def test_invalid_configuration_refused_before_anything_is_created(tmp_path):
    sock = str(tmp_path / "b.sock")
    disk = tmp_path / "disk"
    path = write_yaml(tmp_path, f'local_disk: "{disk}"\nmax_local_disk_size: -4\n')
    r = _cli("start", "--socket", sock, "--config", path)
    assert r.returncode == 2
    assert "max_local_disk_size" in r.stderr and "must not be negative" in r.stderr
    assert not os.path.exists(sock) and not disk.exists() and not shm_segments(sock)


# ---------------------------------------------------------------- operator mistakes


def test_misspelt_keys_get_a_suggestion_not_the_whole_list(tmp_path):
    path = write_yaml(tmp_path, "max_local_cpu_sise: 2\nec_remote_ur: redis://h:1\ncolour: 1\n")
    with pytest.raises(ValueError) as exc:
        load_config({}, path)
    message = str(exc.value)
    assert "max_local_cpu_sise (did you mean max_local_cpu_size?)" in message
    assert "ec_remote_ur (did you mean ec_remote_url?)" in message
    assert "colour" in message and "colour (did you mean" not in message
    assert "mooncake_admin_port" not in message  # not every known key


def test_a_misspelt_key_stops_the_start_before_anything_exists(tmp_path):
    # Before: a warning before logging started, and a broker without its disk tier.
    sock = str(tmp_path / "b.sock")
    disk = tmp_path / "disk"
    path = write_yaml(tmp_path, f'local_disc: "{disk}"\nmax_local_disk_size: 1\n')
    r = _cli("start", "--socket", sock, "--shm-size", "16MiB", "--config", path)
    assert r.returncode == 2, r.stderr
    assert "local_disc (did you mean local_disk?)" in r.stderr
    assert not os.path.exists(sock) and not disk.exists() and not shm_segments(sock)
    r = _cli("start", "--socket", sock, "--shm-size", "16MiB", env={"LMCACHE_EC_SHM_SIZEE": "1"})
    assert r.returncode == 2 and "did you mean LMCACHE_EC_SHM_SIZE?" in r.stderr, r.stderr
    assert not os.path.exists(sock)


def test_the_lmcache_info_line_reaches_the_brokers_log(make_broker, tmp_path):
    # Said while the configuration loads, before logging is set up: kept, then logged.
    path = write_yaml(tmp_path, "chunk_size: 256\nremote_serde: naive\n")
    b = make_broker("--shm-size", "16MiB", "--config", path)
    lines = [line for line in b.read_log().splitlines() if "remote_serde" in line]
    assert len(lines) == 1 and " INFO lmcache_ec_broker.config: " in lines[0], lines
    assert "chunk_size" in lines[0]


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://user:Qx7w/Zk9v@h:6379/0", "Qx7w/Zk9v"),
        ("redis://:Qx7w/Zk9v:Jm2p@Rt5y@h:6379", "Qx7w/Zk9v:Jm2p@Rt5y"),
        ("rediss://u:Qx7w:Zk9v@Jm2p@h:1,h2:2", "Qx7w:Zk9v@Jm2p"),
        ("unix://:Qx7w/Zk9v@/run/redis.sock?db=1", "Qx7w/Zk9v"),
    ],
)
def test_passwords_with_slash_at_colon_are_never_printed(tmp_path, monkeypatch, url, secret):
    from lmcache_ec_broker.remote_url import mask_url

    assert secret not in mask_url(url) and "***" in mask_url(url)
    monkeypatch.setenv("LMCACHE_EC_REMOTE_URL", url)
    monkeypatch.setenv("LMCACHE_EC_REMOTE_TIMEOUT_S", "-1")  # any error that quotes the URL
    with pytest.raises(ValueError) as info:
        load_config({})
    for fragment in {secret, *secret.replace("@", "/").replace(":", "/").split("/")}:
        assert fragment not in str(info.value).replace("***", ""), (fragment, str(info.value))
    r = _cli("start", "--print-config", env={"LMCACHE_EC_REMOTE_URL": url})
    assert secret not in r.stdout + r.stderr
    mooncake = {
        "LMCACHE_EC_REMOTE_URL": "mooncakestore://127.0.0.1:50051",
        "LMCACHE_EC_MOONCAKE_METADATA_SERVER": url.replace("redis", "http", 1),
    }
    r = _cli("start", "--print-config", env=mooncake)
    assert r.returncode == 0 and secret not in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_slash_in_a_url_password_is_refused_without_echoing_it(monkeypatch):
    monkeypatch.setenv("LMCACHE_EC_REMOTE_URL", "redis://:hunter/2@h:6379/0")
    with pytest.raises(ValueError, match="percent-encode") as info:
        load_config({})
    assert "hunter" not in str(info.value)


@pytest.mark.parametrize(
    ("cli", "expected"),
    [
        ({"allowed_uids": [1000]}, "allowed_uids 1000 cannot connect: socket_mode 0600"),
        ({"allowed_uids": [1000], "socket_mode": 0o660}, "allowed_uids 1000 cannot connect"),
        ({"socket_group": "users"}, "socket_group 'users' cannot use the broker"),
        ({"socket_group": "users", "socket_mode": 0o606}, "socket_mode 0606"),
    ],
)
def test_principals_the_socket_mode_cannot_admit_are_refused(cli, expected):
    with pytest.raises(ValueError, match=expected):
        load_config(cli)


def test_principals_the_socket_mode_admits_are_accepted():
    load_config({"allowed_uids": [1000], "socket_mode": 0o666})
    load_config({"socket_group": "users", "socket_mode": 0o660})
    load_config({"allowed_uids": [1000], "socket_group": "users", "socket_mode": 0o660})


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("remote_url: mooncakestore://127.0.0.1:50051\nremote_ttl_s: 60\n", "remote_ttl_s is set"),
        (
            "remote_url: mooncakestore://127.0.0.1:50051\nremote_password_file: /etc/hostname\n",
            "remote_password_file is set but the Mooncake backend",
        ),
        (
            "remote_url: mooncakestore://127.0.0.1:50051\nremote_tls_ca_file: /etc/hostname\n",
            "remote_tls_ca_file is set",
        ),
        ("remote_url: redis://h:1\nremote_tls_ca_file: /etc/hostname\n", "without TLS"),
        ("remote_url: redis://h:1\nmooncake_protocol: rdma\n", "mooncake_protocol is set"),
        (
            "remote_url: valkey://h:1\nmooncake_admin_port: 1\nmooncake_key_poll_s: 1\n",
            "mooncake_admin_port, mooncake_key_poll_s are set but the Redis/Valkey backend",
        ),
    ],
)
def test_settings_the_backend_ignores_are_refused(tmp_path, yaml_text, expected):
    with pytest.raises(ValueError, match=expected) as info:
        load_config({}, write_yaml(tmp_path, yaml_text))
    assert len(str(info.value).splitlines()) == 1


def test_settings_the_backend_uses_are_accepted(tmp_path):
    load_config(
        {}, write_yaml(tmp_path, "remote_url: rediss://h:1\nremote_tls_ca_file: /etc/hostname\n")
    )
    load_config(
        {}, write_yaml(tmp_path, "remote_url: mooncakestore://h:1\nmooncake_key_poll_s: 1\n")
    )
    # The tier off: its settings are left alone (unsetting remote_url turns it off).
    load_config({}, write_yaml(tmp_path, "remote_ttl_s: 60\nmooncake_protocol: tcp\n"))


def test_limit_keys_are_validated_and_every_one_is_documented(monkeypatch):
    # Issue 40, deliverable 7: the per-process and per-uid limits and the reservation
    # TTL are typed settings, checked at start, each listed in docs/disk-and-config.md.
    monkeypatch.setenv("LMCACHE_EC_MAX_HELD_BYTES_PER_PROCESS", "256MiB")
    monkeypatch.setenv("LMCACHE_EC_RESERVATION_TTL_S", "120")
    cfg, _ = load_config({})
    assert cfg.max_held_bytes_per_process == 256 * MiB and cfg.reservation_ttl_s == 120
    from lmcache_ec_broker.config import BrokerConfig

    for bad, name in (
        ({"max_connections_per_process": 0}, "max_connections_per_process"),
        ({"max_reservations_per_uid": -1}, "max_reservations_per_uid"),
        ({"max_held_bytes_per_uid": 3 * GiB}, "max_held_bytes_per_uid"),
        ({"reservation_ttl_s": 0.0}, "reservation_ttl_s"),
    ):
        with pytest.raises(ValueError, match=name):
            BrokerConfig(**bad).validate()
    doc = (Path(__file__).parent.parent / "docs" / "disk-and-config.md").read_text()
    limits = [
        f.name
        for f in msgspec.structs.fields(BrokerConfig)
        if f.name.startswith(("max_connections", "max_pins", "max_leases", "max_reserv", "max_held"))
        or f.name == "reservation_ttl_s"
    ]
    assert len(limits) == 15, limits
    assert [n for n in limits if f"`{n}`" not in doc] == []
