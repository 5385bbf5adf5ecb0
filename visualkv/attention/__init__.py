"""Attention VisualKV runs inside a model: packed tiers, blocks after cached entries, batched vision chunks, and
`patched`, the one scoped context through which it changes a model."""

from visualkv.attention.patch import implementation, patched

__all__ = ["implementation", "patched"]
