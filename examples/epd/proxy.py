"""An EPD proxy: encoder instances feed prefill/decode instances through the cache.

    python examples/epd/proxy.py --port 8000 \\
        --encoder http://node-1:8001 --pd http://node-2:8002=node-2 \\
        [--lookup http://aggregator:8790]

vLLM's disaggregated-encoder protocol (vLLM's examples/online_serving/
disaggregated_encoder): for each ``POST /v1/chat/completions`` that carries
multimodal items, every item goes to an encoder instance (``vllm serve
--mm-encoder-only``, ``ec_role: ec_producer``) as a request of its own with
``max_tokens: 1``; when all of them answered, the original request goes to a
prefill/decode instance (``ec_role: ec_consumer``), which loads the items' encoder
outputs from its node's broker instead of encoding them.

``--lookup URL`` (the aggregator, or one broker's ``events_lookup_port``) adds a
first step: the proxy asks the PD instance for the request's mm hashes (vLLM's
``/v1/chat/completions/render``; PD runs with ``--enable-scale-out``), then the
lookup API where they are; when every item is readable by the PD instance -- on
its node (``--pd URL=NODE``, any tier) or in the fleet's shared tier (``remote``,
any node) -- the E hop is skipped. The hashes come from vLLM itself, so they are
exactly the keys' (model string, processor kwargs and all).

Failures never change an answer, only who encodes: if the render or the lookup
fails, the E hop is made; if an encoder instance fails, the request still goes to
PD, which encodes what it cannot load (``ec_consumer`` encodes on a miss).
``GET /stats`` has the proxy's counters; ``GET /health`` checks every instance.
Needs aiohttp (a dependency of vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import itertools
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("epd-proxy")

# Chat-content part types that carry one multimodal item each (OpenAI / vLLM).
# part type -> the modality vLLM's render endpoint files its mm hash under
MODALITY = {
    "image_url": "image",
    "image_pil": "image",
    "image_embeds": "image",
    "video_url": "video",
    "audio_url": "audio",
    "input_audio": "audio",
}
# Fields of the client's request the encoder requests do not take over: the E request
# answers one token, unstreamed, for one item.
NOT_FOR_ENCODER = (
    "messages", "stream", "stream_options", "n", "max_completion_tokens", "min_tokens",
    "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
)  # fmt: skip
# Tiers a PD instance can read: its own node's (any), and the shared fleet tier.
SHARED_TIER = "remote"
LOOKUP_WINDOW = 10_000


@dataclass
class Counters:
    requests: int = 0
    mm_requests: int = 0
    mm_items: int = 0
    encoder_requests: int = 0  # one per item sent to E
    encoder_errors: int = 0
    e_hops: int = 0  # requests whose items went to E
    e_skipped: int = 0  # requests sent straight to PD: every item was resident
    items_skipped: int = 0  # items not sent to E: resident where PD reads them
    lookups: int = 0
    lookup_errors: int = 0  # render or lookup failed: the E hop was made
    pd_errors: int = 0
    lookup_ms_total: float = 0.0
    # the last LOOKUP_WINDOW lookups' times, for the median (bounded: a proxy runs for long)
    lookup_ms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LOOKUP_WINDOW)
    )

    def note_lookup(self, ms: float) -> None:
        self.lookup_ms.append(ms)
        self.lookup_ms_total += ms

    def as_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "lookup_ms"}
        ms = sorted(self.lookup_ms)
        d["lookup_ms_p50"] = ms[len(ms) // 2] if ms else None
        return d


@dataclass(frozen=True)
class PdInstance:
    url: str
    node: str | None  # the node name its broker publishes (events_node), if given


def parse_pd(spec: str) -> PdInstance:
    url, sep, node = spec.partition("=")
    if not url.startswith(("http://", "https://")) or (sep and not node):
        raise argparse.ArgumentTypeError(
            f"--pd {spec!r}: give URL or URL=NODE, e.g. http://10.0.0.2:8002=node-2"
        )
    return PdInstance(url.rstrip("/"), node or None)


def mm_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every multimodal content part of the request, in order."""
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts += [p for p in content if isinstance(p, dict) and p.get("type") in MODALITY]
    return parts


