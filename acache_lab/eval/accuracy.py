"""``acache eval accuracy``: how much direct affix reuse loses, and how much each anchor selector recovers.

For every task x layout the held-out requests are decoded with threshold 0.9 on the dual cache under
every policy: full recomputation without the affix cache (``full``), direct reuse (``none``), all
anchors (``all``), and each selector at each anchor ratio. A ratio of 0 selects no anchor, which is
direct reuse by definition, so those points are the ``none`` run and are not decoded again. A task whose
affix is demonstrations also runs without them (``without``), which shows what they are worth.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from acache.llm import LLM
from acache.policies import LAYOUTS, ONE_PASS_SELECTORS
from acache_lab.eval.cost import exact_affixes, fresh_affix_columns, request_passes
from acache_lab.eval.metrics import REFERENCE_LABELS, REFERENCES, Cell, summary_table, sweep_table, target_table
from acache_lab.eval.tasks import exact_matches, refuse_unread_suffix, task_params, task_prompts
from acache_lab.tasks.generators import DEMO_TASKS, TASKS, held_out, parse_tasks
from acache_lab.tasks.render import TWO_AFFIXES, answer_length, render_prompts

RATIOS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)
STUDY_SELECTORS = ("attention", "attention-full", "attention-shallow", "attention-deviation", "influence",
                   "kv-deviation", "cacheblend", "query-attention", "first-k", "random", "bicache-matched",
                   "attention-2p", "attention-deviation-2p", "cacheblend-2p", "query-attention-2p")
#: the project's own selectors, each held against the issue's target in the report
OURS = ("attention-deviation", "influence")
#: the one-pass depths the study can run beside every layer (``<selector>-d50``: ``anchor_depth`` 0.5)
DEPTHS = (0.25, 0.5)
#: study labels that are a policy with other settings: ACache with queries from a no-cache forward or from the
#: probe's first layers, and ACache whose selection probe also decodes the first step (``probe_step``)
VARIANTS = {"attention-full": {"selector": "attention", "anchor_query": "full"},
            "attention-shallow": {"selector": "attention", "anchor_query": "shallow"},
            "attention-probe-step": {"selector": "attention", "probe_step": True},
            **{f"{s}-2p": {"selector": s, "anchor_pass": "two"} for s in ONE_PASS_SELECTORS},
            **{f"{s}-d{round(100 * d)}": {"selector": s, "anchor_pass": "one", "anchor_depth": d}
               for s in ONE_PASS_SELECTORS for d in DEPTHS}}


def sweep(llm: LLM, examples: int = 300, sentences: int = 6, seed: int = 0, tasks: tuple[str, ...] = TASKS,
          layouts: tuple[str, ...] = LAYOUTS, selectors: tuple[str, ...] = STUDY_SELECTORS,
          ratios: tuple[float, ...] = RATIOS, progress: bool = True, gen_length: int | None = None,
          into: list[Cell] | None = None) -> list[Cell]:
    """Every point of the study; exact match of the whole answer (worked sums included). ``gen_length`` gives
    each answer that many columns instead of its region's, so that it must also end itself (:func:`task_params`).
    The cells go into ``into`` as they are measured, so that a caller keeps them if the sweep is stopped."""
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]
    if bad:
        raise ValueError(f"anchor ratios must be in [0, 1], got {bad[0]}")
    runs: list[tuple[str, float, str | None]] = [("full", 0.0, None), ("none", 0.0, "none"), ("all", 1.0, "all")]
    runs += [(s, r, VARIANTS.get(s, {"selector": s})["selector"]) for s in selectors for r in ratios if r > 0]
    cells: list[Cell] = into if into is not None else []
    total = sum(len(runs) + (t in DEMO_TASKS) for t in tasks) * len(layouts)
    bar = tqdm(total=total, desc="accuracy sweep", unit="cell", disable=not progress)
    for task in tasks:
        exs = held_out(task, examples, sentences, seed)
        for layout in layouts:
            prompts = task_prompts(llm, exs, layout)
            if task in DEMO_TASKS:  # the same requests with the demonstrations left out, fully recomputed
                bare = render_prompts(llm.tokenizer, exs, layout, drop_affix=True)
                correct = exact_matches(llm, bare, exs, task_params(task, gen_length, selector=None, seed=seed))
                cells.append(Cell(task, layout, "without", 0.0, correct, len(exs),
                                  compute_cost(llm, bare, task, None, "probe", 0.0, gen_length=gen_length),
                                  gen_length))
                bar.update(1)
            for label, ratio, policy in runs:
                extra = {k: v for k, v in VARIANTS.get(label, {}).items() if k != "selector"}
                query = extra.get("anchor_query", "probe")
                params = task_params(task, gen_length, selector=policy, anchor_ratio=ratio, seed=seed, **extra)
                correct = exact_matches(llm, prompts, exs, params)
                cost = compute_cost(llm, prompts, task, None if label == "full" else policy, query, ratio,
                                    params.resolved_anchor_pass, params.resolved_anchor_depth, gen_length)
                cells.append(Cell(task, layout, label, ratio, correct, len(exs), cost, gen_length))
                if label == "none":  # ratio 0 is direct reuse for every selector
                    cells += [Cell(task, layout, s, 0.0, correct, len(exs), cost, gen_length) for s in selectors
                              if 0.0 in ratios]
                bar.update(1)
    bar.close()
    return cells


def compute_cost(llm: LLM, prompts, task: str, policy: str | None, query: str, ratio: float,
                 anchor_pass: str | None = None, anchor_depth: float = 1.0,
                 gen_length: int | None = None) -> float | None:
    """Mean selection + refresh passes of the requests, in full forwards of each request's canvas (None for
    BiCache, which recomputes layers rather than tokens)."""
    if policy is not None and policy.startswith("bicache"):
        return None
    layers, gen = llm.config.num_layers, gen_length or answer_length(task)
    shares = []
    for p in prompts:
        canvas = len(p.token_ids) + gen
        spent = request_passes(policy, query, canvas, [a.length for a in p.affixes], layers, ratio, anchor_pass,
                               anchor_depth, exact_affixes(llm.config, p, gen),
                               fresh_affix_columns(llm.config, p, gen, shifted=llm.model.shifted_logits))
        shares.append(spent / (canvas * layers))
    return sum(shares) / len(shares)


def _panels(cells: list[Cell], path: str | Path, draw, xlabel: str) -> bool:
    """A panel per task (row) and layout (column), each drawn by ``draw(ax, its cells)``; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tasks = list(dict.fromkeys(c.task for c in cells))
    layouts = list(dict.fromkeys(c.layout for c in cells))
    fig, axes = plt.subplots(len(tasks), len(layouts), figsize=(4.2 * len(layouts), 3.2 * len(tasks)),
                             squeeze=False, sharey=True)
    for i, task in enumerate(tasks):
        for j, layout in enumerate(layouts):
            ax = axes[i][j]
            draw(ax, [c for c in cells if c.task == task and c.layout == layout])
            ax.set_title(f"{task} — {layout}")
            ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel("exact match (%)")
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_compute(cells: list[Cell], path: str | Path) -> bool:
    """Accuracy against what each policy spends (selection plus the refresh, in full forwards of the
    canvas), a line per selector over its ratios: "recovers more at the same cost" reads left-to-right."""
    def draw(ax, mine: list[Cell]) -> None:
        mine = [c for c in mine if c.compute is not None]
        for ref, marker in (("none", "x"), ("full", "s")):
            for c in (c for c in mine if c.selector == ref):
                ax.scatter([c.compute], [100 * c.accuracy], marker=marker, color="black", zorder=3,
                           label="direct reuse" if ref == "none" else "full recompute")
        colors: dict[str, str] = {}
        for sel in dict.fromkeys(c.selector for c in mine if c.selector not in REFERENCES):
            pts = sorted((c for c in mine if c.selector == sel and c.ratio > 0), key=lambda c: c.ratio)
            if pts:  # BiCache has no token count to cost
                # a selection of its own dashed, a shallower one pass dotted, in the one-pass form's colour
                base = re.sub(r"-(2p|d\d+)$", "", sel)
                style = "-" if sel == base else "--" if sel.endswith("-2p") else ":"
                line = ax.plot([c.compute for c in pts], [100 * c.accuracy for c in pts], marker="o", ms=3,
                               linestyle=style, color=colors.get(base),
                               linewidth=2.2 if base in ("attention", "attention-deviation") else 1.0, label=sel)
                colors.setdefault(base, line[0].get_color())

    return _panels(cells, path, draw, "selection + refresh (full forwards)")


