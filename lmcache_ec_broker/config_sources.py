"""Where the configuration comes from: CLI flags, ``LMCACHE_EC_*`` environment and a
YAML file (LMCache's names accepted), layered into one ``BrokerConfig``. Unknown
keys are refused with a did-you-mean; LMCache keys this broker does not use get one
info line; retired keys a warning."""

from __future__ import annotations

import logging
import os
import urllib.parse

import msgspec

from .config import BrokerConfig
from .config_lmcache import LMCACHE_KEYS, closest, did_you_mean
from .private_dirs import SOCKET_ENV
from .sizes import GiB, parse_size

ENV_PREFIX = "LMCACHE_EC_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
# LMCache keys that name one of our fields differently.
_ALIASES = {"max_local_cpu_size": "shm_size"}
# Environment variables of this project that are not settings: read by the clients
# (socket, broker uid), the remote tier (password) and the test harness. Any other
# LMCACHE_EC_* variable must name a setting (unknown_env_error).
OTHER_ENV = frozenset(
    {
        SOCKET_ENV,
        "LMCACHE_EC_BROKER_UID",
        "LMCACHE_EC_REMOTE_PASSWORD",
        "LMCACHE_EC_VLLM_LOCK",
        "LMCACHE_EC_FAULT_FILE",
        "LMCACHE_EC_VLLM_NEXT_SRC",
    }
)
OTHER_ENV_PREFIXES = ("LMCACHE_EC_TEST_", "LMCACHE_EC_KEEP_")
# Keys earlier releases accepted but never used; old files and environments still
# start, with a warning that says what to do instead.
_RETIRED = {
    "lease_ms": "the lease a vLLM instance takes on a hit is set per instance, in "
    "ec_connector_extra_config's lease_ms",
    "prefault": "the broker always pre-faults its slab at start",
}
# Plain numbers (YAML, environment) are GiB for capacities, as in LMCache, and bytes for the rest.
_GIB_SIZES = frozenset({"shm_size", "max_local_disk_size"})
_BYTE_SIZES = frozenset(
    {
        "block_size",
        "max_entry_size",
        "max_frame_bytes",
        "put_arena_bytes",
        "max_reserved_bytes_per_connection",
        "max_held_bytes_per_process",
        "max_held_bytes_per_uid",
        "mooncake_global_segment_size",
        "mooncake_local_buffer_size",
    }
)
# Every size-valued field (--print-config shows them as sizes).
SIZE_FIELDS = _GIB_SIZES | _BYTE_SIZES
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

log = logging.getLogger("lmcache_ec_broker.config")


def normalize_local_disk(value: str | None) -> str | None:
    """A ``file://`` URL or a path -> an absolute path; '' and None -> None (no disk tier)."""
    if value is None:
        return None
    value = str(value).strip()
    if not value:
        return None
    if "://" in value:
        url = urllib.parse.urlparse(value)
        if url.scheme != "file":
            raise ValueError(
                f"local_disk {value!r} uses the unsupported URL scheme {url.scheme!r}; "
                "use a directory path or a file:///absolute/path URL"
            )
        if url.netloc not in ("", "localhost"):
            raise ValueError(
                f"local_disk {value!r} names host {url.netloc!r}; only local directories are "
                "supported (file:///absolute/path)"
            )
        value = urllib.parse.unquote(url.path)
        if not value.startswith("/"):
            raise ValueError(f"local_disk URL must name an absolute path, got {value!r}")
    if "\0" in value:
        raise ValueError("local_disk contains a NUL byte")
    return os.path.abspath(os.path.expanduser(value))


def check_local_disk(path: str) -> None:
    """Refuse a disk-tier directory the broker could not use, before anything is created."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"local_disk {path} exists and is not a directory")
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise ValueError(
                f"local_disk {path} is not readable and writable by uid {os.getuid()}; "
                "fix its permissions or choose another directory"
            )
        return
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"local_disk {path} does not exist and cannot be created: {parent or '/'} is not a "
            f"writable directory for uid {os.getuid()}"
        )


def _coerce(name: str, raw: object, ftype: object, from_text: bool) -> object:
    """One value from YAML or the environment -> the field's type; ValueError says why."""
    if name == "local_disk":
        return normalize_local_disk(None if raw is None else str(raw))
    if name in _GIB_SIZES or name in _BYTE_SIZES:
        return parse_size(raw, GiB if name in _GIB_SIZES else 1)  # type: ignore[arg-type]
    if name == "socket_mode" and isinstance(raw, str):
        try:
            return int(raw.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"{raw!r} is not an octal mode like 0660") from None
    if ftype is bool and isinstance(raw, str):
        low = raw.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError(f"{raw!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
    if from_text and isinstance(raw, str) and getattr(ftype, "__origin__", None) is list:
        raw = [part.strip() for part in raw.split(",") if part.strip()]
    elif getattr(ftype, "__origin__", None) is list and not isinstance(raw, list):
        raw = [raw]
    try:
        return msgspec.convert(raw, ftype, strict=False)  # type: ignore[arg-type]
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def _field_for(key: str) -> str:
    return _ALIASES.get(key, key)


def _read_yaml(path: str) -> dict[str, object]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"config file {path} must be a mapping of option names to values")
    return data


