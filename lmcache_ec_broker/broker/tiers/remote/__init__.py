"""The remote tier, whichever store it runs on. A backend (``../redis``, ``../mooncake``)
brings a transport only; everything else is here:

- the policy: ``policy.py`` (the rules, numbered, and the state) and its parts
  ``ordering.py`` (write-behind, deletes, clears), ``lookups.py`` (lookups, promotion
  reads, fetches) and ``discovery.py`` (key listings, announcements), which declare
  what they call on the policy in ``part.py``; the units of work it asks for, ``jobs.py``;
- the runtime: ``tier.py`` (``RemoteTier``: the policy on the event loop, the transport's
  calls on the tier's threads);
- what a transport must do: ``transport.py``; the value format every store holds:
  ``value.py``; circuit breakers: ``circuit.py``; why a store cannot be reached:
  ``connect_error.py``; the stats names every backend exports: ``stats.py``.
"""
