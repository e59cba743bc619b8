"""How stale is an affix's cached K/V, and what BiCache makes of it. Per layer, the cosine similarity of an
affix's K and V computed alone (positions 0..n-1, as the store keeps them) against the same tokens computed in
a request's context: :func:`measure_staleness` for one request, :func:`profile_bicache` turning many into
BiCache's depth table, and ``acache eval staleness`` averaging them per task and layout (the cause of whatever
direct reuse loses). The runtime only reads the table (:class:`acache.affix.bicache.BiCacheProfile`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from acache.affix.bicache import DEFAULT_TAU, BiCacheProfile
from acache.affix.persistence import model_fingerprint
from acache.affix.prompt import AffixPrompt
from acache.affix.store import AffixStore
from acache.decoding.canvas import build_canvas
from acache.llm import LLM
from acache.policies import LAYOUTS
from acache_lab.eval.tasks import task_prompts
from acache_lab.tasks.generators import TASKS, held_out
from acache_lab.tasks.render import answer_length


@dataclass
class Staleness:
    key_cosine: list[float]  # per layer, mean over the request's affix tokens and KV heads
    value_cosine: list[float]
    affix_share: float  # affix tokens / all tokens of the canvas (generation region included)

    def safe_layers(self, tau: float) -> int:
        """Leading layers whose K and V both stay at or above ``tau`` (BiCache's safe shallow depth)."""
        count = 0
        for k, v in zip(self.key_cosine, self.value_cosine, strict=True):
            if min(k, v) < tau:
                break
            count += 1
        return count


@torch.inference_mode()
def measure_staleness(store: AffixStore, prompt: AffixPrompt, gen_length: int) -> Staleness:
    """Staleness of every affix of ``prompt`` on its all-mask canvas (the state anchors are chosen in)."""
    if not prompt.affixes:
        raise ValueError("the prompt has no affix to measure")
    model = store.model
    cfg = model.config
    canvas = build_canvas([prompt.layout], gen_length, cfg.mask_token_id, cfg.pad_token_id, model.device)
    full = model(canvas.tokens, canvas.positions, canvas.valid, return_kv=True).kv
    k_sum = torch.zeros(cfg.num_layers)
    v_sum = torch.zeros(cfg.num_layers)
    n = 0
    for span in prompt.affixes:
        entry = store.compute(prompt.affix_ids(span))
        c0 = canvas.column(0, span.start)
        for layer in range(cfg.num_layers):
            k_ctx = full.keys[layer][0, c0:c0 + span.length].float()
            v_ctx = full.values[layer][0, c0:c0 + span.length].float()
            k_sum[layer] += F.cosine_similarity(k_ctx, entry.keys[layer].float(), dim=-1).mean(-1).sum().cpu()
            v_sum[layer] += F.cosine_similarity(v_ctx, entry.values[layer].float(), dim=-1).mean(-1).sum().cpu()
        n += span.length
    share = n / canvas.total
    return Staleness((k_sum / n).tolist(), (v_sum / n).tolist(), share)


def profile_bicache(store: AffixStore, prompts: Sequence[AffixPrompt], gen_length: int, tau: float = DEFAULT_TAU,
                    bins: int = 10, progress: bool = True) -> BiCacheProfile:
    """Builds the depth table from calibration prompts. Each share bin keeps its most cautious (smallest)
    safe depth; a bin without samples borrows from the nearest bin that has some."""
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    layers = len(store.model.layers)
    found: list[list[int]] = [[] for _ in range(bins)]
    for prompt in tqdm(prompts, desc="bicache-profile", unit="req", disable=not progress):
        s = measure_staleness(store, prompt, gen_length)
        # bin k holds shares in (k/bins, (k+1)/bins], as depth() reads them
        found[min(bins - 1, max(0, math.ceil(s.affix_share * bins - 1e-12) - 1))].append(s.safe_layers(tau))
    if not any(found):
        raise ValueError("BiCache profiling needs at least one calibration prompt with an affix")
    safe = [min(v) if v else None for v in found]
    filled = []
    for i in range(bins):
        if safe[i] is not None:
            filled.append(safe[i])
            continue
        near = min((j for j in range(bins) if safe[j] is not None), key=lambda j: (abs(j - i), j))
        filled.append(safe[near])

    return BiCacheProfile(layers, tau, [(i + 1) / bins for i in range(bins)], filled, [len(v) for v in found],
                          model_fingerprint(store.model))


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
    # a block-causal model reads no text after its answer: its suffix layout says nothing, and is left out
    layouts = tuple(x for x in LAYOUTS if x != "suffix") if getattr(llm.model, "block_causal", False) else LAYOUTS
    records = profile(llm, args.examples, args.sentences, args.seed, layouts=layouts)
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
