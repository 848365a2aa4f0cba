"""KVzip's context reconstruction inside vLLM: hidden requests that repeat a request's context.

When a request whose policy scores with the reconstruction (``kvzip``, ``contour_kvzip``) reaches its context
boundary ``C``, its round waits and the scheduler adds one hidden request per reconstruction chunk
(``prompt.py``): its prompt is the owner's first ``C`` tokens and then the chunk's repeat
ids. With prefix caching the context is a hit, so each hidden request prefills only its repeat tokens, in
chunks like any prefill, beside the other requests of the step; the workers capture those tokens' queries
and fold KVzip's max attention over the context keys into the owner's scores. The owner computes nothing
while it waits (``holding``); in the step where its last hidden request finishes its prefill its round is
dispatched with the scores, and it goes on with its question over the compressed context. A hidden request
samples one token, which no client sees, and finishes: its blocks go back to vLLM's pool as any request's.
Chunks shrink so that a hidden request fits ``max_model_len``; a context that leaves no room is served
without eviction, as is an owner whose hidden request ends before its repeat tokens are computed; if the
owner leaves, its hidden requests are aborted. A streaming-input session's next chunk is reconstructed the
same way at its end, only the appended tokens repeated (their context, the session's tokens so far,
uncompressed in the hidden request), and its round then covers the kept tokens (their earlier scores) and
the new ones.

The workers keep the scores of the last ``KEPT_SCORES`` contexts reconstructed (by the context's tokens, the
request's cache salt and LoRA adapter: ``context_key``), so a later request with the same context is scored
without a reconstruction even when no compressed copy of it is left in the pool (preempted, evicted from the
prefix cache, or prefix caching off). ``reset_prefix_cache`` drops them too.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from vllm_contour.integration.reconstruction.prompt import CHUNK_TOKENS, RepeatPrompt, chunks
from vllm_contour.integration.messages import CaptureItem, ReconItem, RoundItem, ScoresRef

if TYPE_CHECKING:
    from vllm.v1.request import Request

# The scheduler side's records (``Tracked``), a request's blocks (``RequestBlocks``) and the event counter
# (``SchedulerEvents``) are passed in: this component sits below the scheduler side and imports none of it.

# (request, tokens, the step's rounds, context scores) -> dispatched (False: no room now)
Dispatch = Callable[["Tracked", int, list, "ScoresRef | None"], bool]

PREFIX = "contour-kvzip-"  # request ids of the hidden requests
MIN_CHUNK = 32  # fewer context tokens a chunk than this (a context near max_model_len): no reconstruction
KEPT_SCORES = 8  # contexts whose scores the workers keep for later requests ([L, H, C] fp32 each, per rank)


def context_key(req: "Request", c: int) -> str:
    """What a context's KVzip scores depend on: its first ``c`` tokens and the model (the request's LoRA
    adapter); with its cache salt, as vLLM's prefix cache keys, so one tenant's scores never time another's."""
    lora = req.lora_request.lora_int_id if req.lora_request is not None else 0
    h = hashlib.sha256(f"{req.cache_salt or ''}|{lora}|{c}|".encode())
    h.update(array("q", req.all_token_ids[:c]).tobytes())
    return h.hexdigest()


@dataclass
class Companion:
    req_id: str
    owner: str
    span: tuple[int, int]  # the owner's context positions its chunk scores
    repeat_start: int  # C: where its repeat ids start
    prompt_len: int
    request: "Request"
    complete: bool = False  # its repeat tokens are computed (after the step that scheduled the last of them)


@dataclass
class Waiting:
    """An owner whose round waits for its reconstruction."""

    context_len: int
    epoch: int
    key: str | None = None  # the context's key when the whole context is reconstructed (its scores are kept)
    companions: list[str] = field(default_factory=list)
    ready: bool = False  # every companion complete: the round may be dispatched