def _yaml_keys(path: str) -> list[tuple[str, bool, str, object]]:
    """(key as written, ec_-prefixed, bare name, value) for each key of the file;
    LMCache's nested ``ec:`` map counts as ``ec_``-prefixed keys (shown ``ec.<key>``)."""
    out: list[tuple[str, bool, str, object]] = []
    for key, value in _read_yaml(path).items():
        if key == "ec" and isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise ValueError(f"config file {path}: the keys under ec: must be option names")
            out += [(f"ec.{k}", True, k, v) for k, v in value.items()]
        elif key.startswith("ec_"):
            out.append((key, True, key[3:], value))
        else:
            out.append((key, False, key, value))
    return out


def _yaml_layers(
    path: str, fields: dict[str, object]
) -> tuple[dict[str, tuple[object, str]], dict[str, tuple[object, str]], list[str], list[str]]:
    """(plain layer, ec_ layer, unknown keys, LMCache keys without a use here); each
    layer maps field -> (raw value, source)."""
    plain: dict[str, tuple[object, str]] = {}
    prefixed: dict[str, tuple[object, str]] = {}
    unknown: list[str] = []
    unused: list[str] = []
    for key, is_prefixed, bare, value in _yaml_keys(path):
        layer = prefixed if is_prefixed else plain
        if bare in _RETIRED:
            _warn_retired(bare, f"config {path}: {key}")
            continue
        name = _field_for(bare)
        if name not in fields:
            if bare in LMCACHE_KEYS:
                unused.append(key)
                if bare == "local_cpu" and value is False:
                    log.warning(
                        "config %s: local_cpu: false is ignored; the encoder cache always "
                        "keeps entries in the shared-memory slab",
                        path,
                    )
            else:
                unknown.append(key)
            continue
        if name in layer:
            raise ValueError(
                f"config file {path} sets {name} twice ({layer[name][1].split(': ')[-1]} and "
                f"{key}); keep one of them"
            )
        layer[name] = (value, f"yaml {path}: {key}")
    return plain, prefixed, unknown, unused


def describe_unknown(unknown: list[str], known: list[str]) -> str:
    """'unknown key X (did you mean Y?)', naming the closest known key for each
    misspelling instead of listing every key."""
    parts = []
    for key in sorted(unknown):
        prefix = "ec_" if key.startswith("ec_") else "ec." if key.startswith("ec.") else ""
        bare = key.removeprefix(prefix)
        match = closest(bare, known)
        parts.append(f"{key} (did you mean {prefix}{match}?)" if match else key)
    noun = "unknown key" if len(parts) == 1 else "unknown keys"
    return (
        f"{noun} {', '.join(parts)}; fix or remove {'it' if len(parts) == 1 else 'them'} "
        "(`lmcache-ec-broker start --print-config` lists the broker's settings)"
    )


def _env_names(fields: dict[str, object]) -> tuple[list[str], list[str]]:
    """(unknown, LMCache-only) LMCACHE_EC_* variables: every other one names a setting,
    an alias or a retired key, or is one of OTHER_ENV (LMCache reads LMCACHE_EC_<its
    key> as its own encoder-cache override, so those are LMCache's, not typos)."""
    ours = {ENV_PREFIX + n.upper() for n in (*fields, *_ALIASES, *_RETIRED)}
    unknown: list[str] = []
    unused: list[str] = []
    for var in sorted(os.environ):
        if not var.startswith(ENV_PREFIX) or var in ours or var in OTHER_ENV:
            continue
        if var.startswith(OTHER_ENV_PREFIXES):
            continue
        if var[len(ENV_PREFIX) :].lower() in LMCACHE_KEYS:
            unused.append(var)
        else:
            unknown.append(var)
    return unknown, unused


def unknown_env_error(unknown: list[str], fields: dict[str, object]) -> ValueError:
    """The refusal of misspelt LMCACHE_EC_* variables, each with the closest setting's."""
    known = [ENV_PREFIX + n.upper() for n in (*fields, *_ALIASES)] + sorted(OTHER_ENV)
    named = ", ".join(did_you_mean(var, known) for var in unknown)
    what = "variable" if len(unknown) == 1 else "variables"
    return ValueError(
        f"environment {what} {named}: not a broker setting; fix the name or unset it "
        f"(every setting is {ENV_PREFIX}<NAME> of a name `lmcache-ec-broker start "
        "--print-config` lists)"
    )


