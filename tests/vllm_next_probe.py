"""Run the connector against a newer vLLM's EC connector modules (used by
tests/test_vllm_compat.py in a subprocess of its own).

``python vllm_next_probe.py SRC MODEL SOCKET``: every module under
``vllm.distributed.ec_transfer`` that exists in SRC (the newer release's sources,
extracted from its wheel) is loaded from there, the rest of vLLM is the installed
one. Then: the connector class against that ``ECConnectorBase``, the plugin's name
through that factory, and one put -> lookup -> load cycle against a real broker.
Prints one line per check; exits non-zero on the first failure.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import pickle
import sys
from pathlib import Path

PACKAGE = "vllm.distributed.ec_transfer"


class NewerSources(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        base = self.root.joinpath(*fullname.split("."))
        if (base / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(
                fullname, base / "__init__.py", submodule_search_locations=[str(base)]
            )
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        return None


def main(src: str, model: str, socket_path: str) -> None:
    root = Path(src)
    sys.meta_path.insert(0, NewerSources(root))

    import torch
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector import base, factory
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    for module in (base, factory):
        assert Path(module.__file__).is_relative_to(root), module.__file__
    print("loaded", base.__file__)

    from lmcache_ec_broker.connector import plugin
    from lmcache_ec_broker.connector.vllm import ECBrokerConnector

    assert issubclass(ECBrokerConnector, base.ECConnectorBase)
    assert not ECBrokerConnector.__abstractmethods__, ECBrokerConnector.__abstractmethods__
    print("subclass ok")

    plugin.register()
    plugin.register()
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=512),
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECBrokerConnector",
            ec_role="ec_both",
            ec_connector_extra_config={"socket_path": socket_path},
        ),
    )
    sched = factory.ECConnectorFactory.create_connector(config, base.ECConnectorRole.SCHEDULER)
    worker = factory.ECConnectorFactory.create_connector(config, base.ECConnectorRole.WORKER)
    assert type(sched) is ECBrokerConnector and type(worker) is ECBrokerConnector
    print("factory ok")

    n, width = 16, 128
    mm_hash = "5a" * 32
    tensor = torch.arange(n * width, dtype=torch.float32).reshape(n, width).to(torch.bfloat16)
    worker.save_caches({mm_hash: tensor}, mm_hash)
    request = Request(
        request_id="r",
        prompt_token_ids=[1, 2, 3] + [5] * n + [4],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=[
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=mm_hash,
                mm_position=PlaceholderRange(offset=3, length=n),
            )
        ],
    )
    assert sched.wait_for_link(30), "the workers' staging link never came up"
    assert not sched.ensure_cache_available(request, 0)  # held: staging on the worker
    sched.wait_for_staging(30)
    assert sched.ensure_cache_available(request, 0)
    assert sched.has_cache_item(mm_hash)
    sched.update_state_after_alloc(request, 0)
    meta = pickle.loads(pickle.dumps(sched.build_connector_meta(None)))  # type: ignore[arg-type]
    worker.bind_connector_metadata(meta)
    cache: dict = {}
    worker.start_load_caches(cache)
    out = ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    sched.update_connector_output(out)
    assert torch.equal(cache[mm_hash], tensor)
    assert sched.take_unavailable_requests() == set()
    sched.shutdown()
    worker.shutdown()
    print("cycle ok")


if __name__ == "__main__":
    main(*sys.argv[1:4])
