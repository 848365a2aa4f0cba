"""CPU attention backend override: stock behaviour for ordinary rows, ragged decode for compacted ones.

Registered over ``CPU_ATTN`` by the plugin. With eviction off it hands out vLLM's own builder and impl
classes unchanged, so the stock path is byte-identical. With eviction on:
- the builder finds the batch rows of compacted requests (by the block of their first new token, see
  ``state.py``), gives them a harmless
  context for the stock kernel and builds their per-layer page tables (kept run ++ dense tail), one ragged
  row per query token: a step of several tokens on a compacted request (the rest of a prompt after its
  context was compressed, a later chunk) is causal because token i's row ends at its own position; it also
  lists the query tokens whose window queries a coming round needs;
- the impl runs vLLM's kernel, then overwrites the compacted rows' outputs with the ragged decode op and
  stages the listed queries.
A compacted row whose page table cannot be built, or whose ragged op fails (and the torch reference after
it), is reported: the plugin's scheduler finishes that request with an error; nothing raises.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_contour import ops
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.state import CaptureRows, DecodeRows, worker_state
from vllm_contour.layout import decode_page_table
from vllm_contour.ops.cpu_layout import PageLayout, cpu_kv_views, probe_layout

logger = init_logger("vllm.contour")


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
        cm = common_attn_metadata
        decode_rows = capture = None
        try:
            decode_rows, capture, cm = self._contour_rows(cm)
        except Exception as e:  # never into vLLM: the step runs as stock for every row
            logger.warning("kv_eviction: metadata for compacted rows failed (%s)", e)
            st = worker_state()
            for req_id in st.compacted():
                st.forward_errors[req_id] = f"metadata: {e}"
            decode_rows = capture = None
            cm = common_attn_metadata
        md = super().build(common_prefix_len, cm, fast_build)
        md.contour_decode = decode_rows
        md.contour_capture = capture
        return md

    def _contour_rows(self, cm):
        st = worker_state()
        if not st.step_keys:
            return None, None, cm
        n = cm.num_reqs
        bs = self.block_size
        qsl = cm.query_start_loc_cpu if hasattr(cm, "query_start_loc_cpu") else cm.query_start_loc
        qsl = qsl[: n + 1].tolist()
        seq_lens = cm.seq_lens[:n].tolist()
        # each row's key: the block that receives its first new token (one request's own block)
        first_pos = [seq_lens[r] - (qsl[r + 1] - qsl[r]) for r in range(n)]
        width = cm.block_table_tensor.shape[1]
        cols = torch.tensor([min(p // bs, width - 1) for p in first_pos], dtype=torch.int64)
        keys = cm.block_table_tensor[torch.arange(n), cols].tolist() if n else []
        rows, cap_idx, owners = [], [], []
        for r, key in enumerate(keys):
            req_id = st.step_keys.get(key)
            if req_id is None:
                continue
            cap = st.captures.get(req_id)
            if cap is not None:  # positions of this row: [first_pos, seq_len)
                a, b = max(cap.start, first_pos[r]), min(cap.end, seq_lens[r])
                if a < b:
                    owners.append((cap.req_id, len(cap_idx), b - a, a))
                    cap_idx.extend(range(qsl[r] + (a - first_pos[r]), qsl[r] + (b - first_pos[r])))
            rs = st.requests.get(req_id)
            if rs is not None and rs.layout is not None:
                rows.append((r, req_id))
        capture = CaptureRows(torch.tensor(cap_idx, dtype=torch.int64), owners) if owners else None
        decode_rows = None
        if rows:
            decode_rows = self._decode_rows(rows, cm, qsl, seq_lens)
            if decode_rows is not None:
                new_seq = cm.seq_lens.clone()
                # The stock kernel still runs over the whole batch; give compacted rows a harmless context
                # as long as their query (the first slots of their own blocks) and overwrite their output.
                q_lens = torch.tensor([qsl[r + 1] - qsl[r] for r in decode_rows.rows.tolist()], dtype=new_seq.dtype)
                new_seq[decode_rows.rows] = q_lens.to(new_seq.device)
                cm = cm.replace(seq_lens=new_seq)
        return decode_rows, capture, cm

    def _decode_rows(self, rows, cm, qsl, seq_lens) -> DecodeRows | None:
        st = worker_state()
        bs = self.block_size
        tables, lens, row_idx, tok_idx, req_ids = [], [], [], [], []
        for r, req_id in rows:
            try:
                lay = st.requests[req_id].layout
                q_len = qsl[r + 1] - qsl[r]
                e = lay.region_blocks
                tail_tokens = seq_lens[r] - e * bs
                if tail_tokens < q_len:
                    raise RuntimeError(f"sequence of {seq_lens[r]} tokens with {q_len} new ones reaches into its "
                                       "compacted region")
                n_tail = (tail_tokens + bs - 1) // bs
                tail_blocks = cm.block_table_tensor[r, e : e + n_tail].tolist()
                t, s = decode_page_table(lay, tail_blocks, tail_tokens)
            except Exception as e:
                st.forward_errors[req_id] = f"metadata: {e}"
                continue
            for i in range(q_len):  # token i sees the kept run and the tail up to its own position
                tables.append(t)
                lens.append(s - (q_len - 1 - i))
                tok_idx.append(qsl[r] + i)
                req_ids.append(req_id)
            row_idx.append(r)
        if not tables:
            return None
        width = max(t.shape[2] for t in tables)
        num_layers, h = tables[0].shape[:2]
        page_table = torch.zeros((num_layers, len(tables), h, width), dtype=torch.int32)
        for i, t in enumerate(tables):
            page_table[:, i, :, : t.shape[2]] = t
            if t.shape[2] < width:  # pad with a valid page id (masked by seq_lens)
                page_table[:, i, :, t.shape[2]:] = t[:, :, :1]
        moment_pages = has_moments = None
        lays = [st.requests[req_id].layout for req_id in req_ids]  # one per query token
        if any(lay.moment_page_ids is not None for lay in lays):
            m = max(lay.moment_page_ids.shape[1] for lay in lays if lay.moment_page_ids is not None)
            moment_pages = torch.zeros((num_layers, len(lays), m), dtype=torch.int32)
            has_moments = torch.zeros(len(lays), dtype=torch.bool)
            for i, lay in enumerate(lays):
                if lay.moment_page_ids is None:
                    moment_pages[:, i] = page_table[:, i, 0, :1]
                else:
                    mp = lay.moment_page_ids
                    moment_pages[:, i, : mp.shape[1]] = mp
                    moment_pages[:, i, mp.shape[1]:] = mp[:, :1]
                    has_moments[i] = True
        return DecodeRows(rows=torch.tensor(row_idx), token_idx=torch.tensor(tok_idx), req_ids=req_ids,
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
            try:
                st.staged[layer_idx] = q3[capture.token_idx].clone()
                st.staged_rows = capture
            except Exception as e:
                logger.warning("kv_eviction: could not capture window queries (%s)", e)
        if decode is not None:
            self._ragged(q3, kv_cache, decode, layer_idx, output)
        return out

    def _ragged(self, q3, kv_cache, decode: DecodeRows, layer_idx: int, output) -> None:
        st = worker_state()
        key_cache, value_cache = layer_kv_views(kv_cache)
        q = q3[decode.token_idx]
        out3 = output.view(output.shape[0], self.num_heads, self.head_size)
        last = None
        for impl in (None, "torch"):  # the best implementation, then the reference
            try:
                moments = None
                if decode.moment_pages is not None:
                    h = kv_cache.shape[1]
                    moments = ops.load_moments(key_cache, value_cache,
                                               decode.moment_pages[layer_idx].to(torch.int64), h, self.head_size)
                    keep = decode.has_moments
                    moments = {k: torch.where(keep.view(-1, *([1] * (v.dim() - 1))), v, torch.zeros_like(v))
                               for k, v in moments.items()}
                o, _ = ops.ragged_decode_attention(q, key_cache, value_cache, decode.page_table[layer_idx],
                                                   decode.seq_lens[layer_idx], self.scale, moments=moments,
                                                   native=True, impl=impl)
                out3[decode.token_idx] = o.to(out3.dtype)
                return
            except Exception as e:
                last = e
                if impl is None:
                    logger.warning("kv_eviction: ragged decode failed (%s); retrying with the torch reference", e)
        for req_id in decode.req_ids:
            st.forward_errors[req_id] = f"ragged decode: {last}"
