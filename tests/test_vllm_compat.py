"""vLLM version coverage beyond the installed build.

The connector is tested end to end against the installed vLLM (the 0.32 CPU
build). vLLM 0.33 has no CPU build, and its CUDA wheel does not run here, but its
EC connector API is plain Python: .ci/setup.sh extracts 0.33's
``vllm/distributed/ec_transfer`` (and the scheduler and worker code that calls
it) from the wheel into ``.venv/vllm-0.33.0``. These tests then

- compare ``ECConnectorBase`` of the two versions method by method (names,
  parameters, which are abstract),
- compare which connector hooks the two schedulers and model runners call,
- and run the connector on 0.33's ``ec_connector`` modules (base class, factory,
  metrics) inside the installed vLLM: the plugin's short name through 0.33's
  factory, then one put -> lookup -> load cycle against a real broker.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import vllm

from lmcache_ec_broker.testing.tiny_qwen2vl import build_tiny_qwen2vl

NEXT = "0.33.0"
REPO = Path(__file__).resolve().parent.parent
SRC = Path(os.environ.get("LMCACHE_EC_VLLM_NEXT_SRC") or REPO / ".venv" / f"vllm-{NEXT}")
INSTALLED = Path(vllm.__file__).resolve().parent.parent
BASE = "vllm/distributed/ec_transfer/ec_connector/base.py"
CALLERS = ("vllm/v1/core/sched/scheduler.py", "vllm/v1/worker/ec_connector_model_runner_mixin.py")


@pytest.fixture(scope="module")
def next_src() -> Path:
    if not (SRC / BASE).is_file():
        message = (
            f"vLLM {NEXT}'s sources are not at {SRC}; `bash .ci/setup.sh` extracts them "
            "(or set LMCACHE_EC_VLLM_NEXT_SRC)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)  # CI runs setup.sh: absent there means setup is broken
        pytest.skip(message)
    return SRC


def class_api(path: Path, name: str) -> dict[str, tuple[object, ...]]:
    """Per method of class ``name``: parameters, defaults count, and whether abstract."""
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    api: dict[str, tuple[object, ...]] = {}
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = fn.args
        decorators = {ast.unparse(d) for d in fn.decorator_list}
        api[fn.name] = (
            tuple(x.arg for x in a.posonlyargs + a.args),
            len(a.defaults),
            a.vararg is not None,
            tuple(x.arg for x in a.kwonlyargs),
            a.kwarg is not None,
            "abstractmethod" in decorators,
            tuple(sorted(decorators - {"abstractmethod"})),
        )
    return api


def hook_calls(path: Path) -> set[str]:
    """Methods called on an object named ``ec_connector`` (``self.ec_connector.x(...)``)."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            owner_name = (
                owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            )
            if owner_name == "ec_connector":
                calls.add(node.func.attr)
    return calls


def test_ec_connector_base_is_the_same_in_0_33(next_src: Path):
    for name in ("ECConnectorBase", "ECConnectorMetadata", "ECConnectorRole"):
        assert class_api(next_src / BASE, name) == class_api(INSTALLED / BASE, name), name
    api = class_api(next_src / BASE, "ECConnectorBase")
    abstract = {m for m, sig in api.items() if sig[5]}
    assert abstract == {
        "has_cache_item",
        "update_state_after_alloc",
        "build_connector_meta",
        "start_load_caches",
        "save_caches",
    }
    from lmcache_ec_broker.connector.vllm import ECBrokerConnector

    ours = [c for c in ECBrokerConnector.__mro__ if c.__module__.startswith("lmcache_ec_broker")]
    overridden = {m for c in ours for m in vars(c) if m in api}  # the connector and its mixins
    assert abstract <= overridden
    # Hooks this connector relies on exist in 0.33 under the same names.
    assert {
        "ensure_cache_available",
        "update_connector_output",
        "request_finished",
        "build_connector_worker_meta",
        "start_save_caches",
    } <= overridden


