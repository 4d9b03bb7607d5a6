"""The README and the operator pages show only commands, flags, config keys and files
that exist: every `lmcache-ec-broker ...` / `lmcache-ec-aggregator ...` command line is
checked against the real argparse parsers, every YAML key against the broker's config
Struct, every connector key against what the connector reads, every repository path
against the tree. The README stays short enough to read in ten minutes."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# The pages the README sends a reader to, one per task; checked like the README.
PAGES = ("docs/vllm.md", "docs/across-nodes.md", "docs/routing.md", "docs/operations.md")
CHECKED = ("README.md", *PAGES, "examples/README.md")
MAX_README_LINES = 300


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {opt for action in p._actions for opt in action.option_strings}


def cli_surface() -> dict[str, set[str]]:
    """'lmcache-ec-broker SUB' -> its options, plus the top level ('') and the aggregator."""
    from lmcache_ec_broker.cli import _parser
    from lmcache_ec_broker.events.aggregator import build_parser

    top = _parser()
    surface = {"": _options(top), "lmcache-ec-aggregator": _options(build_parser())}
    for name, sub in _subparsers(top).items():
        surface[name] = _options(sub)
    return surface


def config_keys() -> set[str]:
    """Every key a YAML file may set (each also with the ec_ prefix)."""
    from lmcache_ec_broker import config, config_sources

    keys = set(config.BrokerConfig.__struct_fields__) | set(config_sources._ALIASES)
    return keys


def missing(kind: str, name: str, known: set[str]) -> bool:
    """True when ``name`` (a flag of subcommand ``kind``, or a config key) is not there."""
    return name not in known


def _code(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """([(fence language, block)], [inline code spans outside the blocks])."""
    blocks = [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return blocks, re.findall(r"`([^`\n]+)`", prose)


def command_lines(text: str) -> list[str]:
    """Every command line naming one of the two programs, continuation lines joined,
    cut at the next shell operator or comment."""
    blocks, spans = _code(text)
    lines = []
    for _, block in blocks:
        lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    lines += spans
    found = []
    for line in lines:
        for m in re.finditer(r"(?:^|[\s/(`$])(lmcache-ec-(?:broker|aggregator))(\s.*|$)", line):
            rest = re.split(r"\s(?:\||&&|;|&|#|>)", m[2] + " ")[0]
            found.append(f"{m[1]}{rest}".strip())
    return found


def bad_command(cmd: str, surface: dict[str, set[str]]) -> str | None:
    """Why ``cmd`` would not parse (None when every word names something real)."""
    words = cmd.split()
    prog, rest = words[0], words[1:]
    if prog == "lmcache-ec-aggregator":
        sub, known = "lmcache-ec-aggregator", surface["lmcache-ec-aggregator"]
    elif not rest or rest[0].startswith("-"):
        sub, known = "", surface[""]
    elif rest[0] in surface:
        sub, known, rest = rest[0], surface[rest[0]], rest[1:]
    elif re.fullmatch(r"[a-z][a-z-]*", rest[0]):
        return f"no subcommand {rest[0]!r} in {cmd!r}"
    else:
        return None  # a placeholder (`lmcache-ec-broker ...`), nothing to check
    for word in rest:
        flag = re.match(r"\[?(--[a-z][a-z0-9-]*)", word)
        if flag and missing(sub, flag[1], known):
            return f"{flag[1]} is not an option of {prog} {sub}".rstrip() + f" (in {cmd!r})"
    return None


def yaml_keys(text: str) -> list[str]:
    blocks, _ = _code(text)
    keys = []
    for lang, block in blocks:
        # a YAML block, or a YAML here-document in a shell block (cat > f <<'YAML')
        docs = (
            [block]
            if lang in ("yaml", "yml")
            else re.findall(r"<<'?YAML'?\n(.*?)^YAML$", block, re.S | re.M)
        )
        for doc in docs:
            keys += re.findall(r"^([A-Za-z_][A-Za-z0-9_]*):", doc, re.M)
    return keys


def env_vars(text: str) -> list[str]:
    return sorted(set(re.findall(r"\bLMCACHE_EC_[A-Z0-9_]+\b", text)))


def repo_paths(text: str) -> list[str]:
    """Repository files named in code: docs/..., examples/..., tests/..., benchmarks/...,
    docker/..., .ci/... (a `::test` suffix is dropped), and the package's modules."""
    _, spans = _code(text)
    blocks, _ = _code(text)
    pool = spans + [b for _, b in blocks] + re.findall(r"\]\(([^)]+)\)", text)
    found = set()
    for chunk in pool:
        for m in re.finditer(
            r"(?<![\w/.-])((?:docs|examples|tests|benchmarks|docker|\.ci)/[\w./-]*\w)", chunk
        ):
            found.add(m[1].split("::")[0])
        # package modules named from the package root (`broker/tiers/disk.py`)
        for m in re.finditer(
            r"(?<![\w/.-])((?:broker|connector|shm|events|testing)/[\w/]*\.py)\b", chunk
        ):
            found.add(f"lmcache_ec_broker/{m[1]}")
        for m in re.finditer(r"(?<![\w/.-])(lmcache_ec_broker/[\w/]*\.py)\b", chunk):
            found.add(m[1])
    return sorted(found)