def plot_sweep(cells: list[Cell], path: str | Path) -> bool:
    """Accuracy against anchor ratio: a row per task, a panel per layout, 95% intervals as error bars,
    direct reuse and full recomputation as reference lines."""
    def draw(ax, mine: list[Cell]) -> None:
        for ref, style in (("none", ":"), ("full", "--"), ("without", "-.")):
            for c in (c for c in mine if c.selector == ref):
                ax.axhline(100 * c.accuracy, color="grey", linestyle=style,
                           label={"none": "direct reuse", "full": "full recompute"}.get(ref, REFERENCE_LABELS[ref]))
        for sel in dict.fromkeys(c.selector for c in mine if c.selector not in REFERENCES):
            pts = sorted((c for c in mine if c.selector == sel), key=lambda c: c.ratio)
            err = [[100 * (c.accuracy - c.interval[0]) for c in pts], [100 * (c.interval[1] - c.accuracy)
                                                                       for c in pts]]
            ax.errorbar([c.ratio for c in pts], [100 * c.accuracy for c in pts], yerr=err, marker="o", ms=3,
                        capsize=2, linewidth=2.2 if sel == "attention" else 1.0,
                        label="ACache (attention)" if sel == "attention" else sel)

    return _panels(cells, path, draw, "anchor ratio")