def encoder_request(body: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """The request E gets for one item: the item alone, one token, not streamed. Top-level
    fields that shape the item's processing (mm_processor_kwargs, media_io_kwargs) are
    kept: they are part of its mm_hash."""
    req = {k: v for k, v in body.items() if k not in NOT_FOR_ENCODER}
    req["messages"] = [{"role": "user", "content": [copy.deepcopy(part)]}]
    req["max_tokens"] = 1
    req["stream"] = False
    return req


def hashes_in_part_order(
    by_modality: dict[str, list[str]], parts: list[dict[str, Any]]
) -> list[str]:
    """The render endpoint lists hashes per modality, each in the request's order; the
    request may interleave modalities: give them back in the parts' order."""
    taken: dict[str, int] = {}
    out = []
    for part in parts:
        modality = MODALITY[part["type"]]
        k = taken.get(modality, 0)
        got = by_modality.get(modality) or []
        if k >= len(got):
            raise RuntimeError(f"render gave {len(got)} {modality} hashes, the request has more")
        out.append(got[k])
        taken[modality] = k + 1
    if sum(len(v) for v in by_modality.values()) != len(parts):
        raise RuntimeError(f"render gave {by_modality}, the request has {len(parts)} items")
    return out


def readable_by(pd: PdInstance, where: list[dict[str, Any]]) -> bool:
    """Can ``pd``'s broker get the item, given the lookup's nodes holding it?"""
    for holder in where:
        tiers = holder.get("tiers") or {}
        if SHARED_TIER in tiers or (pd.node is not None and holder.get("node") == pd.node):
            return True
    return False


class Proxy:
    def __init__(
        self,
        encoders: list[str],
        pds: list[PdInstance],
        lookup: str | None,
        lookup_model: str | None,
        timeout_s: float,
    ) -> None:
        if not encoders or not pds:
            raise ValueError("give at least one --encoder and one --pd")
        self.encoders = [u.rstrip("/") for u in encoders]
        self.pds = pds
        self.lookup_url = lookup.rstrip("/") if lookup else None
        self.lookup_model = lookup_model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.stats = Counters()
        self._e_rr = itertools.cycle(range(len(self.encoders)))
        self._pd_rr = itertools.cycle(range(len(self.pds)))
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def close(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------ lookup-first

    async def plan(
        self, body: dict[str, Any], first: PdInstance, parts: list[dict[str, Any]]
    ) -> tuple[PdInstance, list[int]]:
        """The PD instance to use and the indices of the items E must encode for it: the
        PD that can read the most items (``first`` on ties), the items it cannot read.
        Every item when the render or the lookup fails."""
        assert self.session is not None and self.lookup_url is not None
        t0 = time.perf_counter()
        self.stats.lookups += 1
        try:
            render = {**body, "stream": False, "mm_payload": "none"}
            render.pop("stream_options", None)
            async with self.session.post(
                f"{first.url}/v1/chat/completions/render", json=render
            ) as r:
                if r.status != 200:
                    raise RuntimeError(f"render answered {r.status}: {(await r.text())[:200]}")
                features = (await r.json()).get("features") or {}
            hashes = hashes_in_part_order(features.get("mm_hashes") or {}, parts)
            model = self.lookup_model or str(body.get("model") or "")
            query = {"model": model, "mm_hashes": hashes}
            async with self.session.post(f"{self.lookup_url}/v1/lookup", json=query) as r:
                if r.status != 200:
                    raise RuntimeError(f"lookup answered {r.status}: {(await r.text())[:200]}")
                results = (await r.json())["results"]
            if len(results) != len(hashes):
                raise RuntimeError(f"lookup answered {len(results)} results for {len(hashes)}")
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            RuntimeError,
            KeyError,
            ValueError,
        ) as exc:
            self.stats.lookup_errors += 1
            log.warning("lookup-first failed (%s): every item goes to E", exc)
            return first, list(range(len(parts)))
        finally:
            self.stats.note_lookup((time.perf_counter() - t0) * 1e3)
        wheres = [res.get("nodes") or [] for res in results]
        best: tuple[PdInstance, list[int]] | None = None
        for pd in [first, *(p for p in self.pds if p is not first)]:
            missing = [i for i, where in enumerate(wheres) if not readable_by(pd, where)]
            if best is None or len(missing) < len(best[1]):
                best = (pd, missing)
        assert best is not None
        return best

    # ------------------------------------------------------------ E hop

    async def encode(self, body: dict[str, Any], parts: list[dict[str, Any]], req_id: str) -> None:
        """Send every item to an encoder instance (round-robin), all at once."""
        assert self.session is not None

        async def one(part: dict[str, Any]) -> None:
            url = self.encoders[next(self._e_rr)]
            self.stats.encoder_requests += 1
            headers = {"x-request-id": f"{req_id}-e{self.stats.encoder_requests}"}
            try:
                async with self.session.post(
                    f"{url}/v1/chat/completions", json=encoder_request(body, part), headers=headers
                ) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}: {text[:200]}")
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                # PD encodes what it cannot load: the answer is the same, only slower.
                self.stats.encoder_errors += 1
                log.warning(
                    "[%s] encoder request failed (%s); PD will encode the item", req_id, exc
                )

        self.stats.e_hops += 1
        await asyncio.gather(*(one(p) for p in parts))

    # ------------------------------------------------------------ routes

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "the body must be a JSON chat request"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        req_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        self.stats.requests += 1
        parts = mm_parts(body)
        pd = self.pds[next(self._pd_rr)]
        if parts:
            self.stats.mm_requests += 1
            self.stats.mm_items += len(parts)
            missing = list(range(len(parts)))
            if self.lookup_url:
                pd, missing = await self.plan(body, pd, parts)
            self.stats.items_skipped += len(parts) - len(missing)
            if missing:
                await self.encode(body, [parts[i] for i in missing], req_id)
            else:
                self.stats.e_skipped += 1
        return await self.forward(request, pd, body, req_id)

    async def forward(
        self, request: web.Request, pd: PdInstance, body: dict[str, Any], req_id: str
    ) -> web.StreamResponse:
        """The original request to PD; its answer (streamed or not) back as it comes."""
        assert self.session is not None
        try:
            async with self.session.post(
                f"{pd.url}/v1/chat/completions", json=body, headers={"x-request-id": req_id}
            ) as r:
                out = web.StreamResponse(status=r.status)
                out.content_type = r.content_type
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.stats.pd_errors += 1
            return web.json_response({"error": f"PD instance {pd.url} failed: {exc}"}, status=502)

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(f"{self.pds[0].url}/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    async def health(self, _request: web.Request) -> web.Response:
        assert self.session is not None

        async def ok(url: str) -> bool:
            try:
                async with self.session.get(f"{url}/health") as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        urls = [*self.encoders, *(p.url for p in self.pds)]
        states = dict(zip(urls, await asyncio.gather(*(ok(u) for u in urls)), strict=True))
        return web.json_response(states, status=200 if all(states.values()) else 503)

    async def get_stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.stats.as_json())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)  # requests carry base64 media
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/stats", self.get_stats)
        return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--encoder", action="append", required=True, metavar="URL",
                   help="an encoder instance (ec_producer); repeat for several")  # fmt: skip
    p.add_argument("--pd", action="append", required=True, type=parse_pd, metavar="URL[=NODE]",
                   help="a prefill/decode instance (ec_consumer); NODE: its broker's events_node "
                        "(lets the lookup count that node's own tiers); repeat for several")  # fmt: skip
    p.add_argument("--lookup", metavar="URL",
                   help="lookup API (lmcache-ec-aggregator, or a broker's events_lookup_port): "
                        "skip the E hop when every item is resident; PD needs --enable-scale-out")  # fmt: skip
    p.add_argument("--lookup-model", help="model name for lookups (default: the request's model)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per upstream request")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    proxy = Proxy(args.encoder, args.pd, args.lookup, args.lookup_model, args.timeout_s)
    print(f"EPD proxy on http://{args.host}:{args.port}", flush=True)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
