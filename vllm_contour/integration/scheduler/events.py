"""The scheduler side's events, each counted once where it happens: into the process's totals (tests, logs)
and into the step's ``ContourStats`` (``vllm:contour_*`` metrics, sent as per-step deltas); failures are
counted by reason and logged once per request and reason."""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

from vllm_contour.integration.metrics import ContourStats
from vllm_contour.integration.scheduler.records import SchedulerTotals

logger = init_logger("vllm.contour")

MAX_LOGGED = 8192


class SchedulerEvents:
    def __init__(self):
        self.totals = SchedulerTotals()
        self.stats = ContourStats()
        self._logged: set[tuple[str, str]] = set()

    def event(self, name: str, n: int = 1, stat: str | None = None) -> None:
        """A totals field and its counter (``vllm:contour_<stat or name>_total``)."""
        setattr(self.totals, name, getattr(self.totals, name) + n)
        self.stats.add(stat or name, n)

    def fail(self, req_id: str, reason: str, err: Any) -> None:
        """Eviction of a request failed; it goes on without (the caller stops its rounds)."""
        self._count_failure(reason)
        self._log_once(req_id, reason, "kv_eviction: %s: eviction failed (%s: %s); the request goes on without "
                                       "it", req_id, reason, err)

    def forward_failed(self, req_id: str, reason: str) -> None:
        """The attention op failed for a request; the plugin's scheduler finishes it with an error."""
        self._count_failure("forward")
        self._log_once(req_id, "forward", "kv_eviction: %s failed in the attention op (%s); the request is "
                                          "finished with an error", req_id, reason)

    def take(self) -> ContourStats | None:
        """This step's stats (None when nothing happened); the next step starts empty."""
        if not self.stats.data:
            return None
        out, self.stats = self.stats, ContourStats()
        return out

    def _count_failure(self, reason: str) -> None:
        self.totals.failures[reason] = self.totals.failures.get(reason, 0) + 1
        self.stats.add("eviction_failures", 1, label=reason)

    def _log_once(self, req_id: str, what: str, msg: str, *args) -> None:
        if (req_id, what) in self._logged:
            return
        self._logged.add((req_id, what))
        if len(self._logged) > MAX_LOGGED:
            self._logged.clear()
        logger.warning(msg, *args)
