"""The attention backends with eviction: vLLM's own kernel for every ordinary row, ours for compacted ones.

One row logic for every platform (``ContourBuilder`` / ``ContourImpl``, mixed into a platform's vLLM
builder and impl classes; ``platforms.py`` says which). With eviction off the backend hands out vLLM's own
builder and impl classes unchanged, so the stock path is byte-identical. With eviction on:
- the builder of the evicting KV cache group matches the step's batch rows to the compacted requests and
  the captures (``PageTables.step``: tensor ops, nothing waits for the device), gives compacted rows a
  harmless context for the stock kernel, and leaves what it found in the worker state;
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
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_contour import ops
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.state import StepAttention, worker_state
from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views, probe_layout
from vllm_contour.page_tables import RowError

logger = init_logger("vllm.contour")


def eviction_enabled() -> bool:
    """Under vLLM's config: its eviction settings. Outside (vLLM asks for the layers' KV cache specs after
    the model is built, with no config set): what the impls recorded when the model was built."""
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return worker_state().evicting
    try:
        return EvictionConfig.from_additional_config(cfg.additional_config).enabled
    except Exception:
        return False


class ContourBackend:
    """Mixed in before a vLLM attention backend: with eviction on, its full-attention layers get the spec
    whose KV cache group vLLM's registry hands to the plugin's block-table manager (``manager.py``)."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        if not eviction_enabled():
            return spec
        from vllm_contour.integration.manager import evicting_spec

        return evicting_spec(spec)


class ContourBuilder:
    """Mixed in before a vLLM metadata builder: ``build`` as vLLM's, plus the step's compacted rows."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        st = worker_state()
        mine = bool(self.layer_names) and self.layer_names[0] in st.layer_index  # the evicting group
        if mine:
            st.step = None
            try:
                cm = self._contour_step(cm)
            except Exception as e:  # never into vLLM: the step runs as stock for every row
                logger.warning("kv_eviction: metadata for compacted rows failed (%s)", e)
                for req_id in (e.req_ids if isinstance(e, RowError) else st.step_reqs):
                    st.forward_errors[req_id] = f"metadata: {e}"
                st.step, cm = None, common_attn_metadata
        return super().build(common_prefix_len, cm, fast_build)

    def _contour_step(self, cm):
        st = worker_state()
        if st.tables is None or not (st.step_reqs or st.captures):
            return cm
        qsl_cpu = cm.query_start_loc_cpu
        rows, cap = st.tables.step(st.step_reqs, cm.query_start_loc, cm.seq_lens, cm.block_table_tensor,
                                   cm.num_reqs, int(qsl_cpu[cm.num_reqs]), int(cm.max_seq_len))
        if rows is not None and rows.block_table.device.type == "cpu":
            rows.tables_for_cpu()  # on the host: expanded once here, a bad row fails before the forward
        st.step = StepAttention(rows, cap)
        if rows is not None:
            cm = cm.replace(seq_lens=rows.stock_seq_lens(cm.seq_lens))
        return cm


class ContourImpl:
    """Mixed in before a vLLM attention impl: ``forward`` as vLLM's, then the compacted tokens and the
    captures. ``kv_views(kv_cache)`` gives the layer's ``[B, H, bs, D]`` key / value views."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        worker_state().evicting = eviction_enabled()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        st = worker_state()
        step = st.step
        layer_idx = None if attn_metadata is None or step is None else st.layer_index.get(layer.layer_name)
        if layer_idx is None or step.rows is None or output_scale is not None or output_block_scale is not None \
                or not self._compacted_only(step.rows, attn_metadata):
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
        if layer_idx is None:
            return output
        q3 = query.view(query.shape[0], self.num_heads, self.head_size)
        if step.capture is not None:
            try:
                self._stage(q3, step.capture, layer_idx)
            except Exception as e:
                logger.warning("kv_eviction: could not capture window queries (%s)", e)
        if step.rows is not None:
            self._compacted(q3, kv_cache, step.rows, layer_idx, output)
        return output

    @staticmethod
    def _compacted_only(rows, attn_metadata) -> bool:
        """True when every token of the step is a compacted request's and vLLM's forward does nothing else
        than attention (its KV writes run apart): the compacted attention then writes every output row and
        vLLM's kernel is not run. False here (vLLM's forward always runs); backends override it."""
        return False

    @staticmethod
    def _stage(q3, cap, layer_idx: int) -> None:
        n = cap.dst.numel()
        buf = q3.new_zeros((cap.total + 1, *q3.shape[1:]))
        buf.index_copy_(0, cap.dst, q3[:n])
        worker_state().staged[layer_idx] = buf[: cap.total]

    def _layer_views(self, kv_cache):
        """``kv_views(kv_cache)``, built once per cache tensor (the layer's impl keeps the last one)."""
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        cached = getattr(self, "_contour_views", None)
        if cached is None or cached[0] != key:
            cached = self._contour_views = (key, self.kv_views(kv_cache))
        return cached[1]

    def _compacted(self, q3, kv_cache, rows, layer_idx: int, output) -> None:
        st = worker_state()
        key_cache, value_cache = self._layer_views(kv_cache)
        n = rows.num_tokens
        out3 = output[:n].view(n, self.num_heads, self.head_size)
        last = None
        for impl in (None, "torch"):  # the best implementation, then the reference
            try:
                moments = None
                if rows.with_moments:
                    h = key_cache.shape[1]
                    moments = ops.load_moments(key_cache, value_cache,
                                               rows.moment_pages[:, layer_idx].to(torch.int64), h, self.head_size)
                    keep = rows.has_moments
                    moments = {k: torch.where(keep.view(-1, *([1] * (v.dim() - 1))), v, torch.zeros_like(v))
                               for k, v in moments.items()}
                ops.compacted_attention(q3[:n], key_cache, value_cache, rows, layer_idx, self.scale,
                                        moments=moments, out=out3, impl=impl, native=True)
                return
            except Exception as e:
                last = e
                if impl is None:
                    logger.warning("kv_eviction: compacted attention failed (%s); retrying with the torch "
                                   "reference", e)
        for req_id in rows.req_ids:
            st.forward_errors[req_id] = f"ragged decode: {last}"


