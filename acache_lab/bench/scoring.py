"""``acache bench scoring``: lm-eval-shaped log-likelihood requests/s on ``acache serve``, this tree beside a
baseline commit.

The requests are those ``acache eval lm`` makes lm-eval send for its multiple-choice tasks: every choice of
``--limit`` held-out documents of ``acache_qa1_mc`` and ``acache_arith_mc``, context and continuation as one
prompt of token ids with ``echo``, ``logprobs: 1``, ``max_tokens: 1`` and seed 1234, read as lm-eval reads
them (the sum of ``token_logprobs[ctxlen:-1]``). With ``--baseline-ref`` a second server runs that commit's
``acache`` (exported with ``git archive`` into a temporary directory) on the same model; requests go to the
two servers in turn, the order swapped every round, so the machine's noise falls on both alike. Besides
requests/s, the report checks that both serve the same estimates: one-token choices are exact (float-close),
longer ones agree within their Monte Carlo error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from acache_lab.eval.lm import PROMPT, task_records

TASKS = ("acache_qa1_mc", "acache_arith_mc")
SEED = 1234  # lm-eval's default seed, sent with every request


@dataclass(frozen=True)
class Choice:
    task: str
    document: int
    choice: int
    label: int
    token_ids: list[int]
    context_length: int


@dataclass
class Side:
    """One server's run: its tree, each request's latency and lm-eval's reading of each choice."""

    name: str
    tree: str
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    scores: dict[int, float] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return len(self.scores) / self.wall_s if self.wall_s else 0.0


def lm_eval_choices(model: str, limit: int, seed: int = 0) -> list[Choice]:
    """Every choice lm-eval scores for the two multiple-choice tasks, tokenized as the server tokenizes."""
    from acache.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    out = []
    for task in TASKS:
        for d, record in enumerate(task_records(task, limit, seed)):
            text = PROMPT.replace("{{story}}", record["story"]).replace("{{question}}", record["question"])
            context = tokenizer.encode(text)
            for i, choice in enumerate(record["choices"]):
                tail = tokenizer.encode(" " + choice, add_special_tokens=False)  # no BOS inside the sequence
                out.append(Choice(task, d, i, record["label"], context + tail, len(context)))
    return out


def export_tree(ref: str, repo: Path) -> Path:
    """The ``acache`` and ``acache_lab`` packages of commit ``ref``, in a new temporary directory."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "acache", "acache_lab"], capture_output=True)
    if archive.returncode:
        why = archive.stderr.decode(errors="replace").strip()
        raise ValueError(f"--baseline-ref {ref!r}: git archive failed: {why}")
    out = Path(tempfile.mkdtemp(prefix="acache-baseline-"))
    try:
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def _post(base: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_server(tree: Path, model: str, port: int, samples: int) -> subprocess.Popen:
    """``acache serve`` run from ``tree`` (its ``acache`` first on the path), once /health answers. A port that
    answers already is refused: the requests timed would go to that other server."""
    if _answers(port):
        raise ValueError(f"a server already answers on port {port}: stop it, or pass another --port")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("ACACHE_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "acache.cli", "serve", model, "--port", str(port),
                             "--served-model-name", "acache", "--loglikelihood-samples", str(samples),
                             "--log-level", "warning"], cwd=tree, env=env)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ValueError(f"the server from {tree} exited with code {proc.returncode} (its output says why)")
        if _answers(port):
            if proc.poll() is None:  # the answer is this process's, not one that took the port meanwhile
                return proc
        else:
            time.sleep(0.5)
    proc.kill()
    raise ValueError(f"the server from {tree} did not answer /health in 180 s")


def imported_from(tree: Path) -> str:
    """Where a process started as the server is ``acache`` imports it from."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", "import acache; print(acache.__file__)"], cwd=tree, env=env,
                          check=True, capture_output=True, text=True).stdout.strip()


def _round(base: str, side: Side, group: list[tuple[int, Choice]], per_request: int, concurrency: int) -> None:
    """``group`` sent to one server: ``concurrency`` requests at once of ``per_request`` prompts each."""
    requests = [group[i:i + per_request] for i in range(0, len(group), per_request)]

    def send(batch: list[tuple[int, Choice]]) -> None:
        body = {"model": "acache", "prompt": [c.token_ids for _, c in batch], "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": SEED, "echo": True}
        t0 = time.perf_counter()
        out = _post(base, body)
        side.latencies.append(time.perf_counter() - t0)
        for (index, c), choice in zip(batch, out["choices"], strict=True):
            side.scores[index] = sum(choice["logprobs"]["token_logprobs"][c.context_length:-1])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, requests))
    side.wall_s += time.perf_counter() - t0