def _note_lmcache_only(parts: list[str]) -> None:
    """One info line naming every LMCache setting given that the encoder cache does not use."""
    if parts:
        log.info(
            "LMCache settings without a use in the encoder-cache broker, accepted and "
            "ignored: %s",
            "; ".join(parts),
        )


def _warn_retired(name: str, where: str) -> None:
    log.warning(
        "%s is ignored: %s is no longer a broker setting (it never had an effect); %s. "
        "Remove it.",
        where,
        name,
        _RETIRED[name],
    )


def _env_layer(fields: dict[str, object]) -> dict[str, tuple[object, str]]:
    layer: dict[str, tuple[object, str]] = {}
    for name in _RETIRED:
        if ENV_PREFIX + name.upper() in os.environ:
            _warn_retired(name, f"environment variable {ENV_PREFIX + name.upper()}")
    names = [(f, f) for f in fields] + [(a, f) for a, f in _ALIASES.items()]
    for key, name in names:
        var = ENV_PREFIX + key.upper()
        if var not in os.environ:
            continue
        if name in layer:
            raise ValueError(f"both {layer[name][1][4:]} and {var} are set; unset one of them")
        layer[name] = (os.environ[var], f"env {var}")
    # The socket variable the clients also read; the field-named variable wins over it.
    if "socket_path" in fields and "socket_path" not in layer and os.environ.get(SOCKET_ENV):
        layer["socket_path"] = (os.environ[SOCKET_ENV], f"env {SOCKET_ENV}")
    return layer


def _with_source(exc: ValueError, sources: dict[str, str]) -> ValueError:
    """Name where the offending value came from, so the user knows which layer to fix."""
    msg = str(exc)
    named = [f"{n} from {src}" for n, src in sources.items() if src != "default" and n in msg]
    return ValueError(f"{msg} ({'; '.join(named)})" if named else msg)


def load_config(
    cli: dict[str, object] | None = None, config_file: str | None = None
) -> tuple[BrokerConfig, dict[str, str]]:
    """The effective configuration and, per field, where its value came from.

    Precedence, highest first: CLI flags > ``LMCACHE_EC_<FIELD>`` environment >
    ``ec_``-prefixed YAML keys > plain YAML keys (LMCache's names accepted) > defaults.
    The YAML file is ``config_file`` (``--config``), else ``$LMCACHE_CONFIG_FILE``.
    Raises ValueError, naming the value and its source, before anything is created.
    """
    fields = {f.name: f.type for f in msgspec.structs.fields(BrokerConfig)}
    config_file = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    plain: dict[str, tuple[object, str]] = {}
    prefixed: dict[str, tuple[object, str]] = {}
    unused: list[str] = []
    if config_file:
        plain, prefixed, unknown, unused = _yaml_layers(config_file, fields)
        if unknown:
            known = [*fields, *_ALIASES, *_RETIRED, *LMCACHE_KEYS]
            raise ValueError(f"config file {config_file}: {describe_unknown(unknown, known)}")
    env_unknown, env_unused = _env_names(fields)
    if env_unknown:
        raise unknown_env_error(env_unknown, fields)
    _note_lmcache_only(
        ([f"{', '.join(unused)} (config {config_file})"] if unused else [])
        + ([f"{', '.join(env_unused)} (environment)"] if env_unused else [])
    )
    env = _env_layer(fields)
    values: dict[str, object] = {}
    sources = {name: "default" for name in fields}
    for layer in (plain, prefixed, env):
        for name, (raw, source) in layer.items():
            try:
                values[name] = _coerce(name, raw, fields[name], source.startswith("env "))
            except ValueError as exc:
                shown = _mask(raw) if name == "remote_url" else raw
                raise ValueError(f"{name} = {shown!r} from {source}: {exc}") from None
            sources[name] = source
    for name, value in (cli or {}).items():
        if value is None:
            continue
        if name == "local_disk":
            try:
                value = normalize_local_disk(str(value))
            except ValueError as exc:
                raise ValueError(f"--local-disk: {exc}") from None
        values[name] = value
        sources[name] = "cli"
    try:
        cfg = msgspec.convert(values, BrokerConfig)
    except msgspec.ValidationError as exc:
        raise _with_source(ValueError(str(exc)), sources) from None
    try:
        cfg.validate()
        if cfg.local_disk:
            check_local_disk(cfg.local_disk)
    except ValueError as exc:
        raise _with_source(exc, sources) from None
    if sources.get("remote_url") == "cli" and cfg.remote_url and _mask(cfg.remote_url) != cfg.remote_url:
        raise ValueError(
            "--remote-url carries a password, which every user can read in the process list; "
            "put it in remote_password_file, $LMCACHE_EC_REMOTE_PASSWORD, or the YAML/env URL"
        )
    return cfg, sources


def _mask(raw: object) -> object:
    from .remote_url import mask_url

    return mask_url(raw) if isinstance(raw, str) else raw