def write_report(cells: list[Cell], out_dir: str | Path) -> list[Path]:
    """``accuracy.json``, ``accuracy.md`` (summary plus one table per task and layout) and the plot."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps([c.as_dict() for c in cells], indent=1) + "\n")
    (out / "accuracy.md").write_text(report_markdown(cells))
    written = [out / "accuracy.json", out / "accuracy.md"]
    if plot_sweep(cells, out / "accuracy.png"):
        written.append(out / "accuracy.png")
    if plot_compute(cells, out / "accuracy_compute.png"):
        written.append(out / "accuracy_compute.png")
    return written


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be: handled alike, told apart by the exit status."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """A SIGTERM (``timeout``, a batch scheduler) raises :class:`Terminated` inside, so a long sweep stopped that way
    keeps its cells as Ctrl-C does; the handler before is put back after. Only in the main thread, where Python
    delivers signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Terminated

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def report_markdown(cells: list[Cell]) -> str:
    """``accuracy.md``: the summary, our selectors against the target, one table per task and layout."""
    parts = ["## Summary (anchor ratio 0.2)", "", summary_table(cells), ""]
    rooms = sorted({c.gen_length for c in cells if c.gen_length is not None})
    if rooms:
        columns = ", ".join(map(str, rooms))
        parts[1:1] = ["", f"Answers decoded in {columns} columns (`--gen-length`), not in each task's own region: "
                      "a right answer also ends itself."]
    for ours in (s for s in OURS if any(c.selector == s for c in cells)):
        parts += [f"## Our selector `{ours}` against the target (anchor ratio 0.2: at least 90% of the gap, above "
                  "every non-oracle selector beyond the intervals)", "", target_table(cells, ours), ""]
    for task, layout in dict.fromkeys((c.task, c.layout) for c in cells):
        parts += [f"## {task}, {layout}", "", sweep_table(cells, task, layout), ""]
    return "\n".join(parts)


