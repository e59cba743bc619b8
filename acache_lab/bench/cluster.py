"""The cluster workload and ``acache bench serve --replicas N``: several documents, each registered once and
asked many questions at infix and suffix positions, with mixed generation lengths and anchor ratios, sent
in random order at staggered times. With each replica's affix share bounded below the whole working set,
a router that knows where each document lives keeps every document on one replica (hits), while one that
does not (Serve's power of two choices) makes every replica cycle through all of them (misses).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

POSITIONS = ("infix", "suffix")


@dataclass
class Workload:
    documents: list[str]  # affix texts, registered with POST /v1/affixes
    requests: list[tuple[int, dict]]  # (document index, completion body without its affix id)
    delays: list[float]  # seconds each request waits before it is sent


def documents_workload(documents: int = 6, questions: int = 12, seed: int = 0, sentences: int = 6) -> Workload:
    """``documents`` qa1 stories of equal length (``sentences`` six-word sentences, plus "story :"), each
    asked ``questions`` times."""
    from acache_lab.tasks.generators import qa1

    rng = random.Random(f"cluster-workload:{seed}")
    texts, requests = [], []
    for d in range(documents):
        examples = qa1(rng, sentences=sentences, questions=3)
        texts.append("story : " + " ".join(examples[0].affix))
        for i in range(questions):
            q = " ".join(examples[i % len(examples)].question)
            layout = POSITIONS[(i // len(examples)) % 2]
            prompt = f"question : {q} <|affix|> answer :" if layout == "infix" else f"question : {q} answer :"
            requests.append((d, {"prompt": prompt, "affix_layout": layout, "max_tokens": (2, 4)[i % 2],
                                 "anchor_ratio": (0.1, 0.2, 0.3)[i % 3]}))
    rng.shuffle(requests)
    return Workload(texts, requests, [rng.uniform(0.0, 0.05) for _ in requests])


def call(url: str, path: str, body: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@dataclass
class RunResult:
    statuses: list[int]
    answers: list[list[int] | None]  # token ids per request, in workload order
    latencies_s: list[float]
    wall_s: float
    errors: list[str] = field(default_factory=list)

    def report(self) -> dict:
        ok = [lat for s, lat in zip(self.statuses, self.latencies_s, strict=True) if s == 200]
        return {"requests": len(self.statuses), "succeeded": len(ok), "wall_time_s": self.wall_s,
                "requests_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
                "latency_p50_s": float(np.percentile(ok, 50)) if ok else 0.0,
                "latency_p99_s": float(np.percentile(ok, 99)) if ok else 0.0}


def register(url: str, workload: Workload) -> list[str]:
    ids = []
    for text in workload.documents:
        status, out = call(url, "/v1/affixes", {"text": text})
        if status != 200:
            raise RuntimeError(f"registering a document failed ({status}): {out}")
        ids.append(out["id"])
    return ids


def run(url: str, workload: Workload, concurrency: int = 4) -> RunResult:
    """Registers the documents, then sends every request (``concurrency`` at a time, each after its delay)."""
    ids = register(url, workload)

    def one(item: tuple[tuple[int, dict], float]) -> tuple[int, list[int] | None, float, str | None]:
        (doc, body), delay = item
        time.sleep(delay)
        start = time.perf_counter()
        status, out = call(url, "/v1/completions", {**body, "affix": ids[doc]})
        took = time.perf_counter() - start
        if status != 200:
            return status, None, took, str(out.get("error", out))
        return status, out["choices"][0]["token_ids"], took, None

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, zip(workload.requests, workload.delays, strict=True)))
    wall = time.perf_counter() - start
    return RunResult([d[0] for d in done], [d[1] for d in done], [d[2] for d in done], wall,
                     [d[3] for d in done if d[3]])


def bench_cluster(args) -> int:
    """Starts the cluster once per router on this machine, runs the workload on each, reports side by side."""
    from acache.cluster.frontend import FrontendSettings
    from acache.cluster.launch import NAMESPACE, ClusterSettings, deploy, prepare, stop
    from acache.cluster.replica import ReplicaSettings
    from acache.paths import default_model

    for name in ("replicas", "documents", "questions", "sentences", "threads", "concurrency"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    model = str(args.model or default_model())
    workload = documents_workload(args.documents, args.questions, args.seed, args.sentences)
    page = 16  # the engine's default page size
    per_replica = -(-args.documents // args.replicas)
    doc_pages = -(-(6 * args.sentences + 2) // page)
    cap = args.max_affix_tokens or per_replica * doc_pages * page  # the replica's share of the documents
    rows = {}
    for router in ("span", "default"):
        cluster = ClusterSettings(replicas=args.replicas, router=router, port=args.port, app_name=f"bench-{router}")
        replica = ReplicaSettings(model, "bench", cluster.directory, NAMESPACE, threads=args.threads,
                                  llm={"kv_cache_memory": 1 << 26, "max_affix_tokens": cap})
        prepare(cluster)  # a refusal stops nothing: what runs under that name is another's
        try:
            deploy(cluster, replica, FrontendSettings(model, cluster.directory, NAMESPACE))
            url = f"http://127.0.0.1:{args.port}"
            result = run(url, workload, args.concurrency)
            stats = call(url, "/cluster/stats")[1]
        finally:
            stop(cluster)
        rows[router] = {**result.report(), "affix_hit_rate": stats["affix_hit_rate"],
                        "affix_hits": stats["affix_hits"], "affix_queries": stats["affix_queries"],
                        "errors": result.errors[:3]}
        print(f"{router:>8} router: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in rows[router].items() if k != "errors"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"replicas": args.replicas, "documents": args.documents,
                                               "questions": args.questions, "sentences": args.sentences,
                                               "max_affix_tokens": cap, "rows": rows}, indent=2) + "\n")
    return 0 if all(r["succeeded"] == r["requests"] for r in rows.values()) else 1
