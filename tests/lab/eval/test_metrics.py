"""Interval and table code of the studies, on fixed inputs."""

from __future__ import annotations

import math

import pytest

from acache_lab.eval.metrics import Cell, summary_table, sweep_table, target_table, wilson_interval


def _wilson_by_hand(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    # the textbook form: (p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)
    p = k / n
    denom = 1 + z * z / n
    mid = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (mid - half) / denom, (mid + half) / denom


@pytest.mark.parametrize(("k", "n", "lo", "hi"), [(8, 10, 0.4902, 0.9433), (0, 10, 0.0, 0.2775),
                                                 (10, 10, 0.7225, 1.0), (150, 300, 0.4438, 0.5562)])
def test_wilson_interval_known_values(k, n, lo, hi):
    got = wilson_interval(k, n)
    assert got == pytest.approx((lo, hi), abs=1e-4)
    by_hand = _wilson_by_hand(k, n)
    assert got == pytest.approx((max(0.0, by_hand[0]), min(1.0, by_hand[1])), abs=1e-12)


def test_wilson_interval_contains_the_estimate_and_narrows_with_n():
    for k, n in [(1, 3), (37, 100), (299, 300)]:
        lo, hi = wilson_interval(k, n)
        assert 0.0 <= lo <= k / n <= hi <= 1.0
    assert (lambda a, b: a[1] - a[0] > b[1] - b[0])(wilson_interval(30, 100), wilson_interval(300, 1000))


def test_wilson_interval_rejects_bad_counts():
    with pytest.raises(ValueError, match="at least one trial"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="correct must be in"):
        wilson_interval(11, 10)


def _cells() -> list[Cell]:
    c = [Cell("qa1", "prefix", "full", 0.0, 90, 100), Cell("qa1", "prefix", "none", 0.0, 60, 100),
         Cell("qa1", "prefix", "all", 1.0, 90, 100)]
    for sel, acc in (("attention", (60, 85, 88, 90)), ("random", (60, 62, 70, 90))):
        c += [Cell("qa1", "prefix", sel, r, a, 100) for r, a in zip((0.0, 0.2, 0.5, 1.0), acc, strict=True)]
    return c


def test_sweep_table_layout_and_values():
    table = sweep_table(_cells(), "qa1", "prefix").splitlines()
    assert table[0] == "| selector | 0 | 0.2 | 0.5 | 1 |"
    assert table[2].startswith("| attention | 60.0 [50, 69] | 85.0 [77, 91] | 88.0 [80, 93] | 90.0 [83, 94] |")
    assert table[3].startswith("| random | 60.0")
    assert table[4].startswith("| direct reuse (none) | 60.0 [50, 69]")
    assert table[-1].startswith("| full recompute, no cache | 90.0 [83, 94]")
    with pytest.raises(ValueError, match="no results for task 'arith'"):
        sweep_table(_cells(), "arith", "prefix")


def test_summary_table_picks_the_best_other_selector_at_the_focus_ratio():
    cells = _cells() + [Cell("qa1", "prefix", "first-k", 0.2, 70, 100)]
    rows = summary_table(cells).splitlines()
    assert len(rows) == 3
    assert rows[2] == ("| qa1 | prefix | 60.0 [50, 69] | 85.0 [77, 91] | first-k: 70.0 [60, 78] | "
                       "90.0 [83, 94] |")


def test_target_table_reads_the_share_of_the_gap_and_the_margin_over_non_oracles():
    # attention-deviation at 0.2 recovers 28 of the 30 points (93%); random is far below, and the oracle,
    # above it, does not count
    cells = _cells() + [Cell("qa1", "prefix", "attention-deviation", 0.2, 88, 100),
                        Cell("qa1", "prefix", "kv-deviation", 0.2, 90, 100)]
    rows = target_table(cells).splitlines()
    assert rows[2] == ("| qa1 | prefix | 60.0 [50, 69] | 90.0 [83, 94] | 88.0 [80, 93] | 93% | "
                       "attention: 85.0 [77, 91] | no | no |")  # above attention, but inside its interval
    cells[4] = Cell("qa1", "prefix", "attention", 0.2, 70, 100)  # attention now far below
    assert target_table(cells).splitlines()[2].endswith("| attention: 70.0 [60, 78] | yes | yes |")
    # with demonstrations left out there is still one row per task and layout; no gap reads as such
    flat = [Cell("codes", "infix", s, r, 50, 100) for s, r in (("none", 0.0), ("full", 0.0),
                                                                ("attention-deviation", 0.2))]
    assert "| no gap beyond the intervals |" in target_table(flat) and target_table(flat).endswith("| n/a |")


def test_a_gap_inside_the_intervals_has_no_share_and_a_share_is_at_most_all_of_it():
    """A gap of one question in 300 read as 20,000% and 'target met'; equal cells read 'no'."""
    cells = [Cell("qa1", "prefix", "none", 0.0, 100, 300), Cell("qa1", "prefix", "full", 0.0, 101, 300),
             Cell("qa1", "prefix", "attention-deviation", 0.2, 300, 300)]
    assert target_table(cells).splitlines()[2].endswith("| no gap beyond the intervals | – | yes | n/a |")
    cells[1] = Cell("qa1", "prefix", "full", 0.0, 280, 300)
    assert "| 100% |" in target_table(cells)  # 300 right beyond full's 280: all of the gap, not 111%


def test_a_share_just_under_the_target_does_not_read_as_the_target():
    """269 of 300 against 0 and 300 is 89.7% of the gap: it printed "90%" beside "target met: no"."""
    cells = [Cell("qa1", "prefix", "none", 0.0, 0, 300), Cell("qa1", "prefix", "full", 0.0, 300, 300),
             Cell("qa1", "prefix", "attention-deviation", 0.2, 269, 300)]
    assert target_table(cells).splitlines()[2].endswith("| 89.7% | – | yes | no |")
    cells[2] = Cell("qa1", "prefix", "attention-deviation", 0.2, 280, 300)
    assert target_table(cells).splitlines()[2].endswith("| 93% | – | yes | yes |")


def test_our_selectors_own_forms_are_not_the_others_it_must_beat():
    """Its two-pass form and its depth variants are the same selector: a tie with itself cannot clear the
    intervals, so they are not 'best other'."""
    cells = [Cell("qa1", "prefix", "none", 0.0, 30, 300), Cell("qa1", "prefix", "full", 0.0, 300, 300),
             Cell("qa1", "prefix", "attention-deviation", 0.2, 285, 300),
             Cell("qa1", "prefix", "attention-deviation-2p", 0.2, 284, 300),
             Cell("qa1", "prefix", "attention-deviation-d50", 0.2, 286, 300),
             Cell("qa1", "prefix", "random", 0.2, 120, 300)]
    assert target_table(cells).splitlines()[2].endswith("| random: 40.0 [35, 46] | yes | yes |")


def test_cells_round_trip_through_dicts():
    for cell in [*_cells(), Cell("qa1", "prefix", "none", 0.0, 3, 4, 0.5, gen_length=32)]:
        raw = cell.as_dict()
        assert Cell.from_dict(raw) == cell
        assert raw["ci95"][0] <= raw["accuracy"] <= raw["ci95"][1]


@pytest.mark.parametrize("n", [1, 7, 100, 300])
def test_every_point_lies_inside_its_own_interval(n):
    # the plot's error bars are point - lower and upper - point: rounding must never make one negative
    for k in range(n + 1):
        lo, hi = wilson_interval(k, n)
        assert lo <= k / n <= hi
    assert wilson_interval(0, n)[0] == 0.0 and wilson_interval(n, n)[1] == 1.0
