"""The layout shows the architecture: the runtime never imports the research side, and the names of the
pluggable policies are defined once."""

from __future__ import annotations

import ast
from pathlib import Path

import acache

RUNTIME = Path(acache.__file__).parent
RESEARCH = ("acache_lab", "scripts", "configs")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_runtime_imports_nothing_from_the_research_side():
    offenders = {str(p.relative_to(RUNTIME.parent)): sorted(m for m in imported_modules(p)
                                                            if m.split(".")[0] in RESEARCH)
                 for p in RUNTIME.rglob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_policy_names_are_defined_once():
    from acache.affix.selectors import SELECTORS
    from acache.policies import SELECTOR_CHOICES
    from acache.policies import SELECTORS as NAMES

    assert tuple(SELECTORS) == NAMES and set(NAMES) < set(SELECTOR_CHOICES)
    lists = ("COMMIT_RULES", "CACHE_POLICIES", "SELECTORS", "BICACHE_POLICIES", "LAYOUTS", "ANCHOR_QUERIES")
    defined = {}
    for root in (RUNTIME, RUNTIME.parent / "acache_lab"):
        for path in root.rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name) and target.id in lists and isinstance(node.value, ast.Tuple):
                            defined.setdefault(target.id, []).append(path.name)
    assert defined == {name: ["policies.py"] for name in lists}


def test_decoding_depends_on_sampling_params_alone():
    """decoding/ is the per-request rules: it reads SamplingParams and its own modules, nothing of the affixes,
    the engine or the models (which all build on it)."""
    outside = {str(p.relative_to(RUNTIME.parent)): sorted(m for m in imported_modules(p) if m.startswith("acache")
                                                          and not m.startswith("acache.decoding")
                                                          and m != "acache.sampling_params")
               for p in (RUNTIME / "decoding").rglob("*.py")}
    assert {k: v for k, v in outside.items() if v} == {}


def test_the_runtime_holds_no_research_module():
    """What only the lab uses lives in the lab: the staleness study, BiCache's profiler, calibration sets and
    one-off probes are not in the runtime (its BiCache reads a profile; it does not build one)."""
    from acache.affix import bicache

    assert not (RUNTIME / "affix" / "staleness.py").exists() and not (RUNTIME / "affix" / "calibration.py").exists()
    assert not hasattr(bicache, "profile_bicache")
    assert not (RUNTIME.parent / "scripts").exists() or not list((RUNTIME.parent / "scripts").glob("*.py"))
