"""Exact-match statistics for the studies: binomial intervals and the tables the docs print."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


def wilson_interval(correct: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% at the default ``z``).

    Chosen over the normal approximation because it stays inside [0, 1] and is sensible at 0% and
    100%, which the sweep hits (direct reuse that collapses, full recompute that is perfect).
    """
    if total <= 0:
        raise ValueError("an interval needs at least one trial")
    if not 0 <= correct <= total:
        raise ValueError(f"correct must be in [0, {total}], got {correct}")
    p = correct / total
    z2 = z * z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    # exactly 0 at 0% and 1 at 100% (rounding would leave the point a hair outside its own interval)
    lo = 0.0 if correct == 0 else max(0.0, centre - half)
    hi = 1.0 if correct == total else min(1.0, centre + half)
    return min(lo, p), max(hi, p)


#: the rows every selector is read against: direct reuse, all anchors, full recomputation, and (for tasks
#: whose affix is demonstrations) full recomputation with the demonstrations left out
REFERENCES = ("none", "all", "full", "without")
#: selectors that read what they should predict (the in-context K/V), never a serving option
ORACLES = ("kv-deviation",)
REFERENCE_LABELS = {"none": "direct reuse (none)", "all": "all anchors (all)", "full": "full recompute, no cache",
                    "without": "demonstrations removed"}


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: a task, a layout, a policy and an anchor ratio."""

    task: str
    layout: str
    selector: str  # a selector (or a study variant); ``full`` is full recomputation without the affix cache
    ratio: float
    correct: int
    total: int
    compute: float | None = None  # mean selection + refresh passes a request, in full forwards of its canvas
    gen_length: int | None = None  # the answer's room when it was not the task's region (``--gen-length``)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total

    @property
    def interval(self) -> tuple[float, float]:
        return wilson_interval(self.correct, self.total)

    def as_dict(self) -> dict:
        lo, hi = self.interval
        out = {"task": self.task, "layout": self.layout, "selector": self.selector, "ratio": self.ratio,
               "correct": self.correct, "total": self.total, "accuracy": self.accuracy, "ci95": [lo, hi]}
        if self.compute is not None:
            out["compute"] = self.compute
        if self.gen_length is not None:
            out["gen_length"] = self.gen_length
        return out

    @classmethod
    def from_dict(cls, raw: dict) -> Cell:
        return cls(raw["task"], raw["layout"], raw["selector"], float(raw["ratio"]), int(raw["correct"]),
                   int(raw["total"]), raw.get("compute"), raw.get("gen_length"))


def _pct(cell: Cell | None) -> str:
    if cell is None:
        return "–"
    lo, hi = cell.interval
    return f"{100 * cell.accuracy:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"


def sweep_table(cells: list[Cell], task: str, layout: str) -> str:
    """Markdown: one row per selector, one column per ratio, accuracy with its 95% interval."""
    mine = [c for c in cells if c.task == task and c.layout == layout]
    if not mine:
        raise ValueError(f"no results for task {task!r} in layout {layout!r}")
    ratios = sorted({c.ratio for c in mine if c.selector not in REFERENCES})
    selectors = list(dict.fromkeys(c.selector for c in mine if c.selector not in REFERENCES))
    at = {(c.selector, c.ratio): c for c in mine}
    lines = ["| selector | " + " | ".join(f"{r:g}" for r in ratios) + " |",
             "|---|" + "---:|" * len(ratios)]
    for sel in selectors:
        lines.append(f"| {sel} | " + " | ".join(_pct(at.get((sel, r))) for r in ratios) + " |")
    refs = [c for c in mine if c.selector in REFERENCES]
    for ref in sorted(refs, key=lambda c: REFERENCES.index(c.selector)):
        lines.append(f"| {REFERENCE_LABELS[ref.selector]} | " + " | ".join(_pct(ref) for _ in ratios) + " |")
    return "\n".join(lines)


def summary_table(cells: list[Cell], focus_ratio: float = 0.2, ours: str = "attention") -> str:
    """Markdown, one row per task and layout: direct reuse, ours at ``focus_ratio``, the best other row at that
    ratio (the oracle and ours in another form included: a study of one form against another names it; the target
    table leaves both out), and full recomputation (the headline comparison of the study)."""
    keys = list(dict.fromkeys((c.task, c.layout) for c in cells))
    lines = [f"| task | layout | direct reuse | ACache ({ours}) @ {focus_ratio:g} | best other @ {focus_ratio:g} "
             "| full recompute |", "|---|---|---:|---:|---|---:|"]
    for task, layout in keys:
        mine = {(c.selector, c.ratio): c for c in cells if c.task == task and c.layout == layout}
        direct = next((c for (s, _), c in mine.items() if s == "none"), None)
        full = next((c for (s, _), c in mine.items() if s == "full"), None)
        acache = mine.get((ours, focus_ratio))
        others = [c for (s, r), c in mine.items() if r == focus_ratio and s != ours and s not in REFERENCES]
        best = max(others, key=lambda c: c.correct, default=None)
        best_txt = f"{best.selector}: {_pct(best)}" if best else "–"
        lines.append(f"| {task} | {layout} | {_pct(direct)} | {_pct(acache)} | {best_txt} | {_pct(full)} |")
    return "\n".join(lines)


def _share_text(share: float, target: float) -> str:
    """A share in whole percent, but with a decimal where rounding would read as the target reached (89.7% is not
    90%, and the row says the target is not met)."""
    whole = f"{100 * share:.0f}%"
    return f"{100 * share:.1f}%" if share < target <= float(whole[:-1]) / 100 else whole


def target_table(cells: list[Cell], ours: str = "attention-deviation", ratio: float = 0.2,
                 target: float = 0.9) -> str:
    """Markdown, one row per task and layout: our selector at ``ratio`` against the issue's target, its
    share of the gap between direct reuse and full recomputation (at least ``target``; at most 100%), and whether
    it is above the best other non-oracle selector by more than the intervals (its lower bound over their upper).
    Its own forms (``-2p``, ``-dNN``) are not others. A gap inside the intervals has no share, and no target."""
    lines = [f"| task | layout | direct reuse | full recompute | {ours} @ {ratio:g} | share of the gap "
             f"| best other non-oracle @ {ratio:g} | above it beyond the intervals | target met |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for task, layout in dict.fromkeys((c.task, c.layout) for c in cells):
        mine = {(c.selector, c.ratio): c for c in cells if c.task == task and c.layout == layout}
        direct = next((c for (s, _), c in mine.items() if s == "none"), None)
        full = next((c for (s, _), c in mine.items() if s == "full"), None)
        own = mine.get((ours, ratio))
        if direct is None or full is None or own is None:
            continue
        gap = full.accuracy - direct.accuracy
        real = full.interval[0] > direct.interval[1]  # a gap beyond the intervals: a share of it means something
        share = min(1.0, (own.accuracy - direct.accuracy) / gap) if real else None
        own_forms = re.compile(rf"{re.escape(ours)}(-2p|-d\d+)?")
        others = [c for (s, r), c in mine.items() if r == ratio and not own_forms.fullmatch(s)
                  and s not in REFERENCES + ORACLES]
        best = max(others, key=lambda c: c.correct, default=None)
        ahead = best is None or own.interval[0] > best.interval[1]
        met = "n/a" if share is None else "yes" if share >= target and ahead else "no"
        lines.append(f"| {task} | {layout} | {_pct(direct)} | {_pct(full)} | {_pct(own)} | "
                     + (_share_text(share, target) if share is not None else "no gap beyond the intervals") + " | "
                     + (f"{best.selector}: {_pct(best)}" if best else "–") + f" | {'yes' if ahead else 'no'} | "
                     + f"{met} |")
    return "\n".join(lines)
