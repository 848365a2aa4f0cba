"""Worker side of eviction: check at start-up that eviction can run here; every step, take the scheduler's
metadata (requests that left, adopted shared contexts, the step's rounds and windows to capture), keep the
captured window queries, and after the forward run the step's rounds (``worker_rounds.py``) and report
their outcomes. Nothing here raises into vLLM's engine loop.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from vllm_contour import ops
from vllm_contour.budget import CacheShape
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.faults import FAULTS_ENV, FaultSwitch
from vllm_contour.integration.metrics import ContourStats
from vllm_contour.integration.reports import ContourMetadata, ContourReport, Outcome
from vllm_contour.integration import worker_reconstruction
from vllm_contour.integration.state import QueryRing, worker_state
from vllm_contour.integration.worker_rounds import WorkerRounds, clear_unread

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.contour")

class WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", config: EvictionConfig,
                 layer_names: tuple[str, ...] | None = None):
        self.vllm_config = vllm_config
        self.layer_names = layer_names  # the full-attention layers (a hybrid model's others are vLLM's)
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        self._layer_caches: list[tuple[str, torch.Tensor]] = []
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._shape: CacheShape | None = None
        self._scale: float | None = None
        self._stage_layers: tuple[int, int] | None = None
        self._report: dict[str, Outcome] = {}
        self._stats = ContourStats()
        self.faults = FaultSwitch(os.environ.get(FAULTS_ENV))
        self.rounds = WorkerRounds(self.faults)
        if self.faults.on:
            logger.warning("kv_eviction: TEST-ONLY fault switch %s=%s is on", FAULTS_ENV, os.environ[FAULTS_ENV])

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every "can eviction run here" check happens here, at engine start: the cache views of the
        attention backend in use (on CPU a layout probe: an unknown layout stops the engine with a message
        naming dtype and ISA), one attention scale for all layers, the ops' implementations (missing C++
        kernels: a warning, the torch reference runs); the kernel-ready page tables are made on the
        caches' device."""
        from vllm.model_executor.models.utils import extract_layer_index

        from vllm_contour.ops.paged import dims
        from vllm_contour.page_tables import PageTables

        named = sorted(((n, kv) for n, kv in kv_caches.items() if self.layer_names is None or n in self.layer_names),
                       key=lambda kv: extract_layer_index(kv[0]))
        self._layer_caches = named
        st = worker_state()
        st.layer_index = {name: i for i, (name, _) in enumerate(named)}
        impls = self._layers()
        views = getattr(next(iter(impls.values())).impl, "kv_views", None)
        if views is None:
            raise ValueError("kv_eviction: the attention backend in use is not the plugin's (another "
                             "--attention-backend?); eviction cannot run")
        self._views = [views(kv, scramble=self.faults.scramble_layout) for _, kv in named]
        k0 = self._views[0][0]
        _, heads, bs, hd = dims(k0)
        self._shape = CacheShape.of(block_size=bs, num_kv_heads=heads, head_dim=hd, dtype=k0.dtype)
        self._layer_scale()  # layers with different attention scales cannot share one round: stop here
        # a pipeline stage's layers are a slice of the model's: depth-dependent policies see the whole model
        # (a hybrid model's evicting layers are a subset of every stage's: they count among themselves)
        total = getattr(self.vllm_config.model_config.hf_text_config, "num_hidden_layers", None) or len(named)
        first = extract_layer_index(named[0][0])
        self._stage_layers = (0, len(named)) if len(named) < len(kv_caches) else (first, max(total, first + len(named)))
        st.tables = PageTables(len(named), heads, bs, named[0][1].shape[0], device=k0.device)
        self._check_query_buffers(len(named), k0)
        dev = k0.device.type
        op_impls = ops.implementations(dev)
        self._stats.info("ops", op_impls)
        from vllm_contour.ops import cpu_ext

        if dev == "cpu" and (op_impls["ragged_decode_attention"] == "torch" or op_impls["compact"] == "torch"):
            logger.warning("kv_eviction: the C++ kernels (vllm_contour._C) are not loaded (%s); eviction falls "
                           "back to the torch reference ops: decoding compacted requests is ~4-7x slower than "
                           "vLLM's own kernel. Reinstall with `pip install --no-build-isolation -e .` to build "
                           "them.", cpu_ext.LOAD_ERROR or "VLLM_CONTOUR_OPS_IMPL forces torch")
        logger.info("kv_eviction: worker ready (pid %d): %d layers, %d KV heads, head dim %d, block %d, %s on %s, "
                    "key view strides %s, value %s; ops %s", os.getpid(), len(named), self._shape.num_kv_heads,
                    self._shape.head_dim, self._shape.block_size, k0.dtype, k0.device, tuple(k0.stride()),
                    tuple(self._views[0][1].stride()), op_impls)

    def _check_query_buffers(self, num_layers: int, k0: torch.Tensor) -> None:
        """The window-query buffers live outside vLLM's pool: at most one per running request, each
        ``layers x query heads x window x head dim``. Their bound is counted at start-up, and on a GPU
        checked against the memory vLLM left free (a request asking for a larger window is refused)."""
        layer = next(iter(self._layers().values()))
        per_req = num_layers * layer.impl.num_heads * self.config.window * self._shape.head_dim * k0.element_size()
        bound = per_req * self.vllm_config.scheduler_config.max_num_seqs
        self._stats.gauge("query_buffer_bound_bytes", bound)
        if k0.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(k0.device)
            if bound > free:
                raise ValueError(
                    f"kv_eviction: the window-query buffers of {self.vllm_config.scheduler_config.max_num_seqs} "
                    f"requests need up to {bound / 2**20:.0f} MiB outside vLLM's KV pool, {free / 2**20:.0f} MiB "
                    "are free: lower --gpu-memory-utilization, --max-num-seqs or --kv-observation-window")
        logger.info("kv_eviction: window-query buffers: %.1f MiB per request, at most %.0f MiB", per_req / 2**20,
                    bound / 2**20)

    def _layers(self):
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        return get_layers_from_vllm_config(self.vllm_config, Attention, [n for n, _ in self._layer_caches])

    def _layer_scale(self) -> float:
        if self._scale is None:
            scales = {float(layer.impl.scale) for layer in self._layers().values()}
            if len(scales) != 1:
                raise ValueError(f"kv_eviction: layers use different attention scales {scales}")
            self._scale = scales.pop()
        return self._scale

    # ------------------------------------------------------------------ every step
    def begin_step(self, md: ContourMetadata) -> None:
        st = worker_state()
        try:
            for req_id in md.dropped:
                self._release_layout(req_id)
            for req_id, (key, epoch) in md.keys.items():
                st.state_for(req_id, epoch)  # a request that started over loses its old state here
            missing = {}
            for req_id, eid in md.adopt.items():  # it starts with a shared compressed context
                layout = st.shared.get(eid)
                if layout is None:
                    missing[req_id] = f"shared compressed context {eid} is not on this worker"
                else:
                    st.set_layout(req_id, layout)
            for eid in md.shared_dropped:  # after the adoptions: one may name an entry dropped in this step
                self._clear_unread(st.shared.pop(eid, None), f"shared context {eid}")
            st.rounds_now = {it.req_id: it for it in md.rounds}
            st.recon_now = {it.req_id: it for it in md.recon}
            st.scores_dropped_now = list(md.scores_dropped)
            st.captures = {c.req_id: c for c in md.capture if c.req_id in md.keys}
            for c in st.captures.values():
                if c.req_id in st.recon_now:  # folded into its owner's scores after the forward
                    continue
                rs = st.state_for(c.req_id)
                if rs.ring is None or rs.ring.window != c.window:
                    rs.ring = QueryRing(c.window)
            st.staged, st.forward_errors = {}, missing
            st.forward_errors.update(self.faults.step_errors(md.keys, st))  # TEST ONLY (off: nothing)
            keys = {r: key for r, (key, _) in md.keys.items()}
            st.step_reqs = st.tables.set_keys(keys, [(c.req_id, keys[c.req_id], c.start, c.end)
                                                     for c in st.captures.values()])
        except Exception as e:  # never into vLLM: forget this step's work, keep serving
            logger.warning("kv_eviction: could not start the step (%s); no round this step", e)
            st.rounds_now, st.captures, st.step_reqs, st.recon_now = {}, {}, [], {}
            # compacted rows cannot reach their kernel this step: they fail alone
            st.forward_errors = {r: f"step start: {e}" for r in st.compacted() if r in md.keys}

    def _release_layout(self, req_id: str) -> None:
        """Forget a request (finished, preempted, recomputed) and zero its moment pages unless a shared
        compressed context or another request still reads them: its blocks go back to vLLM's pool."""
        st = worker_state()
        rs = st.requests.get(req_id)
        st.drop(req_id)
        self._clear_unread(rs.layout if rs is not None else None, req_id)

    def _clear_unread(self, layout, owner: str) -> None:
        clear_unread(self._views, layout, owner)

    def after_forward(self) -> None:
        st = worker_state()
        try:
            self._store_captures()
        except Exception as e:
            logger.warning("kv_eviction: could not store captured queries (%s)", e)
        self.rounds.run(list(st.rounds_now.values()), self._views, self._layer_scale() if st.rounds_now else 0.0,
                        self._stage_layers, self._report, self._stats)
        for key in st.scores_dropped_now:  # after the rounds: one of them may have read or kept them
            st.scored.pop(key, None)
        st.rounds_now, st.captures, st.step_reqs, st.recon_now, st.scores_dropped_now = {}, {}, [], {}, []
        st.staged, st.step = {}, None
        self._stats.gauge("query_buffer_bytes", st.query_buffer_bytes())

    def _store_captures(self) -> None:
        st = worker_state()
        cap = st.step.capture if st.step is not None else None
        if cap is None or not st.staged:
            return
        stacked = torch.stack([st.staged[layer] for layer in sorted(st.staged)])  # [L, total, Hq, D]
        off = 0
        for req_id, pos0, n in cap.owners:
            rs = st.requests.get(req_id)
            item = st.recon_now.get(req_id)
            if item is not None and n > 0:  # a hidden request's repeat tokens: KVzip scores of its owner
                try:
                    worker_reconstruction.fold(item, torch.arange(pos0, pos0 + n, device=stacked.device),
                                               stacked[:, off : off + n], self._views, self._layer_scale())
                except Exception as e:  # the owner's round then fails to plan: it is served densely
                    logger.warning("kv_eviction: %s: reconstruction scores failed (%s)", item.owner, e)
                    st.reconstruction.pop(item.owner, None)
            elif rs is not None and rs.ring is not None and n > 0:
                rs.ring.write(torch.arange(pos0, pos0 + n, device=stacked.device), stacked[:, off : off + n])
            off += n

    def take_report(self) -> ContourReport | None:
        st = worker_state()
        if not self._report and not st.forward_errors:
            return None
        report = ContourReport(self._report, st.forward_errors)
        self._report, st.forward_errors = {}, {}
        return report

    def take_stats(self) -> ContourStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, ContourStats()
        return out
