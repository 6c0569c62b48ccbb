"""Figures over repetitions: median and range, ratios of medians, and the seconds per step
of a run from its step completion times. Pure; runs wherever a benchmark reports.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def median_range(values: Iterable[float | None]) -> dict[str, float] | None:
    """``{"median", "min", "max"}`` of the values that are not None; None when there are none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summary(values: Iterable[float | None]) -> dict[str, Any] | None:
    """``median_range`` and ``n``, the number of values it is over."""
    vals = [v for v in values if v is not None]
    out = median_range(vals)
    return None if out is None else {**out, "n": len(vals)}


def summary_with_runs(values: list[float]) -> dict[str, Any]:
    """``median_range`` and ``runs``, every value in the order measured."""
    return {**median_range(values), "runs": values}


def median_ratio(numerator: Iterable[float], denominator: Iterable[float]) -> float:
    """Ratio of the medians: the headline of a side-by-side comparison over repetitions."""
    return statistics.median(numerator) / statistics.median(denominator)


def fmt(x: Any, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def fmt_summary(s: dict[str, Any] | None, unit: str = "s", spec: str = ".2f") -> str:
    """``1.23 s (range 1.00-2.00, n=3)``."""
    if s is None:
        return "n/a"
    return f"{format(s['median'], spec)} {unit} (range {format(s['min'], spec)}-{format(s['max'], spec)}, n={s['n']})"


def least_squares_slope(points: list[tuple[int, float]]) -> float:
    """Seconds per step: the least-squares slope of completion time against step number
    (one slow step at either end of the window does not decide it, as last - first would)."""
    n = len(points)
    if n < 2:
        raise ValueError("need at least two steps in the steady window")
    xs = [float(s) for s, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def theil_sen_slope(points: list[tuple[int, float]]) -> float:
    """Median of the pairwise slopes: robust to a burst of load from another tenant."""
    slopes = [(t2 - t1) / (s2 - s1) for i, (s1, t1) in enumerate(points) for s2, t2 in points[i + 1 :] if s2 != s1]
    return statistics.median(slopes)


def median_interval(done_ts: Iterable[float]) -> float | None:
    """The median time between consecutive completions (``done_ts``: one per step, any
    order): a steady step's length. None with fewer than two."""
    ts = sorted(done_ts)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None