def test_schedulers_and_runners_call_the_same_hooks_in_0_33(next_src: Path):
    for caller in CALLERS:
        assert hook_calls(next_src / caller) == hook_calls(INSTALLED / caller), caller
    assert "ensure_cache_available" in hook_calls(next_src / CALLERS[0])


def test_connector_runs_on_0_33_ec_connector_modules(next_src: Path, broker, tmp_path_factory):
    root = os.environ.get("LMCACHE_EC_TEST_MODELS") or tmp_path_factory.mktemp("models")
    model = build_tiny_qwen2vl(root)
    probe = Path(__file__).with_name("vllm_next_probe.py")
    run = subprocess.run(
        [sys.executable, str(probe), str(next_src), str(model), broker.socket_path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert f"loaded {next_src / BASE}" in lines
    assert {"subclass ok", "factory ok", "cycle ok"} <= set(lines)


# The runners' EC paths: what staged loads rely on (docs/design.md, "Staged loads"),
# in the installed vLLM and in 0.33.
EC_WRAPPERS = (
    ("vllm/v1/worker/ec_connector_model_runner_mixin.py", "_get_ec_connector_output", None),
    ("vllm/v1/worker/gpu/ec_connector.py", "maybe_get_output", "ActiveECConnector"),
)


def function(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    tree: ast.AST = ast.parse(path.read_text())
    if cls is not None:
        (tree,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in ast.walk(tree) if getattr(n, "name", None) == name]
    assert isinstance(fn, ast.FunctionDef)
    return fn


def ec_runner_roots(next_src: Path) -> list[Path]:
    roots = [INSTALLED]
    if (next_src / EC_WRAPPERS[1][0]).is_file():
        roots.append(next_src)
    elif os.environ.get("CI"):
        pytest.fail(f"{next_src} lacks the V2 runner's EC sources: re-run .ci/setup.sh")
    return roots


def test_runners_load_before_the_encoder_and_the_gather_run(next_src):
    """start_load_caches runs before the wrapper yields (the encoder and the gather
    run inside the block): a staged tensor moved there is in the encoder cache when
    the gather reads it."""
    for root in ec_runner_roots(next_src):
        for rel, name, cls in EC_WRAPPERS:
            fn = function(root / rel, name, cls)
            src = ast.unparse(fn)
            assert "start_load_caches" in src, (root, rel)
            assert "bind_connector_metadata(scheduler_output.ec_connector_metadata)" in src
            assert src.index("start_load_caches") < src.index("yield output"), (root, rel)


def test_the_v1_runner_runs_no_ec_hook_in_a_step_without_tokens(next_src):
    """Why stage orders and reports travel on the staging link (stage_link.py), not in
    the step's metadata: the V1 runner returns before its EC wrapper when a step
    schedules no tokens -- the step in which a held request waits alone -- and only
    V2 has ActiveECConnector.no_forward. The schedulers hold a request through
    ensure_cache_available."""
    for root in ec_runner_roots(next_src):
        v1 = ast.unparse(function(root / "vllm/v1/worker/gpu_model_runner.py", "execute_model"))
        assert v1.index("if not num_scheduled_tokens") < v1.index("self._preprocess("), root
        sched = ast.unparse(function(root / CALLERS[0], "schedule"))
        assert "ensure_cache_available(" in sched, root
    v2 = ast.unparse(function(INSTALLED / EC_WRAPPERS[1][0], "no_forward", "ActiveECConnector"))
    assert "maybe_get_output" in v2


def test_the_metadata_travels_inside_the_scheduler_output(next_src):
    """Both schedulers attach the connector's metadata to the SchedulerOutput they
    pass to build_connector_meta (the step's loads travel in it)."""
    for root in (INSTALLED, next_src):
        sched = ast.unparse(function(root / CALLERS[0], "schedule"))
        assert "scheduler_output.ec_connector_metadata = ec_meta" in sched, root
        assert "self.ec_connector.build_connector_meta(scheduler_output)" in sched, root
    output = next_src / "vllm/v1/core/sched/output.py"
    if output.is_file():
        assert "encoder_input_updates" in output.read_text()


# What the key's identity relies on (issue 39), in the installed vLLM and in 0.33:
# vLLM's own code for numbering items and prefixing tower-LoRA identifiers, run here on
# stand-ins for its objects; the hasher algorithms; the engine call that takes the
# digest of the weights at load.
IDENTITY = (
    "vllm/renderers/base.py",
    "vllm/v1/engine/input_processor.py",
    "vllm/config/multimodal.py",
    "vllm/v1/engine/core.py",
    "vllm/v1/executor/abstract.py",
)


def identity_roots(next_src: Path) -> list[Path]:
    if all((next_src / rel).is_file() for rel in IDENTITY):
        return [INSTALLED, next_src]
    if os.environ.get("CI"):
        pytest.fail(f"{next_src} lacks vLLM {NEXT}'s identity sources: re-run .ci/setup.sh")
    return [INSTALLED]


def compiled(fn: ast.FunctionDef) -> object:
    """vLLM's function, compiled on its own (annotations left unevaluated)."""
    namespace: dict[str, object] = {}
    exec(
        compile("from __future__ import annotations\n" + ast.unparse(fn), "<vllm>", "exec"),
        namespace,
    )
    return namespace[fn.name]


def numbered_ids(root: Path, cache_gb: float, prefix: bool) -> list[str | None]:
    """The identifiers vLLM's renderer gives two images without UUIDs: its own
    ``mm_req_id`` expression and ``_process_mm_uuids``, run on stand-ins."""
    from types import SimpleNamespace

    path = root / "vllm/renderers/base.py"
    process = compiled(function(path, "_process_mm_uuids", "BaseRenderer"))
    (assign,) = [
        n
        for n in ast.walk(function(path, "_process_multimodal", "BaseRenderer"))
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "mm_req_id"
    ]
    renderer = SimpleNamespace(
        api_process_rank=0,
        _mm_req_counter=SimpleNamespace(inc=lambda n: 7),
        model_config=SimpleNamespace(
            multimodal_config=SimpleNamespace(mm_processor_cache_gb=cache_gb)
        ),
        config=SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix)),
        _validate_mm_uuids=lambda *a: None,
    )
    mm_req_id = eval(compile(ast.Expression(assign.value), "<vllm>", "eval"), {"self": renderer})
    items = SimpleNamespace(get_all_counts=lambda: {"image": 2})
    out = process(renderer, {}, items, {}, mm_req_id)  # type: ignore[operator]
    return list(out.get("image", [None, None]))


def test_numbering_detection_matches_vllms_renderer(next_src: Path):
    """identifiers.NUMBERED and numbering_reason agree with what the renderer of each
    release does: numbered names exactly when both caches are off, content hashes
    (None here: vLLM hashes them later) otherwise."""
    from types import SimpleNamespace

    from lmcache_ec_broker.connector.vllm.identifiers import NUMBERED, IdentifierPolicy

    for root in identity_roots(next_src):
        for cache_gb, prefix in ((0, False), (0, True), (4, False), (4, True)):
            ids = numbered_ids(root, cache_gb, prefix)
            config = SimpleNamespace(
                model_config=SimpleNamespace(
                    multimodal_config=SimpleNamespace(
                        mm_processor_cache_gb=cache_gb, mm_hasher_algorithm="blake3"
                    )
                ),
                cache_config=SimpleNamespace(enable_prefix_caching=prefix),
                lora_config=None,
            )
            policy = IdentifierPolicy(config)
            if cache_gb == 0 and not prefix:
                assert ids == ["renderer0-mm-7-image-0", "renderer0-mm-7-image-1"], root
                assert all(NUMBERED.fullmatch(i) for i in ids), (root, ids)
                assert policy.shares_nothing and all(policy.item_key(i) is None for i in ids)
            else:
                assert ids == [None, None], (root, cache_gb, prefix)
                assert not policy.shares_nothing
            # A numbered name is never shared, whatever the configuration.
            assert policy.item_key("renderer0-mm-7-image-0") is None


def test_tower_lora_identifier_and_hasher_algorithms(next_src: Path):
    from types import SimpleNamespace

    from vllm.config import LoRAConfig
    from vllm.lora.request import LoRARequest

    from lmcache_ec_broker.connector.vllm.identifiers import DIGEST_HEX

    for root in identity_roots(next_src):
        get_id = compiled(
            function(
                root / "vllm/v1/engine/input_processor.py", "_get_mm_identifier", "InputProcessor"
            )
        )
        processor = SimpleNamespace(lora_config=LoRAConfig(enable_tower_connector_lora=True))
        lora = LoRARequest("adapter", 1, "/adapters/a")
        assert get_id(processor, "h", lora) == "adapter:h", root  # type: ignore[operator]
        tree = ast.parse((root / "vllm/config/multimodal.py").read_text())
        (alias,) = [
            n
            for n in tree.body
            if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "MMHasherAlgorithm"
        ]
        algorithms = {c.value for c in ast.walk(alias.value) if isinstance(c, ast.Constant)}
        assert algorithms == set(DIGEST_HEX), (root, algorithms)


def test_engine_calls_the_executor_right_after_building_the_scheduler(next_src: Path):
    """weights_identity takes the digest at load in Executor.init_ec_output_aggregator,
    which EngineCore.__init__ calls right after it built the Scheduler (hence the EC
    connector), before any request."""
    for root in identity_roots(next_src):
        init = ast.unparse(function(root / "vllm/v1/engine/core.py", "__init__", "EngineCore"))
        built = init.index("self.scheduler: SchedulerInterface = Scheduler(")
        assert init.index("self.model_executor.init_ec_output_aggregator()") > built, root
        abstract = root / "vllm/v1/executor/abstract.py"
        function(abstract, "init_ec_output_aggregator", "Executor")  # defined on the base


def test_the_staging_budget_asks_vllm_what_its_scheduler_asks(next_src: Path):
    """stage_book.vllm_encoder_cache_size builds ``MultiModalBudget(vllm_config, registry,
    enable_cache=False)`` and reads ``encoder_cache_size``: in the installed vLLM and in
    0.33 the Scheduler sizes its EncoderCacheManager from the same object, whose
    ``enable_cache`` only picks a processor cache, and the size is
    ``compute_mm_encoder_budget``'s (the configured size raised to the largest item)."""
    sizing = next_src / "vllm/v1/core/encoder_cache_manager.py"
    if not sizing.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{sizing} is missing: re-run .ci/setup.sh")
        pytest.skip(f"{sizing} is missing: `bash .ci/setup.sh` extracts it")
    for root in (INSTALLED, next_src):
        path = root / "vllm/multimodal/encoder_budget.py"
        init = function(path, "__init__", "MultiModalBudget")
        assert [a.arg for a in init.args.args] == ["self", "vllm_config", "mm_registry"], root
        assert [a.arg for a in init.args.kwonlyargs] == ["enable_cache"], root
        body = ast.unparse(init)
        assert "processor_only_cache_from_config(vllm_config) if enable_cache else None" in body
        assert "compute_mm_encoder_budget(" in body
        assert "self.encoder_cache_size = encoder_cache_size" in body
        manager = root / "vllm/v1/core/encoder_cache_manager.py"
        sized = ast.unparse(function(manager, "compute_mm_encoder_budget"))
        assert "max(scheduler_config.encoder_cache_size, max_tokens_per_mm_item)" in sized, root
        sched = ast.unparse(
            function(root / "vllm/v1/core/sched/scheduler.py", "__init__", "Scheduler")
        )
        assert "MultiModalBudget(vllm_config, mm_registry)" in sched, root
        assert "mm_budget.encoder_cache_size if mm_budget else 0" in sched, root
        assert "cache_size=encoder_cache_size" in sched, root
