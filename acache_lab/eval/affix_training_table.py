"""Before/after table and plot of affix-aware training, from two sets of `acache eval accuracy` runs.

    python -m acache_lab.eval.affix_training_table BEFORE_DIR AFTER_DIR --md OUT.md --plot OUT.png

Each DIR holds sub-directories (base, demonstrations, long) with an accuracy.json each, run with
``--selectors attention --ratios 0,0.2,1.0``: ratio 0 is direct reuse, 1 full recomputation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SETS = (("base", "6 sentences"), ("demonstrations", "demonstrations"), ("long", "34 sentences"))
POINTS = (("direct reuse", "attention", 0.0), ("ACache 0.2", "attention", 0.2), ("full", "attention", 1.0))


def cells(root: Path) -> dict[tuple[str, str, str], dict]:
    """(set, task, layout) -> {point name: row} for the three points."""
    out: dict[tuple[str, str, str], dict] = {}
    for name, _ in SETS:
        for row in json.loads((root / name / "accuracy.json").read_text()):
            for point, selector, ratio in POINTS:
                if row["selector"] == selector and row["ratio"] == ratio:
                    out.setdefault((name, row["task"], row["layout"]), {})[point] = row
    return out


def fmt(row: dict) -> str:
    lo, hi = row["ci95"]
    return f"{100 * row['accuracy']:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"


def table(before: dict, after: dict) -> str:
    lines = ["| set | task | layout | direct reuse before | direct reuse after | gap to full after | "
             "ACache 0.2 after | full before | full after |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(after, key=lambda k: ([s for s, _ in SETS].index(k[0]), k[1], k[2])):
        b, a = before[key], after[key]
        gap = 100 * (a["full"]["accuracy"] - a["direct reuse"]["accuracy"])
        label = dict(SETS)[key[0]]
        lines.append(f"| {label} | {key[1]} | {key[2]} | {fmt(b['direct reuse'])} | {fmt(a['direct reuse'])} | "
                     f"{gap:+.1f} | {fmt(a['ACache 0.2'])} | {fmt(b['full'])} | {fmt(a['full'])} |")
    return "\n".join(lines)


def plot(before: dict, after: dict, path: Path) -> None:
    """Mean accuracy over the cells against the share of affix tokens recomputed, before and after."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, data, style in (("before (acache-tiny-plus)", before, "o--"), ("after (acache-tiny-affix)", after,
                                                                               "s-")):
        xs = [ratio for _, _, ratio in POINTS]
        ys = [100 * sum(c[p]["accuracy"] for c in data.values()) / len(data) for p, _, _ in POINTS]
        ax.plot(xs, ys, style, label=label)
    ax.set_xlabel("share of affix tokens recomputed (0: direct reuse, 1: full recomputation)")
    ax.set_ylabel(f"exact match, mean of {len(after)} cells (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--md", type=Path, required=True)
    parser.add_argument("--plot", type=Path, required=True)
    args = parser.parse_args()
    before, after = cells(args.before), cells(args.after)
    missing = sorted(set(after) - set(before))
    if missing:
        raise SystemExit(f"cells in {args.after} but not in {args.before}: {missing}")
    args.md.write_text(table(before, after) + "\n")
    plot(before, after, args.plot)
    print(args.md.read_text())


if __name__ == "__main__":
    main()
