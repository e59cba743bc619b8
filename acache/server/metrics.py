"""The server's Prometheus metrics, exposed through ``prometheus-client`` from a collector that reads the
engine's and the server's counters when scraped (one registry per app, nothing global)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from acache.engine import LLMEngine
from acache.engine.metrics import LATENCY_BUCKETS
from acache.server.reuse_gate import ReuseGate


class EngineCollector:
    def __init__(self, engine: LLMEngine, counters: dict[str, int], gate: ReuseGate | None = None) -> None:
        self.engine = engine
        self.counters = counters
        self.gate = gate

    def collect(self):
        e, m = self.engine, self.engine.metrics
        peak, in_use, unit = e.kv.memory_usage()  # pages and their size, or bytes (unit 1)
        gauges = [("requests_running", "Requests being decoded.", e.num_running),
                  ("requests_waiting", "Requests waiting for cache room.", e.num_waiting),
                  ("cache_bytes_in_use", "Bytes of request caches in use (shared affix pages counted once).",
                   in_use * unit),
                  ("cache_bytes_total", "Bytes the cache may hold (kv_cache_memory).", e.kv.capacity_bytes),
                  ("cache_bytes_peak", "Most cache bytes in use at once.", peak * unit)]
        if e.pool is not None:  # a paged family (a state-cache family's caches are the model's own, not pages)
            gauges += [("kv_pages_in_use", "KV pool pages in use (shared affix pages counted once).", e.pool.num_used),
                       ("kv_pages_total", "KV pool pages.", e.pool.num_pages),
                       ("kv_pages_peak", "Most KV pool pages in use at once.", e.pool.peak_pages_used)]
        if self.gate is not None:
            spans = self.gate.counts()
            gauges += [(f"auto_reuse_{state}_spans", f"Spans (under one policy) automatic reuse holds {state}.",
                        spans[state]) for state in ("trusted", "refused", "checking")]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"acache_{name}", doc, value=value)
        counters = [("affix_hits", "Affix lookups served by a shared copy.", e.affixes.stats.hits),
                    ("affix_queries", "Affix lookups.", e.affixes.stats.queries),
                    ("anchors_recomputed", "Anchor tokens chosen for recomputation.", m.anchors),
                    ("requests_finished", "Requests finished.", m.requests_finished),
                    ("requests_aborted", "Requests aborted (client gone or cancelled).", m.requests_aborted),
                    ("requests_failed", "Requests the engine failed alone.", m.requests_failed),
                    ("generated_tokens", "Generated tokens (after stop tokens).", m.generated_tokens)]
        if self.gate is not None:
            totals = self.gate.counts()
            counters += [("auto_reuse_checks", "Answers without reuse compared with the same request with reuse.",
                          totals["checks"]),
                         ("auto_reuse_mismatches", "Checks where reuse would have changed the answer.",
                          totals["mismatches"])]
        counters += [(name.removesuffix("_total"), f"Server counter {name}.", value)
                     for name, value in sorted(self.counters.items())]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"acache_{name}", doc, value=value)
        for name, doc, t in (("recompute_latency_seconds", "Block-boundary refresh forwards.", m.refresh_times),
                             ("time_to_first_block_seconds", "Arrival to a request's first completed block "
                              "(a diffusion model's time to first token).", m.first_block_times),
                             ("inter_block_latency_seconds", "Between a request's consecutive completed blocks.",
                              m.inter_block_times),
                             ("e2e_request_latency_seconds", "Arrival to finish of finished requests.",
                              m.request_times)):
            buckets = [(str(edge), count) for edge, count in zip(LATENCY_BUCKETS, t.buckets, strict=True)]
            yield HistogramMetricFamily(f"acache_{name}", doc, buckets=[*buckets, ("+Inf", t.count)],
                                        sum_value=t.total_s)


def metrics_registry(engine: LLMEngine, counters: dict[str, int], gate: ReuseGate | None = None
                     ) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, counters, gate))
    return registry


def render_metrics(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()
