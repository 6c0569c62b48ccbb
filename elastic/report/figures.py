"""The report's figures (matplotlib, Agg backend): see ``docs/observability.md``."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from elastic.report.run_data import ANOMALIES, RunData, skipped_batches  # noqa: E402

FAILURE_COLOR = "tab:red"
RESIZE_COLOR = "tab:orange"
RESTORE_COLOR = "tab:green"
PAUSE_COLOR = "0.85"
SIZE = (10, 4.5)


def _save(fig: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _style(points: int) -> str:
    """Dots on each point of a short run; a plain line for a long one."""
    return ".-" if points <= 2000 else "-"


def _step_at(data: RunData, ts: float) -> float:
    """The step axis position of a moment: the last step committed before it, + 0.5."""
    last = 0
    for s in data.steps:
        if s["ts"] <= ts:
            last = s["step"]
    return last + 0.5


def _nothing(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="0.4")


def loss_figure(data: RunData, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=SIZE)
    pts = [(s["step"], s["loss"]) for s in data.steps if s.get("loss") is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], _style(len(pts)), color="tab:blue", ms=3, lw=1, label="loss")
    else:
        _nothing(ax, "no completed step yet")
    seen: set[str] = set()

    def vline(x: float, color: str, style: str, label: str) -> None:
        ax.axvline(x, color=color, ls=style, lw=1.2, label=None if label in seen else label)
        seen.add(label)

    for f in data.failures:
        vline(f.step, FAILURE_COLOR, "-", f"failure ({f.cause})")
    for r in data.resizes:
        vline(_step_at(data, r["ts"]), RESIZE_COLOR, "--", "resize")
    for r in data.restores:
        vline(r["step"], RESTORE_COLOR, ":", "restored to step")
    skips = skipped_batches(data.events)
    if skips:
        losses = dict(pts)
        y = [losses.get(s - 1, pts[-1][1] if pts else 0.0) for s, _ in skips]
        ax.scatter([s for s, _ in skips], y, marker="x", color="black", zorder=5, label="skipped batch")
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel("loss (mean over the global batch)")
    _dp_bands(ax, data)
    ax.set_title("Loss, with failures, resizes, restores and skipped batches (bands: DP degree)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, out_dir, "loss.png")


def _shade_pauses(ax: Any, data: RunData, end_ts: float) -> None:
    labelled = False
    for p in data.pauses:
        end = p.end if p.end is not None else end_ts
        ax.axvspan(
            p.start - data.t0,
            end - data.t0,
            color=PAUSE_COLOR,
            zorder=0,
            label=None if labelled else "no step completing (recovery / resize)",
        )
        labelled = True


def _broken_at_pauses(data: RunData, pts: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """x (s since start), y with a NaN between points that a pause separates: no line across a gap."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (t, v) in enumerate(pts):
        if i and any(p.start < t and pts[i - 1][0] <= p.start for p in data.pauses):
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(t - data.t0)
        ys.append(v)
    return xs, ys


def _dp_bands(ax: Any, data: RunData) -> None:
    """Label the stretches of steps trained at each DP degree along the top of a step axis."""
    segs: list[list[int]] = []  # [first_step, last_step, dp]
    for s in data.steps:
        if segs and segs[-1][2] == s["dp"] and s["step"] >= segs[-1][0]:
            segs[-1][1] = max(segs[-1][1], s["step"])
        else:
            segs.append([s["step"], s["step"], s["dp"]])
    shades = ["#eef3fb", "#fdf1e4"]
    dps = sorted({seg[2] for seg in segs}, reverse=True)
    for a, b, dp in segs:
        ax.axvspan(a - 0.5, b + 0.5, color=shades[dps.index(dp) % 2], zorder=0)
        ax.text((a + b) / 2, 0.98, f"DP {dp}", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=9)


