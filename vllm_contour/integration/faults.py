"""TEST ONLY: the fault switch. ``install(spec)`` (spec from ``VLLM_CONTOUR_FAULTS``, which tests set; the
plugin's ``register()`` passes it on in every vLLM process) wraps the worker side's methods so that chosen
eviction rounds, compacted rows, the attention backend's builder or impl, or the start-up layout probe fail,
and the tests can check that a failure stays with its request. Product code has no fault branches: with the
variable unset nothing is wrapped.
"""

from __future__ import annotations

import contextlib
import hashlib
import re

import torch

FAULTS_ENV = "VLLM_CONTOUR_FAULTS"


KINDS = ("plan", "apply", "forward", "metadata", "builder", "impl", "kernel")
RAISED = ("builder", "impl", "kernel")  # raised inside the attention backend


class FaultInjected(RuntimeError):
    """What an installed fault raises."""


class FaultSwitch:
    """``"plan=0.2,apply=0.1,seed=0"`` makes that share of rounds fail while planning (nothing written) or
    raise in the middle of compaction (after the first layer moved). Chosen per (request, round) by a
    hash, so a run is reproducible. ``only=PREFIX`` limits those random failures to requests whose id
    starts with PREFIX. ``at=KIND:ID:N`` (repeatable; ID may end with ``*``, a prefix) names one failure of
    one request, which then gets no random ones: KIND ``plan`` or ``apply`` fails its round N; ``forward``
    reports its attention op failed, ``metadata`` its compacted rows' page table unbuildable, in the N-th
    step it runs compacted. KIND ``builder`` makes the evicting group's metadata builder raise in the N-th step
    the request runs compacted, ``impl`` the compacted attention op raise in that step (its best
    implementation and the torch reference, every layer), ``kernel`` only its best implementation (the
    reference then serves the step): raised inside the backend, not written into the report.
    ``layout=scramble`` makes the start-up layout probe see vLLM's cache write through a scrambled page (an
    unknown layout)."""

    def __init__(self, spec: str | None):
        self.rates: dict[str, float] = {}
        self.seed = "0"
        self.only = ""
        self.at: list[tuple[str, str, int]] = []
        self._steps: dict[tuple[str, str], int] = {}
        self.scramble_layout = False
        self.raising: set[str] = set()  # the RAISED kinds that hit the step being built
        self.uninstall = lambda: None
        for part in (spec or "").split(","):
            if not part.strip():
                continue
            key, _, value = part.partition("=")
            key = key.strip()
            if key == "seed":
                self.seed = value.strip()
            elif key in ("plan", "apply"):
                self.rates[key] = float(value)
            elif key == "only":
                self.only = value.strip()
            elif key == "at" and value.count(":") == 2 and \
                    value.split(":")[0].strip() in KINDS:
                kind, rid, n = (x.strip() for x in value.split(":"))
                self.at.append((kind, rid, int(n)))
            elif key == "layout" and value.strip() == "scramble":
                self.scramble_layout = True
            else:
                raise ValueError(f"{FAULTS_ENV}: unknown key {key!r} (plan, apply, seed, only, "
                                 f"at={'|'.join(KINDS)}:ID:N, layout=scramble)")

    @property
    def on(self) -> bool:
        return bool(self.rates) or self.scramble_layout or bool(self.at)

    def _named(self, stable: str) -> list[tuple[str, int]]:
        return [(k, n) for k, rid, n in self.at if rid == stable or (rid.endswith("*") and stable.startswith(rid[:-1]))]

    def hit(self, kind: str, req_id: str, seq: int) -> bool:
        stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)  # vLLM appends a random suffix to the caller's id
        named = self._named(stable) if self.at else []
        if named:
            return (kind, seq) in named
        rate = self.rates.get(kind, 0.0)
        if rate <= 0 or not stable.startswith(self.only):
            return False
        h = hashlib.sha256(f"{self.seed}/{kind}/{stable}/{seq}".encode()).digest()
        return int.from_bytes(h[:8], "little") / 2 ** 64 < rate

    def step_errors(self, req_ids, requests) -> dict[str, str]:
        """``forward`` / ``metadata`` failures of this step (what the attention backend reports when a compacted
        row's ragged op or page table fails), for the named requests among ``req_ids`` that run compacted."""
        out: dict[str, str] = {}
        for req_id in req_ids if self.at else ():
            rs = requests.requests.get(req_id)
            if rs is None or rs.layout is None:
                continue
            stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)
            for kind, n in self._named(stable):
                if kind in ("forward", "metadata"):
                    c = self._steps[(kind, stable)] = self._steps.get((kind, stable), 0) + 1
                    if c == n:
                        out[req_id] = ("ragged decode" if kind == "forward" else "metadata") + ": fault switch"
        return out

    def backend_faults(self, compacted) -> set[str]:
        """The RAISED kinds that hit this step: counted once per step (when the evicting group's builder
        makes it) for each named request the worker holds compacted."""
        out: set[str] = set()
        for req_id in compacted if self.at else ():
            stable = re.sub(r"-[0-9a-f]{8}$", "", req_id)
            for kind, n in self._named(stable):
                if kind in RAISED:
                    c = self._steps[(kind, stable)] = self._steps.get((kind, stable), 0) + 1
                    if c == n:
                        out.add(kind)
        return out


