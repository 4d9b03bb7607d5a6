"""The remote tier's transport on Redis / Valkey (standalone or Cluster): ``transport.py``
wires it (``RedisTransport``, ``RedisTier``); ``value_rules.py`` (what a value read back
must be), ``link.py`` (pooled round trips, Cluster routing), ``loop.py`` (the calls on
the event loop), ``keys.py`` (SCAN, clear), ``announce.py`` (announcements between
brokers); RESP itself in ``resp.py`` (threads), ``resp_async.py`` (the event loop) and
``resp_wire.py`` (the grammar both share)."""