def throughput_figure(data: RunData, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=SIZE)
    end_ts = data.events[-1]["ts"] if data.events else data.t0
    _shade_pauses(ax, data, end_ts)
    # A TorchTrainer loop's steps carry no token count (docs/train_api.md): steps/s instead.
    tokens = any(s.get("tokens_per_s") is not None for s in data.steps)
    unit = "tokens/s" if tokens else "steps/s"
    if data.steps:
        pts = [(s["ts"], _rate(s, tokens)) for s in data.steps]
        x, y = _broken_at_pauses(data, pts)
        ax.plot(x, y, _style(len(x)), ms=3, lw=1, color="tab:blue", label=unit)
    else:
        _nothing(ax, "no completed step yet")
    ax.set_xlabel("wall time since job start (s)")
    ax.set_ylabel(f"throughput ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    mfu = [(s["ts"] - data.t0, 100 * s["mfu"]) for s in data.steps if s.get("mfu") is not None]
    if mfu:
        ax2 = ax.twinx()
        ax2.plot([m[0] for m in mfu], [m[1] for m in mfu], lw=1, color="tab:purple", label="MFU")
        ax2.set_ylabel("MFU (%)")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
        ax.set_title("Throughput and MFU over wall time; grey: recovery gaps")
    else:
        ax.set_title("Throughput over wall time; grey: recovery gaps (no MFU: no known peak for this device)")
    ax.legend(handles, labels, loc="lower right", fontsize=8)
    return _save(fig, out_dir, "throughput.png")


def _rate(step: dict[str, Any], tokens: bool) -> float:
    if tokens:
        return float(step.get("tokens_per_s") or 0.0)
    t = float(step.get("step_time_s") or 0.0)
    return 1.0 / t if t > 0 else float("nan")


def timeline_figure(data: RunData, out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=SIZE)
    end_ts = data.events[-1]["ts"] if data.events else data.t0
    _shade_pauses(ax, data, end_ts)
    tl = data.dp_timeline()
    if tl:
        xs = [t - data.t0 for t, _ in tl] + [end_ts - data.t0]
        ys = [dp for _, dp in tl] + [tl[-1][1]]
        ax.step(xs, ys, where="post", lw=2, color="tab:blue", label="DP degree (replicas)")
        top = max(ys)
        ax.set_ylim(0, top + 1.5)
        ax.set_yticks(range(0, top + 2))
    for i, f in enumerate(data.failures):
        x = f.ts - data.t0
        ax.axvline(x, color=FAILURE_COLOR, lw=1.2, label="failure" if i == 0 else None)
        if f.cause in ANOMALIES:
            text = f"{f.cause}\nrolled back in place"
        else:
            parts = [f.cause]
            if f.downtime_s is not None:
                parts.append(f"downtime {f.downtime_s:.2f} s")
            if f.gap_s is not None:
                parts.append(f"step gap {f.gap_s:.2f} s")
            text = "\n".join(parts)
        ax.annotate(
            text,
            xy=(x, ax.get_ylim()[1] - 0.2),
            xytext=(4, -4 - 30 * (i % 2)),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color=FAILURE_COLOR,
        )
    for i, r in enumerate(data.resizes):
        x = r["ts"] - data.t0
        ax.axvline(x, color=RESIZE_COLOR, ls="--", lw=1, label="resize" if i == 0 else None)
        gap = next((p.gap_s for p in data.pauses if p.gap_s is not None and p.start <= r["ts"] <= p.end), None)
        ax.annotate(
            f"dp {r.get('old_dp')} -> {r.get('new_dp')}\n{r.get('reason', '')}"
            + ("" if gap is None else f"\nstep gap {gap:.2f} s"),
            xy=(x, 0.3 + 1.1 * (i % 2)),  # alternate heights: resizes close in time stay readable
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=8,
            color="tab:brown",
        )
    ax.set_xlabel("wall time since job start (s)")
    ax.set_ylabel("data-parallel degree")
    ax.set_title("DP degree over time, failures with their cause and downtime")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _save(fig, out_dir, "timeline.png")


def breakdown_figure(data: RunData, out_dir: str) -> str:
    """Per step, stacked: data wait, compute, communication (when measured), the memory
    snapshot's and the storage checkpoint's blocking, and the rest of the step time."""
    fig, ax = plt.subplots(figsize=SIZE)
    last: dict[int, dict[str, Any]] = {}
    for s in data.steps:  # a redone step: its last run
        last[s["step"]] = s
    snap = {c["step"]: c["blocking_s"] for c in data.checkpoints if c.get("tier") == "memory"}
    store = {c["step"]: c["blocking_s"] for c in data.checkpoints if c.get("tier") == "storage"}
    steps = sorted(last)
    if not steps:
        _nothing(ax, "no completed step yet")
    else:
        measured_comm = any(last[n].get("comm_s") is not None for n in steps)
        compute_name = "compute" if measured_comm else "compute (communication included)"
        rows: dict[str, list[float]] = {
            "data wait": [], compute_name: [], "communication": [], "snapshot blocking": [],
            "checkpoint blocking": [], "other": [],
        }  # fmt: skip
        for n in steps:
            s = last[n]
            comm = float(s.get("comm_s") or 0.0)
            compute = max(0.0, float(s.get("compute_s") or 0.0) - comm)
            wait = float(s.get("data_wait_s") or 0.0)
            rows["data wait"].append(wait)
            rows[compute_name].append(compute)
            rows["communication"].append(comm)
            rows["snapshot blocking"].append(float(snap.get(n, 0.0) or 0.0))
            rows["checkpoint blocking"].append(float(store.get(n, 0.0) or 0.0))
            rows["other"].append(max(0.0, float(s["step_time_s"]) - wait - compute - comm))
        colors = ["tab:orange", "tab:blue", "tab:cyan", "tab:green", "tab:red", "0.7"]
        width, per_bin = 1.0, 1
        bars: list[float] = [float(n) for n in steps]  # each bar's x: a step, or a bin's mean step
        if len(steps) > MAX_BARS:  # a long run: the mean of each bin of consecutive steps
            per_bin = -(-len(steps) // MAX_BARS)
            bars = [sum(steps[i : i + per_bin]) / len(steps[i : i + per_bin]) for i in range(0, len(steps), per_bin)]
            rows = {k: _bin_means(v, per_bin) for k, v in rows.items()}
            width = float(per_bin)
        bottom = [0.0] * len(bars)
        for (name, vals), color in zip(rows.items(), colors, strict=True):
            if not any(vals):
                continue
            ax.bar(
                bars, [v * 1e3 for v in vals], bottom=[b * 1e3 for b in bottom], width=width, color=color, label=name
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        if per_bin > 1:
            ax.text(0.01, 0.98, f"each bar: the mean of {per_bin} steps", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel("time (ms)")
    ax.set_title("Where each step's time went (slowest rank per component)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, out_dir, "step_breakdown.png")


MAX_BARS = 500


def _bin_means(values: list[float], per_bin: int) -> list[float]:
    return [sum(values[i : i + per_bin]) / len(values[i : i + per_bin]) for i in range(0, len(values), per_bin)]


def all_figures(data: RunData, out_dir: str) -> list[str]:
    return [
        loss_figure(data, out_dir),
        throughput_figure(data, out_dir),
        timeline_figure(data, out_dir),
        breakdown_figure(data, out_dir),
    ]