@contextlib.contextmanager
def _compaction_fails_after_first_layer():
    """``ops.compact`` moves the first layer's bytes, then raises."""
    from vllm_contour import ops

    real = ops.compact

    def compact(*a, **kw):
        real(*a, **kw)
        raise FaultInjected("fault switch: round failed after compacting layer 0")

    ops.compact = compact
    try:
        yield
    finally:
        ops.compact = real


_INSTALLED: FaultSwitch | None = None


def install(spec: str | None) -> FaultSwitch:
    """Wrap the worker side's round planning and applying, step making and resolution, the compacted
    attention op and the CPU layout probe with
    the faults ``spec`` names (a no-op for an empty spec)."""
    from vllm_contour import ops
    from vllm_contour.integration.messages import PlanFailed
    from vllm_contour.integration.worker.rounds import WorkerRounds
    from vllm_contour.integration.worker.side import WorkerSide
    from vllm_contour.ops import cpu_layout

    global _INSTALLED
    fs = FaultSwitch(spec)
    if not fs.on or _INSTALLED is not None:  # one switch per process
        return _INSTALLED or fs
    _INSTALLED = fs
    plan_all, apply_all, resolve = WorkerRounds.plan_all, WorkerRounds.apply_all, WorkerSide.resolve
    new_step, attention = WorkerSide.new_step, ops.compacted_attention
    offsets = cpu_layout.written_offsets

    def uninstall():
        global _INSTALLED
        _INSTALLED = None
        WorkerRounds.plan_all, WorkerRounds.apply_all, WorkerSide.resolve = plan_all, apply_all, resolve
        WorkerSide.new_step, ops.compacted_attention = new_step, attention
        cpu_layout.written_offsets = offsets
        cpu_layout.probe_layout.cache_clear()

    fs.uninstall = uninstall

    def faulty_plan_all(self, items, views, scale, layers, report, stats):
        keep = []
        for it in items:
            if fs.hit("plan", it.req_id, it.seq):
                report[it.req_id] = PlanFailed(it.seq, "FaultInjected: fault switch: plan failed")
            else:
                keep.append(it)
        return plan_all(self, keep, views, scale, layers, report, stats)

    def faulty_apply_all(self, planned, views, report, stats):
        alone = [p for p in planned if fs.hit("apply", p[0].req_id, p[0].seq)]
        apply_all(self, [p for p in planned if not any(p is a for a in alone)], views, report, stats)
        for p in alone:  # moved on its own, failing after its first layer
            with _compaction_fails_after_first_layer():
                apply_all(self, [p], views, report, stats)

    def faulty_resolve(self, step):
        resolve(self, step)
        if self.message is not None:
            step.errors.update(fs.step_errors(self.message.keys, self.requests))

    def faulty_new_step(self, cm):
        step = new_step(self, cm)
        fs.raising = fs.backend_faults(self.requests.compacted())
        if "builder" in fs.raising:
            raise FaultInjected("fault switch: the metadata builder failed")
        return step

    def faulty_attention(*a, impl=None, **kw):
        if "impl" in fs.raising or ("kernel" in fs.raising and impl is None):
            raise FaultInjected(f"fault switch: compacted attention ({impl or 'best'}) failed")
        return attention(*a, impl=impl, **kw)

    WorkerRounds.plan_all, WorkerRounds.apply_all, WorkerSide.resolve = faulty_plan_all, faulty_apply_all, faulty_resolve
    WorkerSide.new_step, ops.compacted_attention = faulty_new_step, faulty_attention
    if fs.scramble_layout:
        def scrambled(write, *a, **kw):
            def write_then_scramble(k, v, kc, vc, slots):
                write(k, v, kc, vc, slots)
                flat = torch.empty(0, dtype=kc.dtype).set_(kc.untyped_storage())
                flat.copy_(flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))])

            return offsets(write_then_scramble, *a, **kw)

        cpu_layout.written_offsets = scrambled
        cpu_layout.probe_layout.cache_clear()
    return fs


@contextlib.contextmanager
def installed(spec: str):
    """``install(spec)`` for the block, then the methods as they were (tests in one process)."""
    fs = install(spec)
    try:
        yield fs
    finally:
        if fs.on:
            fs.uninstall()
