"""Prometheus text exposition of the engine's and the server's counters."""

from __future__ import annotations

from acache.engine import LLMEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def render_metrics(engine: LLMEngine, counters: dict[str, int]) -> str:
    m = engine.metrics
    lines = []

    def metric(name: str, kind: str, help_text: str, value: float) -> None:
        lines.extend([f"# HELP acache_{name} {help_text}", f"# TYPE acache_{name} {kind}", f"acache_{name} {value}"])

    metric("requests_running", "gauge", "Requests being decoded.", engine.num_running)
    metric("requests_waiting", "gauge", "Requests waiting for KV pages.", engine.num_waiting)
    metric("kv_pages_in_use", "gauge", "KV pool pages in use (shared affix pages counted once).",
           engine.pool.num_used)
    metric("kv_pages_total", "gauge", "KV pool pages.", engine.pool.num_pages)
    metric("kv_pages_peak", "gauge", "Most KV pool pages in use at once.", engine.pool.peak_pages_used)
    metric("affix_hits_total", "counter", "Affix lookups served by a shared copy.", engine.affixes.stats.hits)
    metric("affix_queries_total", "counter", "Affix lookups.", engine.affixes.stats.queries)
    metric("anchors_recomputed_total", "counter", "Anchor tokens chosen for recomputation.", m.anchors)
    metric("requests_finished_total", "counter", "Requests finished.", m.requests_finished)
    metric("requests_aborted_total", "counter", "Requests aborted (client gone or cancelled).", m.requests_aborted)
    metric("generated_tokens_total", "counter", "Generated tokens (after stop tokens).", m.generated_tokens)
    for name, value in sorted(counters.items()):
        metric(name, "counter", f"Server counter {name}.", value)
    lines += ["# HELP acache_recompute_latency_seconds Block-boundary refresh forwards.",
              "# TYPE acache_recompute_latency_seconds histogram"]
    times = list(m.refresh_times_s)
    for edge in LATENCY_BUCKETS:
        lines.append(f'acache_recompute_latency_seconds_bucket{{le="{edge}"}} {sum(t <= edge for t in times)}')
    lines.append(f'acache_recompute_latency_seconds_bucket{{le="+Inf"}} {len(times)}')
    lines.append(f"acache_recompute_latency_seconds_sum {sum(times)}")
    lines.append(f"acache_recompute_latency_seconds_count {len(times)}")
    return "\n".join(lines) + "\n"