# ------------------------------------------------------------------- the checks


def test_readme_is_short_and_sends_the_reader_to_one_page_per_task() -> None:
    text = README.read_text()
    n = len(text.splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES})"
    for page in PAGES:
        assert (REPO / page).is_file(), page
        assert page in text, f"README.md does not link {page}"
    # the two set-up commands and the test command
    assert "bash .ci/setup.sh" in text and "bash .ci/run" in text
    assert "https://download.pytorch.org/whl/cpu" in text  # where torch comes from, once
    assert text.count("download.pytorch.org") == 1


@pytest.mark.parametrize("doc", CHECKED)
def test_every_command_and_flag_shown_exists(doc: str) -> None:
    surface = cli_surface()
    cmds = command_lines((REPO / doc).read_text())
    assert cmds or doc != "README.md", "no command found: the extractor is broken"
    bad = [why for cmd in cmds if (why := bad_command(cmd, surface))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", CHECKED)
def test_every_config_key_shown_exists(doc: str) -> None:
    known = config_keys()
    text = (REPO / doc).read_text()
    bad = [k for k in yaml_keys(text) if missing("config", k.removeprefix("ec_"), known)]
    assert not bad, f"{doc} shows config keys the broker does not have: {bad}"
    env_names = {k.upper() for k in known} | {"BROKER_SOCKET", "BROKER_UID"}
    bad_env = [v for v in env_vars(text) if v.removeprefix("LMCACHE_EC_") not in env_names]
    assert not bad_env, f"{doc} shows environment variables nothing reads: {bad_env}"


@pytest.mark.parametrize("doc", CHECKED)
def test_every_file_named_exists(doc: str) -> None:
    text = (REPO / doc).read_text()
    gone = [p for p in repo_paths(text) if not (REPO / p).exists()]
    assert not gone, f"{doc} names files that do not exist: {gone}"


# The checks above fail on what they should catch (each extractor is tried on a bad text).


def test_the_checks_catch_a_misspelt_flag_subcommand_key_and_file() -> None:
    surface = cli_surface()
    text = """```bash
lmcache-ec-broker start --shm-size 2GiB --sokcet /x
lmcache-ec-broker pong
/opt/v/bin/lmcache-ec-broker stats --json | grep hits
```
run `lmcache-ec-broker stop --timeout 5` and read `docs/nope.md` and `broker/gone.py`
```yaml
local_disc: /var/lib/x
ec_max_local_disk_size: 4
```
```bash
cat > b.yaml <<'YAML'
remote_ulr: redis://x
YAML
```
"""
    cmds = command_lines(text)
    assert cmds == [
        "lmcache-ec-broker start --shm-size 2GiB --sokcet /x",
        "lmcache-ec-broker pong",
        "lmcache-ec-broker stats --json",
        "lmcache-ec-broker stop --timeout 5",
    ]
    assert [bool(bad_command(c, surface)) for c in cmds] == [True, True, False, False]
    known = config_keys()
    assert [k for k in yaml_keys(text) if missing("config", k.removeprefix("ec_"), known)] == [
        "local_disc",
        "remote_ulr",
    ]
    assert repo_paths(text) == ["docs/nope.md", "lmcache_ec_broker/broker/gone.py"]
