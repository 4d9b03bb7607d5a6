"""The package's import graph: no circles, and the layering rules of docs/design.md
("The parts, and who may import whom"); and every class name means one thing.

Read from the source with ``ast`` (nothing is imported): every import counts --
at module level, inside a function (lazy) and under ``TYPE_CHECKING`` alike, since
each is a dependency a reader has to follow. A failure names the files and lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = "lmcache_ec_broker"
ROOT = Path(__file__).resolve().parents[1]

# The ground floor: configuration, the wire contract and the parsers they need.
# Everything may read them; they read nothing of the package but each other.
GROUND = frozenset(
    f"{PKG}.{m}"
    for m in (
        "config", "config_sources", "config_events", "config_mooncake", "config_lmcache",
        "sizes", "private_dirs", "remote_url", "protocol", "peercred",
    )  # fmt: skip
)


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _nearest(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(mod: str) -> dict[str, list[int]]:
    """Module -> the lines of ``mod`` importing it (package modules only)."""
    path, is_pkg = MODULES[mod]
    out: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_nearest(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:  # ``from pkg import module`` imports that module
                full = f"{src}.{a.name}"
                targets.append(full if full in MODULES else _nearest(src))
        for t in targets:
            if t is not None and t != mod and (t == PKG or t.startswith(PKG + ".")):
                out.setdefault(t, []).append(node.lineno)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _where(a: str, b: str) -> str:
    path = MODULES[a][0].relative_to(ROOT)
    return f"{path}:{','.join(map(str, sorted(set(GRAPH[a][b]))))} imports {b}"


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(GRAPH[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_graph_is_read() -> None:
    """Guards the test itself: the graph sees the imports it is meant to judge."""
    assert f"{PKG}.broker.server" in MODULES and f"{PKG}.config" in MODULES
    assert f"{PKG}.broker.coordinator" in GRAPH[f"{PKG}.broker.server"]
    lazy = GRAPH[f"{PKG}.broker.tiers"]  # make_lower_tiers imports each backend lazily
    assert f"{PKG}.broker.tiers.disk.tier" in lazy


def test_no_import_cycles() -> None:
    lines = []
    for comp in _cycles():
        members = set(comp)
        lines.append("a circle: " + ", ".join(comp))
        lines += [f"  {_where(a, b)}" for a in comp for b in GRAPH[a] if b in members]
    assert not lines, "\n".join(lines)


def _breaches(rule) -> list[str]:  # type: ignore[no-untyped-def]
    return [_where(a, b) for a in GRAPH for b in GRAPH[a] if rule(a, b)]


def _under(mod: str, *pkgs: str) -> bool:
    return any(mod == f"{PKG}.{p}" or mod.startswith(f"{PKG}.{p}.") for p in pkgs)


@pytest.mark.parametrize(
    "rule_name",
    [
        "ground floor reads only the ground floor",
        "the broker core tells observers, it does not import the events",
        "a tier sees only the tier contract, not the broker core",
        "the remote policy knows no backend",
        "a backend does not import another backend",
        "the client side does not load the broker",
        "the broker client knows no vLLM connector",
    ],
)
def test_layering(rule_name: str) -> None:
    rules = {
        # config.py and its helpers: nothing of broker/, events/, tiers, connector/.
        "ground floor reads only the ground floor": lambda a, b: a in GROUND and b not in GROUND,
        # The server, store and coordinator tell an ``observer`` / an add-on's hooks;
        # run.py, above both, chooses the add-ons (metrics, residency events).
        "the broker core tells observers, it does not import the events": lambda a, b: (
            _under(a, "broker") and _under(b, "events")
        ),
        # tiers/base.py is the contract: a tier never sees the store, the coordinator,
        # a connection or the server.
        "a tier sees only the tier contract, not the broker core": lambda a, b: (
            _under(a, "broker.tiers") and _under(b, "broker") and not _under(b, "broker.tiers")
        ),
        "the remote policy knows no backend": lambda a, b: (
            _under(a, "broker.tiers.remote")
            and _under(b, "broker.tiers.redis", "broker.tiers.mooncake", "broker.tiers.disk")
        ),
        "a backend does not import another backend": lambda a, b: any(
            _under(a, f"broker.tiers.{x}") and _under(b, f"broker.tiers.{y}")
            for x in ("redis", "mooncake", "disk")
            for y in ("redis", "mooncake", "disk")
            if x != y
        ),
        "the client side does not load the broker": lambda a, b: (
            _under(a, "connector") and _under(b, "broker", "events")
        ),
        # connector/client/ is usable without vLLM (the CLI, benchmarks, other engines);
        # connector/vllm/ builds on it, never the other way round.
        "the broker client knows no vLLM connector": lambda a, b: (
            _under(a, "connector.client") and _under(b, "connector.vllm")
        ),
    }
    breaches = _breaches(rules[rule_name])
    assert not breaches, rule_name + ":\n" + "\n".join(breaches)


def test_every_class_name_means_one_thing() -> None:
    """One class per name in the whole package (a reader who meets ``Connection`` or
    ``State`` need not ask which one); and the peer-credential struct is defined once."""
    where: dict[str, list[str]] = {}
    structs: list[str] = []
    for mod, (path, _) in MODULES.items():
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{mod}:{node.lineno}")
        if 'Struct("3i")' in text:
            structs.append(mod)
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, f"class names defined more than once: {twice}"
    assert structs == [f"{PKG}.peercred"], structs


# The vLLM connector's parts (docs/design.md, "The vLLM connector's parts"): each
# reads only what it defines itself (its own state, methods, and what its
# constructor was given); the connector composes them instead of inheriting them.
CONNECTOR_PARTS = {
    "connector/vllm/scheduler.py": "ECBrokerScheduler",
    "connector/vllm/worker.py": "ECBrokerWorker",
    "connector/vllm/stage_book.py": "StageBook",
    "connector/vllm/reask.py": "ReaskSchedule",
    "connector/vllm/stage_link.py": "StageLink",
}


def _class(path: Path, name: str) -> ast.ClassDef:
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"{path}: no class {name}")


@pytest.mark.parametrize("rel", sorted(CONNECTOR_PARTS))
def test_each_part_of_the_vllm_connector_reads_only_its_own_attributes(rel: str) -> None:
    path = ROOT / PKG / rel
    cls = _class(path, CONNECTOR_PARTS[rel])
    assert not cls.bases, f"{rel}: {cls.name} inherits; a part is a plain object"
    defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    read: dict[str, int] = {}
    for node in ast.walk(cls):
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            continue
        if isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        else:
            read.setdefault(node.attr, node.lineno)
    foreign = {a: line for a, line in read.items() if a not in defined}
    assert not foreign, f"{rel}: {cls.name} reads attributes it does not define: {foreign}"


def test_the_vllm_connector_composes_its_parts() -> None:
    cls = _class(ROOT / PKG / "connector/vllm/connector.py", "ECBrokerConnector")
    bases = [ast.unparse(b) for b in cls.bases]
    assert bases == ["ECConnectorBase"], f"ECBrokerConnector inherits {bases}: compose parts"
