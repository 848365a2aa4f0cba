"""Worker side of eviction, one per worker process, made by the KV connector's worker role (vLLM creates
the connector where it creates the worker's state, and the attention backend finds it through vLLM's
``get_kv_transfer_group``): everything that lives as long as the process (cache views, the evicting
layers, the requests' state, KVzip's scores) is owned here.

At start-up it checks that eviction can run here. Every step it takes the scheduler's message (requests
that left, adopted shared contexts, the step's rounds and windows to capture), resolves the step the
evicting group's builder made (``step.py``: which rows are compacted, which queries to keep), keeps the
captured window queries after the forward, runs the step's rounds (``rounds.py``) and reports their
outcomes. Nothing here raises into vLLM's engine loop.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from vllm_contour import ops
from vllm_contour.config import EvictionConfig
from vllm_contour.integration.messages import ContourMetadata, ContourReport, Outcome, Recompute
from vllm_contour.integration.metrics import ContourStats
from vllm_contour.integration.reconstruction.worker import ContextScores
from vllm_contour.integration.worker.caches import WorkerCaches
from vllm_contour.integration.worker.requests import QueryWindow, WorkerRequests
from vllm_contour.integration.worker.rounds import WorkerRounds, clear_unread
from vllm_contour.integration.worker.step import ContourStep, mispredicted, window_plan
from vllm_contour.ops.paged import head_pages
from vllm_contour.page_tables import RowError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.contour")


class WorkerSide:
    def __init__(self, vllm_config: "VllmConfig", config: EvictionConfig,
                 layer_names: tuple[str, ...] | None = None):
        self.config = config
        self.caches = WorkerCaches(vllm_config, layer_names)
        self.requests = WorkerRequests()
        self.scores = ContextScores()
        self.rounds = WorkerRounds(self.requests, self.scores)
        self._report: dict[str, Outcome] = {}
        self._stats = ContourStats()
        # the step: the scheduler's message (begin_step .. after_forward), the builder's step once resolved,
        # and the requests whose output of this step is wrong
        self.message: ContourMetadata | None = None
        self.step: ContourStep | None = None
        self._step_reqs: list[str] = []
        self._errors: dict[str, str] = {}
        self._metadata_failed: str | None = None  # why the builder could not make this step's metadata

    @property
    def layer_index(self) -> dict[str, int]:
        return self.caches.layer_index

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Every "can eviction run here" check happens here, at engine start (``caches.py``), and the ops'
        implementations (missing C++ kernels: a warning, the torch reference runs); the kernel-ready page
        tables are made on the caches' device."""
        from vllm_contour.ops import cpu_ext
        from vllm_contour.page_tables import PageTables
        from vllm_contour.policies import build_policy

        c = self.caches
        c.register(kv_caches)
        k0 = c.views[0][0]
        nb, heads, bs, hd = c.dims
        self.requests.tables = PageTables(len(c.named), heads, bs, c.named[0][1].shape[0], device=k0.device)
        self.rounds.query_shape = c.query_shape
        self._stats.gauge("query_buffer_bound_bytes", c.outside_pool_bound(build_policy(self.config.policy)))
        dev = k0.device.type
        op_impls = ops.implementations(dev)
        self._stats.info("ops", op_impls)
        if dev == "cpu" and (op_impls["ragged_decode_attention"] == "torch" or op_impls["compact"] == "torch"):
            logger.warning("kv_eviction: the C++ kernels (vllm_contour._C) are not loaded (%s); eviction falls "
                           "back to the torch reference ops: decoding compacted requests is ~4-7x slower than "
                           "vLLM's own kernel. Reinstall with `pip install --no-build-isolation -e .` to build "
                           "them.", cpu_ext.LOAD_ERROR or "VLLM_CONTOUR_OPS_IMPL forces torch")
        logger.info("kv_eviction: worker ready (pid %d): %d layers, %d KV heads, head dim %d, block %d, %s on %s, "
                    "key view strides %s, value %s; ops %s", os.getpid(), len(c.named), heads, hd, bs, k0.dtype,
                    k0.device, tuple(k0.stride()), tuple(c.views[0][1].stride()), op_impls)

    # ------------------------------------------------------------------ every step
    def begin_step(self, md: ContourMetadata) -> None:
        """The scheduler's message for this step (before the forward; before or after the builder ran)."""
        reqs = self.requests
        self.message = md
        self._errors = {}
        try:
            for req_id in md.dropped:
                self._release_layout(req_id)
            for req_id, (key, epoch) in md.keys.items():
                reqs.state_for(req_id, epoch)  # a request that started over loses its old state here
            for req_id, eid in md.adopt.items():  # it starts with a shared compressed context
                layout = reqs.shared.get(eid)
                if layout is None:
                    self._errors[req_id] = f"shared compressed context {eid} is not on this worker"
                else:
                    reqs.set_layout(req_id, layout)
            for eid in md.shared_dropped:  # after the adoptions: one may name an entry dropped in this step
                self._clear_unread(reqs.shared.pop(eid, None), f"shared context {eid}")
            captures = [c for c in md.capture if c.req_id in md.keys]
            for c in captures:
                if c.pages is None:  # a hidden request's repeat tokens: folded into its owner's scores
                    continue
                rs = reqs.state_for(c.req_id)
                if rs.window is None or rs.window.pages != c.pages or rs.window.round_at != c.round_at:
                    reqs.forget_window(rs)
                    rs.window = QueryWindow(c.window_start, c.round_at, c.pages)
            keys = {r: key for r, (key, _) in md.keys.items()}
            self._step_reqs = reqs.tables.set_keys(keys, [(c.req_id, keys[c.req_id], c.start, c.end)
                                                          for c in captures])
            self._zero_stale_windows()
        except Exception as e:  # never into vLLM: forget this step's work, keep serving
            logger.warning("kv_eviction: could not start the step (%s); no round this step", e)
            self.message = ContourMetadata(keys=md.keys)
            self._step_reqs = []
            # compacted rows cannot reach their kernel this step: they fail alone
            self._errors.update({r: f"step start: {e}" for r in reqs.compacted() if r in md.keys})

    def new_step(self, cm) -> ContourStep:
        """The evicting group's builder's step: resolved now when the step's message is here (vLLM's V1
        model runner), else predicted and resolved by the first layer (Model Runner V2)."""
        step = ContourStep(self.resolve, self.caches.layer_index, cm)
        if self.message is not None:
            step.resolve()
        elif self.requests.tables is not None and len(self.requests.tables):
            step.predicted = self.requests.tables.predict(step.query_start_loc, step.seq_lens, step.block_table,
                                                          step.num_reqs)
        return step

    def metadata_failed(self, why: str) -> None:
        """The evicting group's builder could not make the step's metadata: vLLM's kernel runs every row as
        stock, so each compacted request of the step fails alone (which ones: the step's message, here
        before the builder on V1, after it on Model Runner V2)."""
        self._metadata_failed, self.step = why, None

    def resolve(self, step: ContourStep) -> None:
        """Match the step's batch rows to its compacted requests and captures (``PageTables.step``); on the
        host the per-token tables are expanded here, so a bad row fails before attention runs."""
        if self.message is None or self.requests.tables is None:
            return  # no step message (a profile or dummy run): nothing of the plugin's in this batch
        self.step = step
        if not (self._step_reqs or self.message.capture):
            return
        try:
            rows, cap = self.requests.tables.step(self._step_reqs, step.query_start_loc, step.seq_lens,
                                                  step.block_table, step.num_reqs, step.num_tokens,
                                                  step.max_seq_len)
            if rows is not None and rows.block_table.device.type == "cpu":
                rows.tables_for_cpu()
            if cap is not None:
                step.windows = window_plan(cap, self.requests.requests, {it.req_id for it in self.message.recon},
                                           self.caches, step.block_table.device)
        except Exception as e:  # never into vLLM: vLLM's kernel serves every row, compacted ones fail alone
            logger.warning("kv_eviction: metadata for compacted rows failed (%s)", e)
            step.fail(e.req_ids if isinstance(e, RowError) else self._step_reqs, f"metadata: {e}")
            return
        step.rows, step.capture = rows, cap

    def _release_layout(self, req_id: str) -> None:
        """Forget a request (finished, preempted, recomputed) and zero its moment pages unless a shared
        compressed context or another request still reads them: its blocks go back to vLLM's pool."""
        self.scores.drop_owner(req_id)
        rs = self.requests.drop(req_id)
        self._clear_unread(rs.layout if rs is not None else None, req_id)

    def _zero_stale_windows(self) -> None:
        """Zero the blocks of forgotten windows before vLLM's pool hands them out again, on fp8 caches: a
        query's raw bytes read as fp8 include NaN / inf patterns (e5m2), and vLLM's kernel reads a block past
        a request's tokens (a NaN there poisons its output). Other caches' query bits read as finite numbers."""
        pages, self.requests.stale_pages = self.requests.stale_pages, []
        views = self.caches.views
        if not pages or views is None or getattr(views, "dequant", None) is None:
            return
        try:
            h = self.caches.dims[1]
            ids = head_pages(sorted(set(pages)), h).to(views[0][0].device)
            for kc, vc in views:
                ops.clear_pages(kc, vc, ids)
        except Exception as e:  # never into vLLM
            logger.warning("kv_eviction: could not zero the blocks of finished query windows (%s)", e)

    def _clear_unread(self, layout, owner: str) -> None:
        clear_unread(self.caches.views, self.requests, layout, owner)

    def after_forward(self) -> None:
        md, step, failed = self.message, self.step, self._metadata_failed
        self.message, self.step, self._step_reqs, self._metadata_failed = None, None, [], None
        if md is None:
            return
        if failed is not None:
            self._errors.update({r: failed for r in self.requests.compacted() if r in md.keys})
        try:
            try:
                self._store_captures(md, step)
            except Exception as e:
                logger.warning("kv_eviction: could not store captured queries (%s)", e)
            self._check_prediction(md, step)
            self.rounds.run(list(md.rounds), self.caches.views, self.caches.scale() if md.rounds else 0.0,
                            self.caches.stage_layers, self._report, self._stats)
            for it in md.rounds:  # the round read its window: its pages go back to vLLM's pool
                self.requests.forget_window(self.requests.requests.get(it.req_id))
            self._zero_stale_windows()
            self.scores.drop_kept(md.scores_dropped)  # after the rounds: one of them may have read them
            self._stats.gauge("query_buffer_bytes", self.scores.nbytes)
        except Exception as e:  # never into vLLM: a round without an outcome may have moved bytes
            logger.warning("kv_eviction: the step's rounds failed (%s)", e)
            for it in md.rounds:
                if it.req_id not in self._report:
                    self.requests.drop(it.req_id)
                    self._report[it.req_id] = Recompute(it.seq, f"{type(e).__name__}: {e}")
        if step is not None:
            self._errors.update(step.errors)

    def _check_prediction(self, md: ContourMetadata, step: ContourStep | None) -> None:
        """A row the builder shortened for vLLM's kernel by prediction that the message does not make a
        compacted request's has a wrong output this step: its request fails alone (never expected)."""
        if step is None or step.predicted is None:
            return
        self._stats.add("predicted_rows", int(step.predicted.sum()))
        for row, req_id in mispredicted(step, md.row_keys, self.caches.shape.block_size):
            logger.warning("kv_eviction: row %d (%s) was given a short context for vLLM's kernel but is not a "
                           "compacted request's", row, req_id)
            self._stats.add("mispredicted_rows", 1)
            if req_id is not None:
                self._errors[req_id] = "attention: a short context for vLLM's kernel by misprediction"

    def _store_captures(self, md: ContourMetadata, step: ContourStep | None) -> None:
        """Hidden reconstruction requests' repeat queries of the step -> KVzip scores of their owners (window
        queries were written into their pages by each layer)."""
        cap = step.capture if step is not None else None
        if cap is None or not step.staged:
            return
        stacked = torch.stack([step.staged[layer] for layer in sorted(step.staged)])  # [L, total, Hq, D]
        recon = {it.req_id: it for it in md.recon}
        off = 0
        for req_id, pos0, n in cap.owners:
            item = recon.get(req_id)
            if item is not None and n > 0:
                try:
                    self.scores.fold(item, torch.arange(pos0, pos0 + n, device=stacked.device),
                                     stacked[:, off: off + n], self.caches.views, self.caches.scale())
                except Exception as e:  # the owner's round then fails to plan: it is served densely
                    logger.warning("kv_eviction: %s: reconstruction scores failed (%s)", item.owner, e)
                    self.scores.drop_owner(item.owner)
            off += n

    def take_report(self) -> ContourReport | None:
        """The step's outcomes. A vLLM that asks before it lets the step finish (``wait_for_save`` deferred
        past the report, as vLLM 0.34's Model Runner V2 does with a speculator) gets the step's rounds run
        first, so an outcome always travels with its own step."""
        if self.message is not None:
            self.after_forward()
        if not self._report and not self._errors:
            return None
        report = ContourReport(self._report, self._errors)
        self._report, self._errors = {}, {}
        return report

    def take_stats(self) -> ContourStats | None:
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, ContourStats()
        return out
