"""The evicting layers' KV caches as this worker sees them, found once at engine start: each layer's
logical key / value views (on CPU through a probe of vLLM's own cache write: an unknown layout stops the
engine with a message naming dtype and ISA; an fp8 cache's with each layer's byte tables, ``ops.fp8``), the
cache's shape (an fp8 cache's elements are bytes), the one attention scale every layer uses, the
layers' place in the whole model (pipeline stages), and the query heads whose window queries rounds read.
Nothing here changes after start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_contour.budget import CacheShape
from vllm_contour.ops.fp8 import KVViews
from vllm_contour.ops.paged import dims

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class WorkerCaches:
    def __init__(self, vllm_config: "VllmConfig", layer_names: tuple[str, ...] | None = None):
        self.vllm_config = vllm_config
        self.layer_names = layer_names  # the full-attention layers (a hybrid model's others are vLLM's)
        self.named: list[tuple[str, torch.Tensor]] = []  # (layer, its cache), model order
        self.layer_index: dict[str, int] = {}  # the evicting layers, by name
        self.views: KVViews | None = None
        self.shape: CacheShape | None = None
        self.dims: tuple[int, int, int, int] | None = None  # (blocks, KV heads, block size, head dim)
        self.stage_layers: tuple[int, int] | None = None  # (first layer, model layers) of this pipeline stage
        self.query_shape: tuple[int, int, torch.dtype] | None = None  # (query heads, head dim, dtype)
        self._scale: float | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The checks eviction needs of the caches (raises, stopping the engine, when it cannot run here)."""
        from vllm.model_executor.models.utils import extract_layer_index

        named = sorted(((n, kv) for n, kv in kv_caches.items() if self.layer_names is None or n in self.layer_names),
                       key=lambda kv: extract_layer_index(kv[0]))
        self.named = named
        self.layer_index = {name: i for i, (name, _) in enumerate(named)}
        layer = next(iter(self.layers().values()))
        make_views = getattr(layer.impl, "kv_views", None)
        if make_views is None:
            raise ValueError("kv_eviction: the attention backend in use is not the plugin's (another "
                             "--attention-backend?); eviction cannot run")
        views = [make_views(kv) for _, kv in named]
        dequant = None
        if views[0][0].dtype == torch.uint8:  # an fp8 cache: each layer's tables (its scales)
            layers = self.layers()
            dequant = [layers[n].impl.kv_dequant(layers[n], kv) for n, kv in named]
            if any(d is None for d in dequant):
                raise ValueError("kv_eviction: this attention backend reads no fp8 pages; eviction cannot run on "
                                 "this --kv-cache-dtype")
        self.views = KVViews(views, dequant)
        k0 = self.views[0][0]
        self.dims = dims(k0)
        _, heads, bs, hd = self.dims
        self.shape = CacheShape.of(block_size=bs, num_kv_heads=heads, head_dim=hd, dtype=k0.dtype)
        self.scale()  # layers with different attention scales cannot share one round: stop here
        # a pipeline stage's layers are a slice of the model's: depth-dependent policies see the whole model
        # (a hybrid model's evicting layers are a subset of every stage's: they count among themselves)
        total = getattr(self.vllm_config.model_config.hf_text_config, "num_hidden_layers", None) or len(named)
        first = extract_layer_index(named[0][0])
        self.stage_layers = (0, len(named)) if len(named) < len(kv_caches) else (first, max(total, first + len(named)))
        self.query_shape = (layer.impl.num_heads, hd, self.vllm_config.model_config.dtype)

    def layers(self):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        return get_layers_from_vllm_config(self.vllm_config, Attention, [n for n, _ in self.named])

    def scale(self) -> float:
        if self._scale is None:
            scales = {float(layer.impl.scale) for layer in self.layers().values()}
            if len(scales) != 1:
                raise ValueError(f"kv_eviction: layers use different attention scales {scales}")
            self._scale = scales.pop()
        return self._scale

    def outside_pool_bound(self, policy) -> int:
        """Most bytes captured queries of ``policy`` take outside vLLM's pool. Windows that span steps go into
        blocks of the pool as their tokens are computed; a window computed whole in one step (a prompt's end)
        is kept for that step's round, and a reconstruction policy's hidden requests keep their step's repeat
        queries until after the forward: at most the step's tokens, every layer. A query-free policy keeps
        none."""
        if not (policy.needs_queries or policy.needs_reconstruction):
            return 0
        hq, hd, dtype = self.query_shape
        tokens = self.vllm_config.scheduler_config.max_num_batched_tokens
        return len(self.named) * tokens * hq * hd * dtype.itemsize
