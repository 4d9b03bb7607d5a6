"""The broker process: entry index and lifecycle, eviction, server loop, disk tier, metrics.

Nothing under this package imports torch.
"""
