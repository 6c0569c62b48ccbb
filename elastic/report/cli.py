"""``elastic report RUN_DIR [--out DIR]``: figures and a short ``report.md`` (``docs/observability.md``)."""

from __future__ import annotations

import argparse
import os
import sys

from elastic.report.run_data import ANOMALIES, RunData, load_run, scale_factors, throughput_by_dp


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (finished, failed or still running)")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write the report (default: RUN_DIR/report)")


def main(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.run_dir):
        what = "a file, not a directory" if os.path.exists(args.run_dir) else "no such directory"
        print(f"error: RUN_DIR: {what}: {args.run_dir}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.run_dir, "events.jsonl")):
        print(f"error: RUN_DIR: no events.jsonl in {args.run_dir}", file=sys.stderr)
        return 2
    path = write_report(args.run_dir, args.out)
    print(path)
    return 0


def write_report(run_dir: str, out: str | None = None) -> str:
    """Write the figures and ``report.md`` into ``out`` (default ``RUN_DIR/report``); returns
    the path of ``report.md``."""
    from elastic.report.figures import all_figures

    out = out or os.path.join(run_dir, "report")
    os.makedirs(out, exist_ok=True)
    data = load_run(run_dir)
    figures = all_figures(data, out)
    path = os.path.join(out, "report.md")
    with open(path + ".tmp", "w") as f:
        f.write(render_markdown(data, [os.path.relpath(p, out) for p in figures]))
    os.replace(path + ".tmp", path)
    return path


def render_markdown(data: RunData, figures: list[str]) -> str:
    lines = [f"# Run report: {os.path.basename(os.path.abspath(data.run_dir))}", ""]
    last = data.steps[-1] if data.steps else None
    wall = (data.events[-1]["ts"] - data.t0) if data.events else 0.0
    lines.append(f"- status: {data.status}")
    lines.append(f"- steps completed: {last['step'] if last else 0}, wall time {wall:.1f} s (events.jsonl)")
    if last and last.get("loss") is not None:
        lines.append(f"- last loss: {last['loss']:.4f}")
    dps = []
    for _, dp in data.dp_timeline():
        dps.append(str(dp))
    if dps:
        lines.append(f"- DP over the run: {' -> '.join(dps)}")
    lines.append(f"- failures: {len(data.failures)}")
    if data.summary is None:
        lines.append("- summary.json: not written (yet): the run is still going or was stopped hard")
    if data.skipped_lines:
        lines.append(f"- {data.skipped_lines} line(s) of events.jsonl did not parse and were skipped")
    lines.append("")
    if data.failures:
        lines += [
            "## Failures",
            "",
            "| # | at (s) | cause | ranks | step gap (s) | downtime_s (summary.json) |",
            "|---|---|---|---|---|---|",
        ]
        for i, f in enumerate(data.failures, 1):
            gap = "rolled back in place" if f.cause in ANOMALIES else _num(f.gap_s)
            lines.append(f"| {i} | {f.ts - data.t0:.1f} | {f.cause} | {f.ranks} | {gap} | {_num(f.downtime_s)} |")
        for i, r in enumerate((data.summary or {}).get("recoveries") or [], 1):
            if r.get("breakdown"):
                parts = ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown"].items())
                lines.append(f"\nRecovery {i} ({r.get('cause')}), where its time went (s, summary.json): {parts}")
        lines += [
            "",
            "The step gap is the time between the last step finished before the failure and the first one "
            "after it (one ordinary step included); `downtime_s` is the controller's own measure "
            "(docs/outputs.md).",
            "",
        ]
    tput = throughput_by_dp(data.steps)
    factors = scale_factors(data.steps)
    if tput:
        lines += ["## Throughput by DP degree", ""]
        if factors:
            lines += ["| DP n | median tokens/s (T_n) | steps | scale factor T_n / (n·T) |", "|---|---|---|---|"]
        else:
            lines += ["| DP n | median tokens/s (T_n) | steps |", "|---|---|---|"]
        for n, tn in tput.items():
            count = sum(1 for s in data.steps if s["dp"] == n)
            row = f"| {n} | {tn:,.0f} | {count} |"
            lines.append(row + (f" {factors[n]:.3f} |" if factors else ""))
        if factors:
            m = min(tput)
            lines += [
                "",
                f"T is the per-replica throughput at the smallest DP of the run (T = T_{m} / {m}); a scale factor "
                "of 1 is perfect linear scaling.",
            ]
            few = [n for n in tput if sum(1 for s in data.steps if s["dp"] == n) < 20]
            if few:
                lines.append(
                    f"Few steps at DP {', '.join(map(str, few))} (under 20): warm-up after a re-formation weighs "
                    "on the median there, so take that factor as rough."
                )
        lines.append("")
    lines += ["## Figures", ""]
    for fig in figures:
        lines += [f"![{os.path.splitext(fig)[0]}]({fig})", ""]
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
