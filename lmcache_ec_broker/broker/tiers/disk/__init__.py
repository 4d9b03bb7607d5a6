"""The local disk tier: ``tier.py`` (``DiskTier``: bookkeeping on the event loop, file
I/O on its own threads) and ``file.py`` (the file format: one safetensors file per
entry, written and read straight from and into the slab)."""