def parse_selectors(text: str | None, profiled: bool) -> tuple[str, ...]:
    """The study's selectors from ``a,b,c`` (default: every one of :data:`STUDY_SELECTORS`, and
    ``bicache-profiled`` with a profile); the variants outside it are chosen by name."""
    every = STUDY_SELECTORS + (("bicache-profiled",) if profiled else ())
    if text is None:
        return every
    every += tuple(v for v in VARIANTS if v not in every)
    chosen = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in chosen if x not in every]
    if bad or not chosen:
        hint = " (bicache-profiled needs --bicache-profile)" if "bicache-profiled" in bad else ""
        raise ValueError(f"unknown study selector {bad[0] if bad else text!r}{hint}; known: {', '.join(every)}")
    return chosen


def parse_ratios(text: str | None) -> tuple[float, ...]:
    """Anchor ratios from ``0.1,0.2`` (default :data:`RATIOS`), each in [0, 1]."""
    if text is None:
        return RATIOS
    try:
        ratios = tuple(dict.fromkeys(float(x) for x in text.split(",")))
    except ValueError:
        raise ValueError(f"--ratios takes comma-separated numbers in [0, 1], got {text!r}") from None
    bad = [r for r in ratios if not 0.0 <= r <= 1.0]
    if bad:
        raise ValueError(f"anchor ratios must be in [0, 1], got {bad[0]}")
    return ratios


def main(args) -> int:
    tasks = parse_tasks(args.tasks)
    layouts = tuple(dict.fromkeys(x.strip() for x in args.layouts.split(","))) if args.layouts else LAYOUTS
    bad = [x for x in layouts if x not in (*LAYOUTS, TWO_AFFIXES)]
    if bad:
        raise ValueError(f"unknown layout {bad[0]!r}; known: {', '.join((*LAYOUTS, TWO_AFFIXES))}")
    plain = [t for t in tasks if t not in DEMO_TASKS]
    if TWO_AFFIXES in layouts and plain:
        raise ValueError(f"the {TWO_AFFIXES} layout needs tasks with demonstrations ({', '.join(DEMO_TASKS)}); "
                         f"{plain[0]} has none")
    gen_length = getattr(args, "gen_length", None)
    for task in tasks:  # every task's room is checked before the model loads
        task_params(task, gen_length)
    selectors = parse_selectors(args.selectors, bool(args.bicache_profile))  # before the model loads
    ratios = parse_ratios(args.ratios)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_batch_size=args.batch_size,
              bicache_profile=args.bicache_profile)
    refuse_unread_suffix(llm, layouts)
    cells: list[Cell] = []
    try:
        with terminate_as_interrupt():
            sweep(llm, args.examples, args.sentences, args.seed, tasks, layouts, selectors, ratios,
                  gen_length=gen_length, into=cells)
    except BaseException as exc:  # Ctrl-C, a SIGTERM, or a later cell's fault: what was measured is kept
        if cells:
            partial = Path(args.out) / "partial"
            write_report(cells, partial)
            print(f"stopped ({type(exc).__name__}): the {len(cells)} cells measured so far are in {partial} (not "
                  "the report)", file=sys.stderr)
        if isinstance(exc, KeyboardInterrupt):
            return 143 if isinstance(exc, Terminated) else 130  # as acache train exits
        raise
    written = write_report(cells, args.out)
    shutil.rmtree(Path(args.out) / "partial", ignore_errors=True)  # an earlier stopped run's, now superseded
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([c.as_dict() for c in cells], indent=1) + "\n")
        written.append(Path(args.json))
    print(summary_table(cells))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
