"""Engine metrics: per run and, through each request's stats, per request."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    started: float = field(default_factory=time.perf_counter)
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    generated_tokens: int = 0
    refresh_times_s: list[float] = field(default_factory=list)  # each batched refresh forward
    step_times_s: list[float] = field(default_factory=list)  # each batched in-block forward
    selection_times_s: list[float] = field(default_factory=list)  # each batched anchor selection
    refreshed_tokens: int = 0  # tokens fed by all refreshes
    anchors: int = 0  # anchors chosen over all requests
    affix_tokens: int = 0  # shared affix tokens of those requests

    def summary(self, peak_pages: int, pages_in_use: int, page_bytes: int, affix_hits: int,
                affix_queries: int) -> dict:
        wall = time.perf_counter() - self.started
        return {
            "requests_finished": self.requests_finished,
            "requests_aborted": self.requests_aborted,
            "requests_failed": self.requests_failed,
            "generated_tokens": self.generated_tokens,
            "wall_time_s": wall,
            "throughput_tokens_per_s": self.generated_tokens / wall if wall > 0 else 0.0,
            "recompute_latency_total_s": sum(self.refresh_times_s),
            "recompute_latency_mean_s": statistics.fmean(self.refresh_times_s) if self.refresh_times_s else 0.0,
            "refreshes": len(self.refresh_times_s),
            "refreshed_tokens": self.refreshed_tokens,
            "step_time_total_s": sum(self.step_times_s),
            "selection_latency_total_s": sum(self.selection_times_s),
            "peak_kv_pages": peak_pages,
            "peak_kv_bytes": peak_pages * page_bytes,
            "kv_pages_in_use": pages_in_use,
            "affix_hits": affix_hits,
            "affix_queries": affix_queries,
            "anchor_fraction": self.anchors / self.affix_tokens if self.affix_tokens else 0.0,
        }
