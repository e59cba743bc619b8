"""``acache eval lm``: lm-evaluation-harness against ``acache serve``, on the shipped model's own tasks.

The task suite is written as lm-eval task files (YAML plus local JSONL, nothing fetched): two generate-until
tasks scored by exact match, and two multiple-choice tasks scored by the server's log-likelihood estimate
(:mod:`acache.scoring`), which lm-eval reads through ``echo`` + ``logprobs`` like any completions API. A server
is started unless ``--base-url`` names a running one; lm-eval itself runs as its own command line does.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from acache_lab.tasks.generators import PLACES, Example, held_out
from acache_lab.tasks.render import answer_length

PROMPT = "story : {{story}} question : {{question}} answer :"
#: task name -> (generator, lm-eval output type)
LM_TASKS = {"acache_qa1": ("qa1", "generate_until"), "acache_arith": ("arith", "generate_until"),
            "acache_qa1_mc": ("qa1", "multiple_choice"), "acache_arith_mc": ("arith", "multiple_choice")}
CHANCE = {"acache_qa1_mc": 1 / len(PLACES), "acache_arith_mc": 1 / 4}


def arith_choices(example: Example, rng: random.Random) -> tuple[list[str], int]:
    """The worked sum and three with a wrong total (off by one or two), in a seeded order."""
    *terms, total = example.answer
    right = int(total)
    wrong = rng.sample([t for t in (right - 2, right - 1, right + 1, right + 2) if t >= 0], 3)
    choices = [" ".join([*terms, str(t)]) for t in [right, *wrong]]
    rng.shuffle(choices)
    return choices, choices.index(" ".join(example.answer))


def task_records(task: str, limit: int, seed: int) -> list[dict]:
    generator, _ = LM_TASKS[task]
    rng = random.Random(f"lm-eval:{task}:{seed}")
    records = []
    for e in held_out(generator, limit, sentences=6, seed=seed):
        record = {"story": " ".join(e.affix), "question": " ".join(e.question), "answer": " ".join(e.answer)}
        if generator == "qa1":
            record["choices"], record["label"] = list(PLACES), PLACES.index(e.answer[0])
        else:
            record["choices"], record["label"] = arith_choices(e, rng)
        records.append(record)
    return records


def task_yaml(task: str, data: Path) -> str:
    """One lm-eval task file. JSON is valid YAML, so the file is written with json.dumps: no YAML library."""
    generator, kind = LM_TASKS[task]
    spec = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
            "test_split": "test", "output_type": kind, "doc_to_text": PROMPT}
    if kind == "generate_until":
        # the answer region the model was trained on; its EOS ends the text
        spec |= {"doc_to_target": "{{answer}}",
                 "generation_kwargs": {"until": ["."], "max_gen_toks": answer_length(generator), "do_sample": False},
                 "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    else:
        spec |= {"doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
                 "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    return json.dumps(spec, indent=2) + "\n"


def write_tasks(out: Path, limit: int, seed: int = 0) -> list[str]:
    """Writes every task's data and YAML under ``out``; returns the task names."""
    out.mkdir(parents=True, exist_ok=True)
    for task in LM_TASKS:
        data = out / f"{task}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in task_records(task, limit, seed)))
        (out / f"{task}.yaml").write_text(task_yaml(task, data))
    return list(LM_TASKS)


def _wait_healthy(base: str, proc: subprocess.Popen | None, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"no healthy server at {base} after {timeout_s:.0f} s")


def lm_eval_executable() -> str:
    """lm-eval's command line: beside this Python first (a venv not on PATH), then on PATH."""
    here = Path(sys.executable).parent / "lm-eval"
    exe = str(here) if here.is_file() else shutil.which("lm-eval")
    if exe is None:
        raise FileNotFoundError("lm-eval is not installed: pip install 'acache[lmeval]' (or run make eval-lm)")
    return exe


def lm_eval_command(exe: str, base: str, model_name: str, task_dir: Path, tasks: list[str], out: Path,
                    limit: int | None) -> list[str]:
    args = [exe, "run", "--model", "local-completions",
            "--model_args", f"base_url={base}/v1/completions,model={model_name},tokenizer_backend=remote,"
                            "max_length=256,max_retries=1",
            "--include_path", str(task_dir), "--tasks", ",".join(tasks), "--output_path", str(out)]
    if limit is not None:
        args += ["--limit", str(limit)]
    return args


def read_results(out: Path) -> dict:
    """The newest results file lm-eval wrote under ``out``."""
    files = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"lm-eval wrote no results under {out}")
    return json.loads(files[-1].read_text())["results"]


def markdown(results: dict, model: str, samples: int, limit: int, seconds: float, base_url: str | None = None) -> str:
    """The results table, under what was scored: the server this command started, or ``base_url``, a server it
    did not start (whose model and samples it does not know)."""
    served = (f"the server at {base_url} (started elsewhere: its model and --loglikelihood-samples are its own)"
              if base_url else f"`acache serve {model} --loglikelihood-samples {samples}`")
    lines = [f"lm-eval (local-completions, remote tokenizer) against {served}, {limit} held-out documents a task, "
             f"{seconds / 60:.1f} min on this machine.", "",
             "| task | kind | metric | score | ± stderr | chance |", "|---|---|---|---:|---:|---:|"]
    for task in LM_TASKS:
        if task not in results:
            continue
        row = results[task]
        metric = "exact_match" if LM_TASKS[task][1] == "generate_until" else "acc"
        value = row.get(f"{metric},none")
        err = row.get(f"{metric}_stderr,none")
        chance = f"{CHANCE[task]:.3f}" if task in CHANCE else "—"
        value_text = f"{value:.3f}" if isinstance(value, (int, float)) else "—"
        err_text = f"{err:.3f}" if isinstance(err, (int, float)) else "—"
        lines.append(f"| {task} | {LM_TASKS[task][1]} | {metric} | {value_text} | {err_text} | {chance} |")
    return "\n".join(lines) + "\n"