class Reconstructions:
    def __init__(self, block_size: int, prompt: Callable[[], RepeatPrompt], max_model_len: int | None = None):
        self.block_size = block_size
        self.max_model_len = max_model_len  # a hidden request's prompt + its one sampled token must fit
        self._prompt = prompt
        self._repeat: RepeatPrompt | None = None
        self.waiting: dict[str, Waiting] = {}
        self.companions: dict[str, Companion] = {}
        self._new: list["Request"] = []
        self._abort: list[str] = []
        self._n = 0
        self.scored: OrderedDict[str, None] = OrderedDict()  # context keys whose scores the workers keep
        self._drop_scores: list[str] = []

    @staticmethod
    def is_companion(req_id: str) -> bool:
        return req_id.startswith(PREFIX)

    def holding(self, req_id: str) -> bool:
        """The owner computes nothing while its reconstruction runs (its question waits for the round)."""
        return req_id in self.waiting

    def start(self, t: "Tracked", c: int, start_at: int = 0, key: str | None = None) -> int:
        """Add the hidden requests that reconstruct ``t``'s context ``[0, C)``, or only its part
        ``[start_at, C)`` (what a streaming-input session appended since its last round: the earlier part's
        scores are kept by the workers); ``key``: the whole context's (``context_key``), its scores kept
        after the round; -> how many."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        if self._repeat is None:
            self._repeat = self._prompt()
        req = t.request
        ids = list(req.all_token_ids[:c])  # a session's earlier turns' tokens are part of its context
        parts = chunks(ids, c, self._repeat, size=self.chunk_size(c), start_at=start_at)
        w = self.waiting[req.request_id] = Waiting(c, t.epoch, key if start_at == 0 else None)
        for ch in parts:
            self._n += 1
            rid = f"{PREFIX}{self._n}-{req.request_id}"
            prompt = ids + list(ch.repeat)
            hidden = Request(
                request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                pooling_params=None, client_index=req.client_index, arrival_time=time.time(),
                lora_request=req.lora_request, cache_salt=req.cache_salt, priority=req.priority,
                block_hasher=req._block_hasher)  # vllm_hooks: Request._block_hasher (read)
            self._new.append(hidden)
            self.companions[rid] = Companion(rid, req.request_id, ch.span, c, len(prompt), hidden)
            w.companions.append(rid)
        return len(w.companions)

    def kept_scores(self, key: str) -> bool:
        """Do the workers keep the scores of the context ``key`` from an earlier request's reconstruction?
        (Then it is the most recently used.)"""
        if key not in self.scored:
            return False
        self.scored.move_to_end(key)
        return True

    def keep_scores(self, key: str) -> None:
        """A round that keeps its context's scores under ``key`` is dispatched; the least recently used past
        ``KEPT_SCORES`` go (the workers drop them after the step's rounds)."""
        self.scored[key] = None
        self.scored.move_to_end(key)
        while len(self.scored) > KEPT_SCORES:
            self._drop_scores.append(self.scored.popitem(last=False)[0])

    def drop_all_scores(self) -> None:
        self._drop_scores += list(self.scored)
        self.scored.clear()

    def take_dropped_scores(self) -> list[str]:
        out, self._drop_scores = self._drop_scores, []
        return out

    def chunk_size(self, c: int) -> int:
        """KVzip's chunk, or fewer tokens when a hidden request (the context ``C`` + a chunk's repeat ids + one
        sampled token) would pass ``max_model_len``; ValueError when not even ``MIN_CHUNK`` tokens fit."""
        if self.max_model_len is None:
            return CHUNK_TOKENS
        room = self.max_model_len - 1 - c - self._repeat.longest_ask()
        if room < MIN_CHUNK:
            raise ValueError(f"max_model_len {self.max_model_len}: a context of {c} tokens leaves {max(room, 0)} "
                             f"tokens for a reconstruction chunk (at least {MIN_CHUNK} needed)")
        return min(CHUNK_TOKENS, room)

    def take_new(self) -> list["Request"]:
        out, self._new = self._new, []
        return out

    def take_aborts(self) -> list[str]:
        out, self._abort = self._abort, []
        return out

    def limit_hit(self, req_id: str, num_hit: int) -> int:
        """A hidden request may hit its context, never its repeat tokens (their queries are what it is for)."""
        comp = self.companions.get(req_id)
        if comp is None or num_hit <= comp.repeat_start:
            return num_hit
        return comp.repeat_start // self.block_size * self.block_size

    def step(self, scheduled: dict[str, int], blocks: "RequestBlocks", keys: dict, captures: list[CaptureItem],
             items: list[ReconItem]) -> int:
        """This step's part of every scheduled hidden request: its row key, its repeat tokens to capture and
        what the workers fold them into; an owner whose hidden requests are all complete after the step is
        ready. -> reconstruction tokens scheduled in the step."""
        tokens = 0
        for rid, n in scheduled.items():
            comp = self.companions.get(rid)
            w = self.waiting.get(comp.owner) if comp is not None else None
            if w is None or n <= 0:
                continue
            req = comp.request
            start, done = req.num_computed_tokens, min(req.num_computed_tokens + n, comp.prompt_len)
            tokens += done - start
            ids = blocks.of(rid)
            i = start // self.block_size
            if i < len(ids):
                keys[rid] = (ids[i].block_id, 0)
            a, b = max(start, comp.repeat_start), done
            if b > a:
                captures.append(CaptureItem(rid, a, b, 0))
                items.append(ReconItem(rid, comp.owner, w.epoch, comp.span, comp.repeat_start, w.context_len,
                                       [x.block_id for x in ids[: (b + self.block_size - 1) // self.block_size]]))
            if done >= comp.prompt_len:
                comp.complete = True
                w.ready = all(self.companions[c].complete for c in w.companions if c in self.companions)
        return tokens

    def ready(self) -> list[str]:
        return [owner for owner, w in self.waiting.items() if w.ready]

    def done(self, owner: str) -> None:
        """The owner's round is dispatched (or it goes on without one): it computes again."""
        self.waiting.pop(owner, None)

    def companion_finished(self, req_id: str) -> str | None:
        """A hidden request left vLLM; -> its owner when the reconstruction cannot complete any more."""
        comp = self.companions.pop(req_id, None)
        if comp is None or comp.complete or comp.owner not in self.waiting:
            return None
        self.owner_gone(comp.owner)
        return comp.owner

    def owner_gone(self, owner: str) -> None:
        """The owner finished, was preempted or gave up: its hidden requests still running are aborted."""
        w = self.waiting.pop(owner, None)
        if w is None:
            return
        for rid in w.companions:
            comp = self.companions.pop(rid, None)
            if comp is not None and not comp.complete:
                self._abort.append(rid)


def _require_hooks() -> None:
    """The vLLM hooks hidden requests need (``vllm_hooks`` rows of the ``reconstruction`` feature), checked
    the first time a reconstruction starts in this process: a vLLM where they changed serves such requests
    without eviction, naming them, and stops nothing else."""
    global _HOOKS_OK
    if _HOOKS_OK is None:
        from vllm_contour.integration import vllm_hooks

        _HOOKS_OK = vllm_hooks.feature_refusal("reconstruction") or ""
    if _HOOKS_OK:
        raise RuntimeError(_HOOKS_OK)


_HOOKS_OK: str | None = None  # "" once checked and fine, else why not (this process's vLLM does not change)


class ContextRounds:
    """The round path's one extension point for policies that score with the context's reconstruction (KVzip):
    the scheduler side's dispatch hands it a request's due round (``round_due``) and asks it once per step
    for the hidden requests' work (``step``); it starts reconstructions, dispatches an owner's round back
    through the dispatch function it is given when its scores are complete (or at once with the scores the
    workers keep for the same context), and serves an owner densely when its reconstruction cannot
    complete. The vLLM hooks its hidden requests need are checked the first time one starts."""

    def __init__(self, recon: Reconstructions, blocks: "RequestBlocks", events: "SchedulerEvents"):
        self.recon = recon
        self.blocks = blocks
        self.events = events

    def round_due(self, t: "Tracked", done: int, rounds: list[RoundItem], dispatch: Dispatch) -> None:
        """The reconstruction runs first (for a compacted streaming-input session, over the tokens appended
        since its last round), unless the workers keep the scores of an earlier request's reconstruction of
        the same context."""
        req = t.request
        key = None if t.compacted else context_key(req, done)
        if key is None or not self.recon.kept_scores(key):
            self._reconstruct(t, done, t.region_blocks * self.blocks.block_size if t.compacted else 0, key)
        elif dispatch(t, done, rounds, ScoresRef(key, t.epoch, store=False)):
            self.events.event("reconstructions_reused")

    def _reconstruct(self, t: "Tracked", c: int, start_at: int, key: str | None) -> None:
        try:
            _require_hooks()
            self.recon.start(t, c, start_at, key)
            self.events.event("reconstructions")
        except Exception as e:  # never into vLLM: the request goes on without eviction
            self.stop_reconstruction(t, e)

    def step(self, scheduler_output, tracked: dict[str, "Tracked"], keys: dict, captures: list[CaptureItem],
             rounds: list[RoundItem], dispatch: Dispatch) -> list[ReconItem]:
        """The step's hidden reconstruction requests (their repeat tokens captured), and the rounds of the
        owners whose reconstruction completes with this step (each keeping its context's scores)."""
        items: list[ReconItem] = []
        if not self.recon.waiting:
            return items
        try:
            sched = {r: n for r, n in scheduler_output.num_scheduled_tokens.items() if self.recon.is_companion(r)}
            n = self.recon.step(sched, self.blocks, keys, captures, items)
            if n:
                self.events.event("reconstruction_tokens", n)
        except Exception as e:  # never into vLLM: the owners go on without eviction
            for owner in list(self.recon.waiting):
                self._stop_owner(tracked.get(owner), owner, e)
            return []
        for owner in self.recon.ready():
            t = tracked.get(owner)
            try:
                w = self.recon.waiting[owner]
                if t is None or t.params is None:
                    self.recon.done(owner)
                    continue
                keep = ScoresRef(w.key, t.epoch, store=True) if w.key is not None else None
                if dispatch(t, w.context_len, rounds, keep):
                    if keep is not None:
                        self.recon.keep_scores(keep.key)
                    self.recon.done(owner)
            except Exception as e:
                self._stop_owner(t, owner, e)
        return items

    def _stop_owner(self, t: "Tracked | None", owner: str, err) -> None:
        if t is None:
            self.recon.owner_gone(owner)
        else:
            self.stop_reconstruction(t, err)

    def stop_reconstruction(self, t: "Tracked", err) -> None:
        """The request's reconstruction cannot complete: its hidden requests go, it is served densely."""
        self.recon.owner_gone(t.request.request_id)
        if t.params is not None:
            self.events.fail(t.request.request_id, "reconstruction", err)
            t.params = None

