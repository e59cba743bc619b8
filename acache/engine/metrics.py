"""Engine metrics: per run and, through each request's stats, per request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Timings:
    """Durations of one kind of batched forward in constant memory (a server runs for months): their
    count, total and cumulative histogram over ``LATENCY_BUCKETS``."""

    count: int = 0
    total_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        for i, edge in enumerate(LATENCY_BUCKETS):
            if seconds <= edge:
                self.buckets[i] += 1

    @property
    def mean_s(self) -> float:
        return self.total_s / self.count if self.count else 0.0


@dataclass
class EngineMetrics:
    started: float = field(default_factory=time.perf_counter)
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    generated_tokens: int = 0
    refresh_times: Timings = field(default_factory=Timings)  # batched refresh forwards
    step_times: Timings = field(default_factory=Timings)  # batched in-block forwards
    selection_times: Timings = field(default_factory=Timings)  # batched anchor selections
    #: the refreshes that chose their anchors inside the forward (anchor_pass="one"), counted in refresh_times too
    selecting_refresh_times: Timings = field(default_factory=Timings)
    first_block_times: Timings = field(default_factory=Timings)  # arrival to a request's first completed block
    inter_block_times: Timings = field(default_factory=Timings)  # between a request's consecutive blocks
    request_times: Timings = field(default_factory=Timings)  # arrival to finish, of finished requests
    refreshed_tokens: int = 0  # columns fed by all refreshes (far masks a window leaves out not counted)
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
            "recompute_latency_total_s": self.refresh_times.total_s,
            "recompute_latency_mean_s": self.refresh_times.mean_s,
            "refreshes": self.refresh_times.count,
            "refreshed_tokens": self.refreshed_tokens,
            "step_time_total_s": self.step_times.total_s,
            "selection_latency_total_s": self.selection_times.total_s,
            "selecting_refresh_total_s": self.selecting_refresh_times.total_s,
            "selecting_refreshes": self.selecting_refresh_times.count,
            "peak_kv_pages": peak_pages,
            "peak_kv_bytes": peak_pages * page_bytes,
            "kv_pages_in_use": pages_in_use,
            "affix_hits": affix_hits,
            "affix_queries": affix_queries,
            "anchor_fraction": self.anchors / self.affix_tokens if self.affix_tokens else 0.0,
        }
