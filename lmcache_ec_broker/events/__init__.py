"""Encoder-cache residency events and lookup (docs/events.md).

A broker publishes which inputs it holds, on which tier, over ZMQ in vLLM's
KV-event conventions (``publisher.py``), answers lookups for itself
(``lookup_http.py``), and an aggregator subscribes to many brokers and answers
for the fleet (``aggregator.py``). ``pyzmq`` is imported only where a socket is
opened (the ``events`` extra).
"""
