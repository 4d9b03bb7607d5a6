"""The local disk tier: ``tier.py`` (``DiskTier``: bookkeeping on the loop, file I/O on its threads) and ``file.py`` (the file format: one safetensors file per entry)."""
