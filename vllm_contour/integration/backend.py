"""CPU attention backend override: stock behaviour for ordinary rows, ragged decode for compacted ones.

Registered over ``CPU_ATTN`` by the plugin. With eviction off it hands out vLLM's own builder and impl
classes unchanged, so the stock path is byte-identical.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_contour import ops
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.state import CaptureRows, DecodeRows, worker_state
from vllm_contour.evictor import read_moments
from vllm_contour.layout import decode_page_table
from vllm_contour.ops.cpu_layout import cpu_kv_views, detect_key_layout


def layer_kv_views(kv_cache: torch.Tensor):
    """Logical [B, H, bs, D] key/value views of one layer's CPU cache (key layout probed once)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, _, bs, two_d = kv_cache.shape
    d = two_d // 2
    isa = _get_attn_isa(kv_cache.dtype, bs, d)
    return cpu_kv_views(kv_cache, detect_key_layout(isa, kv_cache.dtype, bs, d))


def _eviction_enabled() -> bool:
    try:
        cfg = get_current_vllm_config()
    except Exception:
        return False
    return EvictionConfig.from_additional_config(cfg.additional_config).enabled


class ContourCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return ContourCPUAttentionImpl if _eviction_enabled() else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return ContourCPUMetadataBuilder if _eviction_enabled() else CPUAttentionMetadataBuilder


class ContourCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        st = worker_state()
        cm = common_attn_metadata
        n = cm.num_reqs
        decode_rows = None
        capture = None
        if st.compacted or st.key_to_capture:
            first_blocks = cm.block_table_tensor[:n, 0].tolist()
            qsl = cm.query_start_loc_cpu if hasattr(cm, "query_start_loc_cpu") else cm.query_start_loc
            qsl = qsl[: n + 1].tolist()
            seq_lens = cm.seq_lens[:n].tolist()
            rows, entries = [], []
            for r, key in enumerate(first_blocks):
                req_id = st.key_to_req.get(key)
                if req_id is not None:
                    rows.append((r, req_id))
                    continue
                cap = st.key_to_capture.get(key)
                if cap is not None:
                    q_len = qsl[r + 1] - qsl[r]
                    first_pos = seq_lens[r] - q_len  # positions of this row: [first_pos, seq_len)
                    a, b = max(cap.start, first_pos), min(cap.end, seq_lens[r])
                    if a < b:
                        entries.append((cap.req_id, qsl[r] + (a - first_pos), b - a, a))
            if entries:
                capture = CaptureRows(entries)
            if rows:
                decode_rows = self._decode_rows(rows, cm, qsl, seq_lens)
                new_seq = cm.seq_lens.clone()
                idx = torch.tensor([r for r, _ in rows], dtype=torch.int64)
                # The stock kernel still runs over the whole batch; give compacted rows a harmless
                # one-token context (slot 0 of their kept block 0) and overwrite their output later.
                new_seq[idx] = 1
                cm = cm.replace(seq_lens=new_seq)
        md = super().build(common_prefix_len, cm, fast_build)
        md.contour_decode = decode_rows
        md.contour_capture = capture
        return md

    def _decode_rows(self, rows, cm, qsl, seq_lens) -> DecodeRows:
        st = worker_state()
        bs = self.block_size
        tables, lens, row_idx, tok_idx = [], [], [], []
        for r, req_id in rows:
            c = st.compacted[req_id]
            if qsl[r + 1] - qsl[r] != 1:
                raise RuntimeError(f"compacted request {req_id} scheduled {qsl[r + 1] - qsl[r]} tokens; "
                                   "only single-token decode steps are supported after eviction")
            e = c.region_blocks
            tail_tokens = seq_lens[r] - e * bs
            n_tail = (tail_tokens + bs - 1) // bs
            tail_blocks = cm.block_table_tensor[r, e : e + n_tail].tolist()
            t, s = decode_page_table(c.layout, tail_blocks, tail_tokens)
            tables.append(t)
            lens.append(s)
            row_idx.append(r)
            tok_idx.append(qsl[r])
        width = max(t.shape[2] for t in tables)
        num_layers, h = tables[0].shape[:2]
        page_table = torch.zeros((num_layers, len(rows), h, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            page_table[:, i, :, : t.shape[2]] = t
            if t.shape[2] < width:  # pad with a valid page id (masked by seq_lens)
                page_table[:, i, :, t.shape[2]:] = t[:, :, :1]
        moment_pages = has_moments = None
        lays = [st.compacted[req_id].layout for _, req_id in rows]
        if any(lay.moment_page_ids is not None for lay in lays):
            m = max(lay.moment_page_ids.shape[1] for lay in lays if lay.moment_page_ids is not None)
            moment_pages = torch.zeros((num_layers, len(rows), m), dtype=torch.int32)
            has_moments = torch.zeros(len(rows), dtype=torch.bool)
            for i, lay in enumerate(lays):
                if lay.moment_page_ids is None:
                    moment_pages[:, i] = page_table[:, i, 0, :1]
                else:
                    mp = lay.moment_page_ids
                    moment_pages[:, i, : mp.shape[1]] = mp
                    moment_pages[:, i, mp.shape[1]:] = mp[:, :1]
                    has_moments[i] = True
        return DecodeRows(rows=torch.tensor(row_idx), token_idx=torch.tensor(tok_idx),
                          page_table=page_table, seq_lens=torch.stack(lens, dim=1),
                          moment_pages=moment_pages, has_moments=has_moments)


class ContourCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        if attn_metadata is None:
            return out
        capture = getattr(attn_metadata, "contour_capture", None)
        decode = getattr(attn_metadata, "contour_decode", None)
        if capture is None and decode is None:
            return out
        st = worker_state()
        layer_idx = st.layer_index[layer.layer_name]
        q3 = query.view(query.shape[0], self.num_heads, self.head_size)
        if capture is not None:
            for req_id, start, n, pos0 in capture.entries:
                cap = st.captures.get(req_id)
                if cap is None:
                    continue
                cap.queries.setdefault(layer_idx, []).append(q3[start : start + n].permute(1, 0, 2).clone())
                if layer_idx == 0:
                    cap.positions.append(torch.arange(pos0, pos0 + n))
        if decode is not None:
            key_cache, value_cache = layer_kv_views(kv_cache)
            q = q3[decode.token_idx]
            moments = None
            if decode.moment_pages is not None:
                h = key_cache.shape[1]
                moments = read_moments(key_cache, decode.moment_pages[layer_idx], h, self.head_size)
                keep = decode.has_moments
                moments = {k: torch.where(keep.view(-1, *([1] * (v.dim() - 1))), v, torch.zeros_like(v))
                           for k, v in moments.items()}
            o, _ = ops.ragged_decode_attention(q, key_cache, value_cache, decode.page_table[layer_idx],
                                               decode.seq_lens[layer_idx], self.scale, moments=moments,
                                               native=True)
            out3 = output.view(output.shape[0], self.num_heads, self.head_size)
            out3[decode.token_idx] = o.to(out3.dtype)
        return out