def accuracy(choices: list[Choice], scores: dict[int, float], task: str) -> float:
    """lm-eval's ``acc``: the share of documents whose highest-scored choice is the label."""
    best: dict[int, tuple[float, int, int]] = {}
    for i, c in enumerate(choices):
        if c.task == task and (c.document not in best or scores[i] > best[c.document][0]):
            best[c.document] = (scores[i], c.choice, c.label)
    return sum(pick == label for _, pick, label in best.values()) / max(1, len(best))


def agreement(model: str, choices: list[Choice], a: dict[int, float], b: dict[int, float], samples: int,
              draws: int = 512) -> dict:
    """How far two servers' readings are apart: exactly (one-token choices, whose estimate has no randomness)
    and in standard errors of the difference of two independent ``samples``-draw estimates, one draw's spread
    measured from ``draws`` draws (the multi-token ones)."""
    import torch

    from acache.models.loader import load_model
    from acache.scoring import bound_draws

    m = load_model(model)
    exact, z = [], []
    for i, c in enumerate(choices):
        if len(c.token_ids) - c.context_length == 1:
            exact.append(abs(a[i] - b[i]))
            continue
        one, _ = bound_draws(m, c.token_ids, [c.context_length], draws, torch.Generator().manual_seed(i), 256)
        z.append(abs(a[i] - b[i]) / (float(one.std()) * math.sqrt(2 / samples)))
    return {"one_token_choices": len(exact), "max_abs_difference": max(exact, default=0.0),
            "multi_token_choices": len(z), "mean_abs_z": statistics.fmean(z) if z else 0.0,
            "max_abs_z": max(z, default=0.0)}


def markdown(sides: list[Side], choices: list[Choice], per_request: int, concurrency: int) -> str:
    lines = [f"{len(choices)} lm-eval loglikelihood choices ({', '.join(TASKS)}), {per_request} a request, "
             f"{concurrency} request(s) in flight", "",
             "| server | requests/s | choices/s | wall s | median latency s | acc qa1_mc | acc arith_mc |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in sides:
        lines.append(f"| {s.name} | {len(s.latencies) / s.wall_s:.3f} | {s.requests_per_s:.3f} | {s.wall_s:.1f} | "
                     f"{statistics.median(s.latencies):.2f} | {accuracy(choices, s.scores, TASKS[0]):.3f} | "
                     f"{accuracy(choices, s.scores, TASKS[1]):.3f} |")
    if len(sides) == 2:
        lines += ["", f"speed-up: {sides[1].requests_per_s / sides[0].requests_per_s:.2f}x"]
    return "\n".join(lines)


def main(args) -> int:
    from acache.paths import default_model

    model = str(Path(args.model or default_model()).resolve())
    here = Path(__file__).resolve().parents[2]
    trees = [("this tree", here)]
    exported = export_tree(args.baseline_ref, here) if args.baseline_ref else None
    if exported is not None:
        trees.insert(0, (f"baseline {args.baseline_ref}", exported))
    sides, procs, bases = [], [], []
    try:
        choices = lm_eval_choices(model, args.limit, args.seed)
        for k, (name, tree) in enumerate(trees):
            print(f"{name}: acache from {imported_from(tree)}", file=sys.stderr, flush=True)
            procs.append(start_server(tree, model, args.port + k, args.samples))
            bases.append(f"http://127.0.0.1:{args.port + k}")
            sides.append(Side(name, str(tree)))
        for base in bases:  # untimed: the first request of a server pays for its lazy set-up
            _post(base, {"model": "acache", "prompt": [choices[0].token_ids], "max_tokens": 1, "logprobs": 1,
                         "echo": True, "temperature": 0})
        size = args.per_request * args.concurrency
        rounds = [list(enumerate(choices))[i:i + size] for i in range(0, len(choices), size)]
        for r, group in enumerate(rounds):
            order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
            for k in order:
                time.sleep(args.pause)  # untimed: the other server's threads have gone quiet
                _round(bases[k], sides[k], group, args.per_request, args.concurrency)
            print(f"round {r + 1}/{len(rounds)}: " + ", ".join(f"{s.name} {s.wall_s:.1f} s" for s in sides),
                  file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        if exported is not None:
            shutil.rmtree(exported, ignore_errors=True)
    table = markdown(sides, choices, args.per_request, args.concurrency)
    report = {"model": model, "samples": args.samples, "limit": args.limit, "per_request": args.per_request,
              "concurrency": args.concurrency, "sides": [asdict(s) for s in sides]}
    if len(sides) == 2:
        report["agreement"] = agreement(model, choices, sides[0].scores, sides[1].scores, args.samples)
        a = report["agreement"]
        table += (f"\n\nsame estimates: {a['one_token_choices']} one-token choices (exact) differ by at most "
                  f"{a['max_abs_difference']:.2g}; {a['multi_token_choices']} multi-token choices differ by "
                  f"{a['mean_abs_z']:.2f} standard errors on average, {a['max_abs_z']:.2f} at most")
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
