"""``acache eval staleness``: per layer, how far an affix's K/V computed alone is from the same tokens
computed in a request's context (cosine similarity), averaged per task and layout — BiCache's
profile, and the cause of whatever direct reuse loses."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm.auto import tqdm

from acache.affix.staleness import measure_staleness
from acache.llm import LLM
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import task_prompts
from acache_lab.tasks.generators import TASKS, held_out
from acache_lab.tasks.render import answer_length


def profile(llm: LLM, examples: int = 50, sentences: int = 6, seed: int = 0, tasks: tuple[str, ...] = TASKS,
            layouts: tuple[str, ...] = LAYOUTS, progress: bool = True) -> list[dict]:
    """One record per task and layout: mean key and value cosine per layer and the weakest layer."""
    records = []
    bar = tqdm(total=len(tasks) * len(layouts) * examples, desc="staleness", unit="req", disable=not progress)
    for task in tasks:
        exs = held_out(task, examples, sentences, seed)
        for layout in layouts:
            runs = []
            for prompt in task_prompts(llm, exs, layout):
                runs.append(measure_staleness(llm.affix_store, prompt, answer_length(task)))
                bar.update(1)
            # six decimals: the last float digits differ between CPUs, and the study's files must not
            keys = [round(sum(layer) / len(runs), 6) for layer in zip(*(r.key_cosine for r in runs), strict=True)]
            values = [round(sum(layer) / len(runs), 6) for layer in zip(*(r.value_cosine for r in runs), strict=True)]
            records.append({"task": task, "layout": layout, "examples": len(exs), "key_cosine": keys,
                            "value_cosine": values, "min_cosine": min(keys + values)})
    bar.close()
    return records


def plot_profile(records: list[dict], path: str | Path) -> bool:
    """One panel per task: K (solid) and V (dashed) cosine per layer, a colour per layout."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tasks = list(dict.fromkeys(r["task"] for r in records))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.3), squeeze=False, sharey=True)
    colours = {"prefix": "tab:blue", "infix": "tab:orange", "suffix": "tab:green"}
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in records if r["task"] == task):
            layers = range(len(r["key_cosine"]))
            c = colours.get(r["layout"])
            ax.plot(layers, r["key_cosine"], color=c, marker="o", ms=3, label=f"{r['layout']} K")
            ax.plot(layers, r["value_cosine"], color=c, marker="s", ms=3, linestyle="--", label=f"{r['layout']} V")
        ax.set_title(task)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("cosine, alone vs in context")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args) -> int:
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    records = profile(llm, args.examples, args.sentences, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "staleness.json").write_text(json.dumps(records, indent=1) + "\n")
    plotted = plot_profile(records, out / "staleness.png")
    print("| task | layout | min cosine | K cosine per layer |")
    print("|---|---|---:|---|")
    for r in records:
        print(f"| {r['task']} | {r['layout']} | {r['min_cosine']:.4f} | "
              + " ".join(f"{k:.3f}" for k in r["key_cosine"]) + " |")
    print(f"wrote {out / 'staleness.json'}" + (f", {out / 'staleness.png'}" if plotted else ""))
    return 0
