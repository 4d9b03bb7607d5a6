"""Which of vLLM's item identifiers may key a shared entry (issue 39).

An entry is served only to an instance that would have computed the same bytes, so
the item part of a key must name the item's *content*. vLLM's identifier
(``MultiModalFeatureSpec.identifier``) is not always that:

- **Numbered items.** With ``--mm-processor-cache-gb 0`` and prefix caching off,
  vLLM 0.32/0.33 does not hash items: ``BaseRenderer._process_mm_uuids`` names
  them ``renderer<rank>-mm-<request counter>-<modality>-<index>``, a counter that
  restarts with every instance. With per-request processor kwargs that name is
  then hashed (``ProcessorInputs.get_mm_hashes``): a hex string that still names a
  counter, not the content. So in that configuration *no* identifier is content:
  nothing is looked up or stored (one warning at start names the settings).
  Identifiers of the numbered form are refused in every configuration too.
- **Client UUIDs** (``multi_modal_uuids``): used verbatim when the request has no
  processor kwargs. They are the client's word, not a hash, and persistent
  fleet-wide keys one tenant could choose to meet another's. Never shared unless
  ``client_uuid_namespace`` is set in the connector's extra config; then they are
  keyed as ``uuid.<sha256(namespace, uuid)[:32]>`` (the model field already
  separates configurations): only instances configured with the same namespace
  meet.
- **Tower/connector LoRA** (``enable_tower_connector_lora``): vLLM prefixes the
  identifier with the adapter's *name* (``name:hash``); a name says nothing about
  the adapter's weights: never shared.

What is a content hash is decided by form: vLLM's hasher writes the lowercase hex
digest of ``--mm-hasher-algorithm`` (64 digits for blake3 and sha256, 128 for
sha512). Anything else is a client UUID (or numbered). A client UUID that imitates
a content hash of the right length cannot be told apart by form: deployments that
take ``multi_modal_uuids`` from untrusted clients should strip them at the gateway
(docs/vllm.md, "Keys").

Cost: one ``re.fullmatch`` per new identifier (about 1 us on the loaded 2-core test
host), then a memoised answer (~0.1 us) where it enters a lookup or a store;
nothing per step.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from typing import Any

# vLLM's own name for an item it did not hash (renderers/base.py, 0.32 and 0.33).
NUMBERED = re.compile(r"renderer\d+-mm-\d+-[A-Za-z_]+-\d+")
DIGEST_HEX = {"blake3": 64, "sha256": 64, "sha512": 128}
UUID_KEY_HEX = 32
MEMO = 8192  # identifiers memoised per connector


def numbering_reason(vllm_config: Any) -> str:
    """Why this configuration makes vLLM number items instead of hashing them; ""
    if it hashes them."""
    model_config = getattr(vllm_config, "model_config", None)
    mm = getattr(model_config, "multimodal_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    if mm is None or cache is None:
        return ""
    if getattr(mm, "mm_processor_cache_gb", None) == 0 and not getattr(
        cache, "enable_prefix_caching", False
    ):
        return (
            "--mm-processor-cache-gb 0 with prefix caching off: vLLM numbers multimodal "
            "items per instance instead of hashing their content"
        )
    return ""


class IdentifierPolicy:
    """Maps a vLLM item identifier to the item part of a broker key, or None where the
    identifier must never be shared (module doc). Built once per connector; answers
    from its configuration and the identifier's form only."""

    def __init__(
        self,
        vllm_config: Any,
        client_uuid_namespace: str | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        mm = getattr(getattr(vllm_config, "model_config", None), "multimodal_config", None)
        algorithm = str(getattr(mm, "mm_hasher_algorithm", "blake3") or "blake3")
        self._hex = re.compile(f"[0-9a-f]{{{DIGEST_HEX.get(algorithm, 64)}}}")
        lora = getattr(vllm_config, "lora_config", None)
        self._tower_lora = bool(getattr(lora, "enable_tower_connector_lora", False))
        self.numbering = numbering_reason(vllm_config)
        if client_uuid_namespace is not None:
            client_uuid_namespace = check_namespace(client_uuid_namespace)
        self._namespace = client_uuid_namespace
        # The hooks ask about one item several times per step: memoised (bounded).
        memo = functools.lru_cache(maxsize=MEMO)(self._item_key)
        self.item_key = memo  # type: ignore[method-assign]
        if self.numbering and log is not None:
            log.warning(
                "EC broker: %s, so no item identifier names its content; nothing is looked up "
                "or stored. To share encoder outputs, set --mm-processor-cache-gb above 0 or "
                "enable prefix caching (--enable-prefix-caching)",
                self.numbering,
            )

    @property
    def shares_nothing(self) -> bool:
        return bool(self.numbering)

    def item_key(self, identifier: str) -> str | None:  # replaced per instance (memo)
        return self._item_key(identifier)

    def _item_key(self, identifier: str) -> str | None:
        """The item part of the key for ``identifier``; None: never looked up nor stored."""
        if self.numbering:
            return None
        if self._hex.fullmatch(identifier):
            return identifier  # vLLM's content hash
        if self._tower_lora and ":" in identifier:
            return None  # "<adapter name>:<hash>"
        if self._namespace is None or NUMBERED.fullmatch(identifier):
            return None  # a client UUID (not shared by default) or a numbered item
        digest = hashlib.sha256(
            f"lmcache-ec-uuid-v1\0{self._namespace}\0{identifier}".encode()
        ).hexdigest()
        return f"uuid.{digest[:UUID_KEY_HEX]}"


def check_namespace(value: object) -> str:
    """``client_uuid_namespace``: a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            "ec_connector_extra_config client_uuid_namespace must be a non-empty string "
            f"naming who may share client multi_modal_uuids (a tenant), got {value!r}"
        )
    return value
