"""The row logic every platform's attention backend shares (``ContourBuilder`` / ``ContourImpl``, mixed in
before a platform's vLLM builder and impl classes). With eviction off the backend hands out vLLM's own
builder and impl classes unchanged, so the stock path is byte-identical. With eviction on, a step's data
goes builder -> metadata -> impl, as in vLLM's backends:
- the builder of the evicting KV cache group makes the step (``worker/step.py``) from the batch, gives
  compacted rows a short context for vLLM's kernel, and returns vLLM's metadata carrying the step;
- the impl runs vLLM's kernel, then overwrites the compacted tokens' outputs with ``ops.compacted_attention``
  (each token reads its request's kept run and then its dense tail up to its own position: a step of
  several tokens on a compacted request is causal) and stages the captured window queries.
A compacted row whose metadata or attention fails (and the torch reference after it) is reported: the
plugin's scheduler finishes that request with an error; nothing raises.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger

from vllm_contour import ops
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.worker.step import ContourStep, StepField, with_step

logger = init_logger("vllm.contour")

# Whether this process's model evicts: the impls record it when the model is built (under vLLM's config);
# vLLM asks the backend for the layers' KV cache specs later, with no config set and before the KV
# connector exists. One fact, for the process's life.
_EVICTING = [False]


def eviction_enabled() -> bool:
    """Under vLLM's config: its eviction settings. Outside: what the impls recorded when the model was built."""
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return _EVICTING[0]
    try:
        return EvictionConfig.from_additional_config(cfg.additional_config).enabled
    except Exception:
        return False


def contour_worker():
    """This process's worker side (``worker/side.py``), owned by the plugin's KV connector; None where no
    connector is active (eviction off, or vLLM's dummy and profile runs, when it disables the connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from vllm_contour.integration.connector import ContourKVConnector

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn.worker_side if isinstance(conn, ContourKVConnector) else None


class ContourBackend:
    """Mixed in before a vLLM attention backend: with eviction on, its full-attention layers get the spec
    whose KV cache group vLLM's registry hands to the plugin's block-table manager (``manager.py``)."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        if not eviction_enabled():
            return spec
        from vllm_contour.integration.scheduler.manager import evicting_spec

        return evicting_spec(spec)


class ContourBuilder:
    """Mixed in before a vLLM metadata builder: ``build`` as vLLM's, returning its metadata as
    ``metadata_cls`` (vLLM's class with ``StepField``) carrying the step of the evicting group."""

    metadata_cls: type  # set by each platform

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        worker = contour_worker()
        step = None
        if worker is not None and self.layer_names and self.layer_names[0] in worker.layer_index:
            try:
                step = worker.new_step(cm)
                lens = step.stock_seq_lens(cm.seq_lens)
                if lens is not None:
                    cm = cm.replace(seq_lens=lens)
            except Exception as e:  # never into vLLM: the step runs as stock for every row
                logger.warning("kv_eviction: metadata for compacted rows failed (%s)", e)
                worker.metadata_failed(f"metadata: {e}")
                step, cm = None, common_attn_metadata
        md = super().build(common_prefix_len, cm, fast_build)
        return with_step(self.metadata_cls, md, step)


class ContourImpl:
    """Mixed in before a vLLM attention impl: ``forward`` as vLLM's, then the compacted tokens and the
    captures. ``kv_views(kv_cache)`` gives the layer's ``[B, H, bs, D]`` key / value views, ``kv_dequant(layer,
    kv_cache)`` how an fp8 cache's bytes read (``ops.fp8.KVDequant``; None: the elements are numbers)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _EVICTING[0] = eviction_enabled()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        step = attn_metadata.contour if isinstance(attn_metadata, StepField) else None
        layer_idx = None if step is None else step.layer(layer.layer_name)
        rows = cap = None
        if layer_idx is not None:
            rows, cap = step.resolve()
        if rows is None or output_scale is not None or output_block_scale is not None \
                or not self._compacted_only(rows, attn_metadata):
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
        if layer_idx is None:
            return output
        q3 = query.view(query.shape[0], self.num_heads, self.head_size)
        if cap is not None:
            try:
                step.stage(layer_idx, q3, *self._layer_views(kv_cache))
            except Exception as e:
                logger.warning("kv_eviction: could not capture window queries (%s)", e)
        if rows is not None:
            self._compacted(q3, kv_cache, step, rows, layer_idx, output, layer)
        return output

    def kv_dequant(self, layer, kv_cache):
        return None

    @staticmethod
    def _compacted_only(rows, attn_metadata) -> bool:
        """True when every token of the step is a compacted request's and vLLM's forward does nothing else
        than attention (its KV writes run apart): the compacted attention then writes every output row and
        vLLM's kernel is not run. False here (vLLM's forward always runs); backends override it."""
        return False

    def _layer_views(self, kv_cache):
        """``kv_views(kv_cache)``, built once per cache tensor (the layer's impl keeps the last one)."""
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        cached = getattr(self, "_contour_views", None)
        if cached is None or cached[0] != key:
            cached = self._contour_views = (key, self.kv_views(kv_cache))
        return cached[1]

    def _compacted(self, q3, kv_cache, step: ContourStep, rows, layer_idx: int, output, layer=None) -> None:
        key_cache, value_cache = self._layer_views(kv_cache)
        n = rows.num_tokens
        out3 = output[:n].view(n, self.num_heads, self.head_size)
        last = None
        for impl in (None, "torch"):  # the best implementation, then the reference
            try:
                dq = self.kv_dequant(layer, kv_cache)
                fp8 = {} if dq is None else {"dequant": dq}
                moments = None
                if rows.with_moments:
                    h = key_cache.shape[1]
                    moments = ops.load_moments(key_cache, value_cache,
                                               rows.moment_pages[:, layer_idx].to(torch.int64), h, self.head_size)
                    keep = rows.has_moments
                    moments = {k: torch.where(keep.view(-1, *([1] * (v.dim() - 1))), v, torch.zeros_like(v))
                               for k, v in moments.items()}
                ops.compacted_attention(q3[:n], key_cache, value_cache, rows, layer_idx, self.scale,
                                        moments=moments, out=out3, impl=impl, native=True, **fp8)
                return
            except Exception as e:
                last = e
                if impl is None:
                    logger.warning("kv_eviction: compacted attention failed (%s); retrying with the torch "
                                   "reference", e)
        step.fail(rows.req_ids, f"ragged decode: {last}")
