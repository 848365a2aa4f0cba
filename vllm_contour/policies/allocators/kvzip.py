"""KVzip's allocation: one score threshold across a layer's heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .adakv import AdaKVAllocator


@dataclass
class KVzipAllocator(AdaKVAllocator):
    """KVzip (Kim et al., NeurIPS 2025) keeps every KV pair whose reconstruction score passes one threshold
    across layers and heads, so heads keep different numbers of pairs. Here the threshold is per layer: the
    top of the layer's raw ``[H * region]`` scores (AdaKV's top-k without normalising each head), each head's
    share rounded to whole pages, a page floor per head first. Across layers it cannot save bytes: a block
    holds every layer, so a layer keeping more than the others holds blocks they leave empty."""

    normalise: ClassVar[bool] = False
