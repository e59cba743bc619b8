"""``acache bench serve``: load a running server with concurrent streaming chat requests, on the openai client.

Every request shares one system prompt (an affix candidate: reused from its second sighting on a server
started with ``--auto-reuse on``, after its checks under the default ``verified``) and asks its own question.
With ``--prompts auto`` the prompts are English unless the server's tokenizer refuses them, in which case they
come from the task suite (the shipped model's own words). Token counts are the server's own
(``stream_options.include_usage``); the time to the first block is the first streamed content. Reports
requests/s, output tokens/s, time to first block and latency percentiles, and the affix hit rate read from
``/metrics`` before and after.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ENGLISH_SYSTEM = ("You are a careful assistant. Answer with a single word. Facts: Mary moved to the kitchen. "
                  "John went to the garden. Sandra journeyed to the office. Daniel travelled to the hallway. ")
ENGLISH_NAMES = ["Mary", "John", "Sandra", "Daniel"]


@dataclass
class RequestTiming:
    ok: bool
    latency_s: float
    first_block_s: float | None
    completion_tokens: int
    error: str | None = None


def _get(url: str, path: str, api_key: str | None, body: dict | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(url: str, name: str) -> float:
    _, text = _get(url, "/metrics", None)
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(f"acache_{name} ")), 0.0)


def workload(url: str, api_key: str | None, kind: str, n: int, seed: int) -> tuple[str, list[str], str]:
    """The shared system prompt and ``n`` questions: English, or the task suite's words when the server's
    tokenizer has no token for English (``auto``)."""
    if kind == "auto":
        status, _ = _get(url, "/tokenize", api_key, {"prompt": ENGLISH_SYSTEM})
        kind = "english" if status == 200 else "tasks"
    if kind == "english":
        return ENGLISH_SYSTEM, [f"Question {i}: where is {ENGLISH_NAMES[i % 4]}?" for i in range(n)], kind
    from acache_lab.tasks.generators import qa1

    examples = qa1(random.Random(f"bench-serve:{seed}"), 6, questions=8)
    story = " ".join(examples[0].affix)  # the chat template makes the system message the story
    questions = [" ".join(examples[i % len(examples)].question) for i in range(n)]
    return story, questions, kind


def one_request(client, model: str, system: str, question: str, max_tokens: int) -> RequestTiming:
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            # the first chunk that carries generated tokens (the server's token_ids): the first the client can see of
            # its answer (the server holds back tokens that spell no text yet, so for a model whose blocks spell
            # nothing, a random one's, that is the last chunk; the first chunk with text never came, and read 0)
            if chunk.choices and first is None and (chunk.choices[0].model_extra or {}).get("token_ids"):
                first = time.perf_counter() - start
        return RequestTiming(True, time.perf_counter() - start, first, tokens)
    except Exception as exc:  # the openai client's errors: report, keep loading
        return RequestTiming(False, time.perf_counter() - start, None, 0, f"{type(exc).__name__}: {exc}")


def pct(values: list[float], q: float) -> float | None:
    """The ``q``th percentile; None (printed n/a) where there is nothing to take it of."""
    return float(np.percentile(values, q)) if values else None


def main(args) -> int:
    try:
        import openai
    except ImportError:
        raise ValueError("acache bench serve needs the openai client: pip install openai") from None
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0)
    try:
        model = client.models.list().data[0].id
    except openai.OpenAIError as exc:
        raise ValueError(f"no OpenAI server answers at {args.url}: {type(exc).__name__}: {exc}") from None
    system, questions, kind = workload(args.url, args.api_key, args.prompts, args.requests, args.seed)
    if args.system_prompt:
        system = args.system_prompt
    hits0, queries0 = scrape(args.url, "affix_hits_total"), scrape(args.url, "affix_queries_total")
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        timings = list(pool.map(lambda q: one_request(client, model, system, q, args.max_tokens), questions))
    wall = time.perf_counter() - start
    hits, queries = scrape(args.url, "affix_hits_total") - hits0, scrape(args.url, "affix_queries_total") - queries0
    ok = [t for t in timings if t.ok]
    lat = [t.latency_s for t in ok]
    ttfb = [t.first_block_s for t in ok if t.first_block_s is not None]
    report = {
        "model": model, "prompts": kind, "requests": args.requests, "concurrency": args.concurrency,
        "succeeded": len(ok), "failed": len(timings) - len(ok), "wall_time_s": wall,
        "requests_per_s": len(ok) / wall, "output_tokens": sum(t.completion_tokens for t in ok),
        "output_tokens_per_s": sum(t.completion_tokens for t in ok) / wall,
        "first_block_p50_s": pct(ttfb, 50), "first_block_p90_s": pct(ttfb, 90), "first_block_p99_s": pct(ttfb, 99),
        "first_block_requests": len(ttfb),
        "latency_p50_s": pct(lat, 50), "latency_p90_s": pct(lat, 90), "latency_p99_s": pct(lat, 99),
        "affix_hit_rate": hits / queries if queries else 0.0, "affix_hits": hits, "affix_queries": queries,
        "errors": [t.error for t in timings if not t.ok][:5],
    }
    for key, value in report.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: "
              f"{'n/a' if value is None else value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"report": report, "timings": [asdict(t) for t in timings]}, indent=2))
    return 0 if not report["failed"] else 1
