"""``acache eval auto-reuse``: how often the server's automatic reuse changes a chat answer, by mode.

The workload is the shipped model's held-out tasks as chats (the story the system message, a question the
user message), each story asked several questions, the whole burst sent ``rounds`` times at ``concurrency``
requests at once. Every mode gets a fresh server and engine; the answers of ``--auto-reuse off`` are the
reference. A changed answer is one whose token ids differ from the reference's for the same request.
"""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from fastapi.testclient import TestClient
from tqdm.auto import tqdm

from acache.llm import LLM
from acache.server.app import create_app
from acache.server.reuse_gate import AUTO_REUSE_MODES
from acache_lab.tasks.generators import held_out_stories
from acache_lab.tasks.render import answer_length


@dataclass
class ModeResult:
    mode: str
    requests: int
    changed: int  # answers whose tokens differ from --auto-reuse off's
    reused: int  # answers decoded with an automatic affix
    changed_when_reused: int
    checks: int
    mismatches: int
    trusted_spans: int
    refused_spans: int
    wall_s: float


def chat_workload(tasks: list[str], stories: int, seed: int) -> list[dict]:
    """Request bodies: ``stories`` held-out contexts a task, every question of each."""
    bodies = []
    for task in tasks:
        for ex in (e for story in itertools.islice(held_out_stories(task, 6, seed), stories) for e in story):
            gen = answer_length(task)
            bodies.append({"messages": [{"role": "system", "content": " ".join(ex.context + ex.affix)},
                                        {"role": "user", "content": " ".join(ex.question)}],
                           "max_tokens": gen, "block_length": gen, "threshold": 0.9})
    return bodies


def run_mode(model: str, mode: str, bodies: list[dict], rounds: int, concurrency: int, checks: int,
             audit_every: int) -> tuple[list[list[int]], list[str], dict, float]:
    """Every answer's token ids and reuse decision, in send order, the gate's counts and the wall time."""
    llm = LLM(model)
    app = create_app(llm, "acache", auto_reuse=mode, reuse_checks=checks, reuse_audit_every=audit_every)
    tokens: list[list[int]] = []
    decisions: list[str] = []
    start = time.perf_counter()
    with TestClient(app) as client:
        def send(body: dict) -> dict:
            resp = client.post("/v1/chat/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"{resp.status_code}: {resp.text}")
            return resp.json()

        with ThreadPoolExecutor(concurrency) as pool, \
                tqdm(total=rounds * len(bodies), desc=f"auto-reuse {mode}", unit="req") as bar:
            for _ in range(rounds):
                for out in pool.map(send, bodies):
                    tokens.append(out["choices"][0]["token_ids"])
                    decisions.append(out["usage"].get("affix_reuse", {}).get("decision", "none"))
                    bar.update(1)
        deadline = time.time() + 60
        while app.state.checks_running and time.time() < deadline:
            time.sleep(0.05)
        counts = app.state.gate.counts()
    llm.close()
    return tokens, decisions, counts, time.perf_counter() - start


def measure(model: str, tasks: list[str], stories: int, rounds: int, concurrency: int, checks: int,
            audit_every: int, seed: int = 0, modes: tuple[str, ...] = ("on", "verified")) -> list[ModeResult]:
    bodies = chat_workload(tasks, stories, seed)
    reference, _, counts, wall = run_mode(model, "off", bodies, rounds, concurrency, checks, audit_every)
    results = [ModeResult("off", len(reference), 0, 0, 0, counts["checks"], counts["mismatches"], counts["trusted"],
                          counts["refused"], wall)]
    for mode in modes:
        if mode not in AUTO_REUSE_MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(AUTO_REUSE_MODES)}")
        tokens, decisions, counts, wall = run_mode(model, mode, bodies, rounds, concurrency, checks, audit_every)
        changed = [a != b for a, b in zip(tokens, reference, strict=True)]
        reused = [d == "reused" for d in decisions]
        results.append(ModeResult(mode, len(tokens), sum(changed), sum(reused),
                                  sum(c and r for c, r in zip(changed, reused, strict=True)), counts["checks"],
                                  counts["mismatches"], counts["trusted"], counts["refused"], wall))
    return results


def report(results: list[ModeResult], out: Path | None) -> str:
    lines = ["| --auto-reuse | requests | answers changed | answered with reuse | changed among those | checks "
             "| mismatches | spans trusted / refused | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.mode} | {r.requests} | {r.changed} ({r.changed / r.requests:.1%}) | {r.reused} "
                     f"| {r.changed_when_reused} | {r.checks} | {r.mismatches} | {r.trusted_spans} / "
                     f"{r.refused_spans} | {r.wall_s:.1f} |")
    text = "\n".join(lines)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return text
