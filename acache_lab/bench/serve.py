"""``acache bench serve``: load a running server with concurrent streaming chat requests.

Every request shares one system prompt (an affix candidate, reused from its second sighting) and asks
its own question. Reports throughput, time to first block, latency percentiles and the affix hit rate
read from ``/metrics`` before and after. Plain ``http.client``: no client library needed.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from http.client import HTTPConnection, HTTPSConnection
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_SYSTEM = ("You are a careful assistant. Answer with a single word. Facts: Mary moved to the kitchen. "
                  "John went to the garden. Sandra journeyed to the office. Daniel travelled to the hallway. ")


@dataclass
class RequestTiming:
    ok: bool
    latency_s: float
    first_block_s: float | None
    completion_tokens: int
    error: str | None = None


def _connection(url: str):
    parsed = urlparse(url)
    cls = HTTPSConnection if parsed.scheme == "https" else HTTPConnection
    return cls(parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80), timeout=600)


def _headers(api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def scrape(url: str, name: str) -> float:
    conn = _connection(url)
    conn.request("GET", "/metrics")
    body = conn.getresponse().read().decode()
    for line in body.splitlines():
        if line.startswith(f"acache_{name} "):
            return float(line.split()[1])
    return 0.0


def one_request(url: str, api_key: str | None, system: str, question: str, max_tokens: int) -> RequestTiming:
    body = json.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                       "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": False}})
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        conn = _connection(url)
        conn.request("POST", "/v1/chat/completions", body=body, headers=_headers(api_key))
        resp = conn.getresponse()
        if resp.status != 200:
            return RequestTiming(False, time.perf_counter() - start, None, 0, f"HTTP {resp.status}: {resp.read()!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            choice = chunk["choices"][0]
            if choice["delta"].get("content"):
                first = first if first is not None else time.perf_counter() - start
                tokens += len(choice["delta"]["content"].encode())
        return RequestTiming(True, time.perf_counter() - start, first, tokens)
    except OSError as exc:
        return RequestTiming(False, time.perf_counter() - start, None, 0, str(exc))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(args) -> int:
    if args.concurrency <= 0 or args.requests <= 0:
        raise ValueError("--concurrency and --requests must be positive")
    system = args.system_prompt or DEFAULT_SYSTEM
    questions = [f"Question {i}: where is {name}?" for i, name in
                 zip(range(args.requests), ["Mary", "John", "Sandra", "Daniel"] * args.requests, strict=False)]
    hits0, queries0 = scrape(args.url, "affix_hits_total"), scrape(args.url, "affix_queries_total")
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        timings = list(pool.map(lambda q: one_request(args.url, args.api_key, system, q, args.max_tokens), questions))
    wall = time.perf_counter() - start
    hits, queries = scrape(args.url, "affix_hits_total") - hits0, scrape(args.url, "affix_queries_total") - queries0
    ok = [t for t in timings if t.ok]
    lat = [t.latency_s for t in ok]
    ttfb = [t.first_block_s for t in ok if t.first_block_s is not None]
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "succeeded": len(ok),
        "failed": len(timings) - len(ok), "wall_time_s": wall, "requests_per_s": len(ok) / wall,
        "completion_bytes_per_s": sum(t.completion_tokens for t in ok) / wall,
        "latency_p50_s": percentile(lat, 0.5), "latency_p90_s": percentile(lat, 0.9),
        "latency_p99_s": percentile(lat, 0.99), "first_block_p50_s": percentile(ttfb, 0.5),
        "first_block_p90_s": percentile(ttfb, 0.9),
        "affix_hit_rate": hits / queries if queries else 0.0, "affix_hits": hits, "affix_queries": queries,
        "errors": [t.error for t in timings if not t.ok][:5],
    }
    for key, value in report.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"report": report, "timings": [asdict(t) for t in timings]}, indent=2))
    return 0 if not report["failed"] else 1
