"""The broker's clients, in two folders, as vLLM splits its own EC connectors:

- ``client/``: ``BrokerClient`` and its parts (link, session, frames, reads, writes,
  tensor copies). It imports neither vLLM nor, until a tensor is copied, torch.
- ``vllm/``: the vLLM connector (``ECBrokerConnector``): its scheduler side, its
  worker side, the staging link between them, and the key's identity (model field,
  item identifiers).

``plugin.py`` is the entry point vLLM's plugin loader calls; it names
``lmcache_ec_broker.connector.vllm`` (the connector package) without importing it.
"""