# ------------------------------------------------------------------------------------------------- CPU
def layer_layout(kv_cache: torch.Tensor, scramble: bool = False) -> PageLayout:
    """The page layout vLLM's CPU attention writes into this cache (its ISA for the cache's dtype, block
    size and head dim), probed once per combination (``cpu_layout.probe_layout``; ``scramble``: the
    test-only fault switch's unknown layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, bs, two_d = kv_cache.shape
    d = two_d // 2
    return probe_layout(_get_attn_isa(kv_cache.dtype, bs, d), kv_cache.dtype, bs, d, scramble)


def layer_kv_views(kv_cache: torch.Tensor, scramble: bool = False):
    """Logical key/value views of one layer's CPU cache (``[B, H, bs, D]``, or the two-level form of
    packed layouts, see ``ops.paged``)."""
    return cpu_kv_views(kv_cache, layer_layout(kv_cache, scramble))


class ContourCPUMetadataBuilder(ContourBuilder, CPUAttentionMetadataBuilder):
    pass


class ContourCPUAttentionImpl(ContourImpl, CPUAttentionBackendImpl):
    kv_views = staticmethod(layer_kv_views)

    @staticmethod
    def _compacted_only(rows, attn_metadata) -> bool:
        # vLLM's CPU forward of decoder attention is its kernel alone when the backend declares its KV writes
        # apart (do_kv_cache_update); the span is known on the host, from the tables the builder expanded
        if CPUAttentionBackend.forward_includes_kv_cache_update:
            return False
        try:
            return rows.compacted_span() == (0, attn_metadata.num_actual_tokens)
        except Exception:  # never into vLLM: its kernel runs
            return False


class ContourCPUAttentionBackend(ContourBackend, CPUAttentionBackend):
    """Registered over ``CPU_ATTN``."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return ContourCPUAttentionImpl if eviction_enabled() else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return ContourCPUMetadataBuilder if eviction_enabled() else CPUAttentionMetadataBuilder
