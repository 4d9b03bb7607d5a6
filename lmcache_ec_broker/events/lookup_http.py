"""The HTTP/JSON lookup API, served by a broker for itself and by the aggregator for
many (docs/events.md). Bound to 127.0.0.1 unless configured otherwise, as the
metrics endpoint; it has no authentication of its own.

``GET  /v1/lookup?model=M&mm_hash=H1&mm_hash=H2``
``POST /v1/lookup`` with ``{"model": M, "mm_hashes": [H1, H2]}``
  -> ``{"schema_version": 1, "model": M, "results": [{"mm_hash": H1, "nodes":
  [{"node": N, "tiers": {"slab": nbytes, "disk": nbytes}}]}, ...], "nodes": {...}}``
``GET  /v1/nodes`` -> ``{"schema_version": 1, "nodes": {N: {"up": bool, ...}}}``
``GET  /healthz`` -> ``{"ok": true}``
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .schema import SCHEMA_VERSION

log = logging.getLogger("lmcache_ec_broker.events")

MAX_BODY = 1 << 20
# The broker's loop is not serving, or did not answer in time (before Python 3.11,
# concurrent.futures.TimeoutError is not the builtin TimeoutError).
_UNAVAILABLE = (RuntimeError, TimeoutError, concurrent.futures.TimeoutError)
MAX_HASHES = 4096
_SHAPE = 'send {"model": ..., "mm_hashes": [...]}'

# (model, mm_hashes) -> per hash: [{"node": N, "tiers": {tier: nbytes}}]
Answer = Callable[[str, list[str]], list[list[dict[str, Any]]]]
Nodes = Callable[[], dict[str, dict[str, Any]]]


class BadRequest(ValueError):
    pass


def parse_query(model: object, hashes: object) -> tuple[str, list[str]]:
    if not isinstance(model, str) or not model:
        raise BadRequest(
            "'model' must be a non-empty string (the served model or the key's model field)"
        )
    if not isinstance(hashes, list) or not all(isinstance(h, str) and h for h in hashes):
        raise BadRequest("'mm_hashes' must be a list of non-empty strings")
    if len(hashes) > MAX_HASHES:
        raise BadRequest(f"at most {MAX_HASHES} mm_hashes per lookup, got {len(hashes)}; split it")
    return model, hashes


class LookupServer:
    def __init__(self, host: str, port: int, answer: Answer, nodes: Nodes) -> None:
        class Handler(BaseHTTPRequestHandler):
            server_version = "lmcache-ec-lookup"

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("lookup %s: " + fmt, self.client_address[0], *args)

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/healthz":
                    return self._json(200, {"ok": True})
                if url.path == "/v1/nodes":
                    try:
                        known = nodes()
                    except _UNAVAILABLE as exc:
                        return self._json(503, {"error": f"cannot answer now: {exc}"})
                    return self._json(200, {"schema_version": SCHEMA_VERSION, "nodes": known})
                if url.path == "/v1/lookup":
                    q = urllib.parse.parse_qs(url.query)
                    return self._lookup(q.get("model", [""])[0], q.get("mm_hash", []))
                self._json(404, {"error": f"no such path {url.path}; use /v1/lookup or /v1/nodes"})

            def do_POST(self) -> None:
                if urllib.parse.urlsplit(self.path).path != "/v1/lookup":
                    return self._json(404, {"error": "POST only /v1/lookup"})
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    n = -1
                if not 0 < n <= MAX_BODY:
                    return self._json(400, {"error": f"send a JSON body of 1..{MAX_BODY} bytes"})
                try:
                    body = json.loads(self.rfile.read(n))
                except ValueError as exc:
                    return self._json(400, {"error": f"the body is not JSON: {exc}"})
                except RecursionError:  # json's parser recurses per nesting level
                    return self._json(400, {"error": f"the body is nested too deeply; {_SHAPE}"})
                if not isinstance(body, dict):
                    return self._json(400, {"error": _SHAPE})
                self._lookup(body.get("model"), body.get("mm_hashes"))

            def _lookup(self, model: object, hashes: object) -> None:
                try:
                    m, hs = parse_query(model, hashes)
                except BadRequest as exc:
                    return self._json(400, {"error": str(exc)})
                try:
                    found = answer(m, hs)
                    known = nodes()
                except _UNAVAILABLE as exc:
                    return self._json(503, {"error": f"cannot answer now: {exc}"})
                self._json(
                    200,
                    {
                        "schema_version": SCHEMA_VERSION,
                        "model": m,
                        "results": [
                            {"mm_hash": h, "nodes": where}
                            for h, where in zip(hs, found, strict=True)
                        ],
                        "nodes": known,
                    },
                )

            def send_error(
                self, code: int, message: str | None = None, explain: str | None = None
            ) -> None:
                """The base class's errors (a malformed request line, an unsupported
                method or version, oversized headers) as JSON, like every other answer."""
                short, long = self.responses.get(code, ("error", ""))
                self.close_connection = True
                if self.command is None or self.request_version == "HTTP/0.9":
                    # The request line did not parse: answer as HTTP/1.1 all the same,
                    # so the client reads a status and a JSON body, not bare bytes.
                    self.request_version = "HTTP/1.1"
                self._json(code, {"error": message or explain or long or short})

            def _json(self, code: int, obj: object) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="ec-lookup-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
        self._httpd.server_close()