def main(args) -> int:
    from acache.paths import default_model

    if args.variance:
        rows = variance_study(args.model or str(default_model()), [1, 4, 16, 64], seeds=8, documents=args.limit,
                              seed=args.seed)
        print("| MC samples | standard error, mean over documents | worst document | accuracy | pick differs "
              "from 64 samples |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['samples']} | {r['stderr_mean']:.2f} | {r['stderr_worst']:.2f} | {r['accuracy']:.3f} | "
                  f"{r['pick_differs']:.3f} |")
        return 0

    model = args.model or str(default_model())
    exe = lm_eval_executable()
    out = Path(args.out)
    task_dir = out / "tasks"
    tasks = write_tasks(task_dir, args.limit, args.seed)
    if args.tasks:
        unknown = sorted(set(args.tasks) - set(tasks))
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; known: {', '.join(tasks)}")
        tasks = args.tasks
    proc = None
    base = args.base_url.rstrip("/") if args.base_url else f"http://127.0.0.1:{args.port}"
    started = time.time()
    try:
        if args.base_url is None:
            print(f"starting acache serve {model} on {base} ...", file=sys.stderr, flush=True)
            server_env = {k: v for k, v in os.environ.items() if k != "ACACHE_API_KEY"}  # lm-eval sends no key
            proc = subprocess.Popen([sys.executable, "-m", "acache.cli", "serve", model, "--port", str(args.port),
                                     "--served-model-name", "acache", "--loglikelihood-samples",
                                     str(args.samples), "--log-level", "warning"], env=server_env)
        try:
            _wait_healthy(base, proc)
        except RuntimeError as exc:
            print(f"acache eval lm: error: {exc}", file=sys.stderr)
            return 1
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        command = lm_eval_command(exe, base, "acache", task_dir, tasks, out / "results", args.limit)
        print("running", " ".join(command), file=sys.stderr, flush=True)
        code = subprocess.run(command, env=env).returncode
        if code != 0:
            print(f"acache eval lm: error: lm-eval exited with code {code} (its output is above)", file=sys.stderr)
            return code
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    results = read_results(out / "results")
    table = markdown(results, model if args.model else "models/acache-tiny", args.samples, args.limit,
                     time.time() - started, args.base_url and base)
    (out / "lm_eval.md").write_text(table)
    print(table)
    print(f"wrote {out / 'lm_eval.md'}")
    return 0


def variance_study(model_dir: str, samples: list[int], seeds: int, documents: int, draws: int = 1024,
                   seed: int = 0) -> list[dict]:
    """How much the Monte Carlo estimate moves with its draws, on arithmetic answers (five tokens each, so the
    draws matter; a one-token continuation's estimate is exact).

    The standard error at ``n`` samples is ``sigma / sqrt(n)``, with ``sigma`` the standard deviation of one
    draw of the right answer's estimate, measured from ``draws`` draws a document (mean and worst over the
    documents). Accuracy and how often the pick differs from the pick at the largest ``n`` are counted over
    ``seeds`` seeds a document. ``seed`` picks the held-out documents (``eval lm --seed``)."""
    import statistics

    import torch
    from tqdm.auto import tqdm

    from acache.llm import LLM
    from acache.scoring import bound_draws, continuation_logprob

    llm = LLM(model_dir)
    encode = llm.inputs.encode_text
    records = task_records("acache_arith_mc", documents, seed=seed)
    contexts = [encode(f"story : {r['story']} question : {r['question']} answer :") for r in records]
    sigmas = []
    for ctx, r in zip(tqdm(contexts, desc="one-draw spread", unit="doc"), records, strict=True):
        ids = ctx + encode(" " + r["choices"][r["label"]])  # lm-eval's target delimiter
        one, _ = bound_draws(llm.model, ids, [len(ctx)], draws, torch.Generator().manual_seed(10_000), 256)
        sigmas.append(float(one.std()))
    picks_at: dict[int, list[list[int]]] = {}
    bar = tqdm(total=len(samples) * len(records), desc="picks by samples", unit="doc")
    for n in samples:
        picks_at[n] = []
        for ctx, r in zip(contexts, records, strict=True):
            bar.update(1)
            per_seed = [[continuation_logprob(llm.model, ctx, encode(" " + c), n, torch.Generator().manual_seed(s))
                         for c in r["choices"]] for s in range(seeds)]
            picks_at[n].append([max(range(len(scores)), key=scores.__getitem__) for scores in per_seed])
    bar.close()
    rows = []
    last = picks_at[samples[-1]]
    for n in samples:
        picks = picks_at[n]
        total = len(records) * seeds
        right = sum(p == r["label"] for ps, r in zip(picks, records, strict=True) for p in ps)
        flips = sum(a != b for ps, qs in zip(picks, last, strict=True) for a, b in zip(ps, qs, strict=True))
        rows.append({"samples": n, "stderr_mean": statistics.fmean(sigmas) / n ** 0.5,
                     "stderr_worst": max(sigmas) / n ** 0.5, "accuracy": right / total, "pick_differs": flips / total})
    return rows
