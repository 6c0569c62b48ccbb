"""Step 3 of a sweep: rank the configurations and write ``results.json``, ``best.yaml`` and
``heatmap.png`` (fields and statuses: docs/sweep.md)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import yaml

from elastic.tune.space import Candidate, config_key, trial_spec_dict

MEASURED = ("ok", "stopped_early")
PRIVATE_FILE = 0o640  # a sweep's outputs: no more readable than a run dir (its directory: run_dirs.make_private_dir)


def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0640, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def without_storage_options(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A copy of a raw spec with every ``storage_options`` emptied, and the dotted keys
    emptied: they hold credentials (and name which), and no output file of a sweep may
    carry them. The trials themselves get the user's spec in memory, options included."""
    out = json.loads(json.dumps(raw, default=str))
    removed = []
    for section, body in out.items():
        if isinstance(body, dict) and body.get("storage_options"):
            body["storage_options"] = {}
            removed.append(f"{section}.storage_options")
    return out, removed


ORDER = {"ok": 0, "stopped_early": 1, "oom": 2, "failed": 3, "pruned_memory": 4, "pruned_batch": 5}


def entry_from_result(candidate: Candidate, result: Any, trial_steps: int) -> dict[str, Any]:
    """One ``results.json`` entry from a Tune ``Result`` (or a pruned candidate when None)."""
    entry = {
        "config": candidate.config,
        "status": candidate.status,
        "tokens_per_s": None,
        "mfu": None,
        "peak_mem_bytes": None,
        "predicted_mem_bytes": candidate.predicted_mem_bytes,
        "trial_s": None,
        "reason": candidate.reason or None,
    }
    if result is None:
        return entry
    m = dict(result.metrics or {})
    status = m.get("status")
    if result.error is not None:
        status, entry["reason"] = "failed", " ".join(f"{type(result.error).__name__}: {result.error}".split())[:500]
    elif status in ("failed", "oom"):
        entry["reason"] = m.get("reason") or None
    elif status == "ok" and m.get("step", 0) >= trial_steps:
        status = "ok"
    else:
        status = "stopped_early"
        entry["reason"] = f"stopped by early stopping after {m.get('step', 0)} of {trial_steps} steps"
    entry["status"] = status
    for k in ("tokens_per_s", "mfu", "peak_mem_bytes", "trial_s"):
        entry[k] = m.get(k)
    entry["predicted_mem_bytes"] = m.get("predicted_mem_bytes", candidate.predicted_mem_bytes)
    if status in MEASURED and not m.get("measured_steps"):
        entry["tokens_per_s"] = None  # stopped inside the warm-up: nothing measured
    entry["steps"] = m.get("step", 0)
    return entry


def rank(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(entries, key=lambda e: (ORDER[e["status"]], -(e["tokens_per_s"] or 0.0)))


def best_entry(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [e for e in entries if e["status"] == "ok" and e["tokens_per_s"]]
    return max(ok, key=lambda e: e["tokens_per_s"]) if ok else None


def memory_errors(entries: list[dict[str, Any]]) -> list[float]:
    """measured / predicted - 1 for every trial that measured its peak."""
    return [
        e["peak_mem_bytes"] / e["predicted_mem_bytes"] - 1
        for e in entries
        if e.get("peak_mem_bytes") and e.get("predicted_mem_bytes")
    ]


def write_results(out: str, entries: list[dict[str, Any]]) -> str:
    path = os.path.join(out, "results.json")
    write_private(path, json.dumps(rank(entries), indent=2, allow_nan=False) + "\n")
    return path


def write_best(out: str, spec: Any, best: dict[str, Any]) -> str:
    """The winner as a complete job spec (validated before it is written)."""
    raw, removed = without_storage_options(trial_spec_dict(spec, best["config"]))
    raw["run_dir"] = None
    type(spec).from_dict(raw)
    c = best["config"]
    head = (
        f"# Best configuration of the sweep in {os.path.abspath(out)}: {config_key(c)}\n"
        f"# measured {best['tokens_per_s']:.0f} tokens/s at dp={c['dp']} (grad_accum={c['grad_accum']}); "
        "DP follows from the cluster and elastic.min_dp/max_dp.\n"
    )
    if removed:
        head += f"# {', '.join(removed)} left out (credentials): copy them from your own spec.\n"
    path = os.path.join(out, "best.yaml")
    write_private(path, head + yaml.safe_dump(raw, sort_keys=False))
    return path


def format_table(entries: list[dict[str, Any]], limit: int | None = None) -> str:
    mib = 1 << 20
    rows = [
        f"{'#':>3} {'configuration':<28} {'status':<14} {'tokens/s':>9} {'/worker':>8} "
        f"{'peak MiB':>9} {'model MiB':>9} {'err':>6} {'trial s':>7}  reason"
    ]
    for i, e in enumerate(rank(entries)[:limit], 1):
        peak, pred = e.get("peak_mem_bytes"), e.get("predicted_mem_bytes")
        world = e["config"]["dp"] * e["config"]["tp"] * e["config"]["pp"] if e["config"]["dp"] else None
        tps = e.get("tokens_per_s")
        err = f"{(peak / pred - 1) * 100:+.0f}%" if peak and pred else ""
        rows.append(
            f"{i:>3} {config_key(e['config']):<28} {e['status']:<14} "
            f"{_num(tps, '.0f'):>9} {_num(tps / world if tps and world else None, '.0f'):>8} "
            f"{_num(peak / mib if peak else None, '.1f'):>9} {_num(pred / mib if pred else None, '.1f'):>9} {err:>6} "
            f"{_num(e.get('trial_s'), '.1f'):>7}  {(e.get('reason') or '')[:70]}"
        )
    return "\n".join(rows)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


_MARK = {"pruned_memory": "mem", "pruned_batch": "batch", "failed": "FAIL", "oom": "OOM"}


def write_heatmap(out: str, entries: list[dict[str, Any]]) -> str:
    """Layouts (dp, tp, pp, recompute) down, ZeRO / micro-batch across; tokens/s per worker
    (MFU where every measured trial has one); pruned and failed cells marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def row_of(c):
        return (c["dp"] or 0, c["tp"], c["pp"], c["activation_checkpointing"])

    def col_of(c):
        return (c["zero"], c["micro_batch"])

    rows = sorted({row_of(e["config"]) for e in entries})
    cols = sorted({col_of(e["config"]) for e in entries})
    measured = [e for e in entries if e["status"] in MEASURED and e.get("tokens_per_s")]
    use_mfu = bool(measured) and all(e.get("mfu") for e in measured)
    grid = np.full((len(rows), len(cols)), np.nan)
    labels: dict[tuple[int, int], str] = {}
    best = best_entry(entries)
    for e in entries:
        c = e["config"]
        i, j = rows.index(row_of(c)), cols.index(col_of(c))
        if e in measured:
            world = c["dp"] * c["tp"] * c["pp"]
            value = e["mfu"] * 100 if use_mfu else e["tokens_per_s"] / world
            grid[i, j] = value
            labels[(i, j)] = f"{value:.1f}" if use_mfu else f"{value:.0f}"
            if e["status"] == "stopped_early":
                labels[(i, j)] += "\n(stopped)"
        else:
            labels[(i, j)] = _MARK.get(e["status"], "")
        if best is not None and e is best:
            labels[(i, j)] = "★ " + labels[(i, j)]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cols) + 3), max(3, 0.5 * len(rows) + 2)))
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#dddddd")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(cols)), [f"z{z} mb{mb}" for z, mb in cols], rotation=45, ha="right")
    ax.set_yticks(
        range(len(rows)),
        [f"dp{d} tp{t} pp{p}" + (" +AC" if ac else "") if d else f"tp{t} pp{p}" for d, t, p, ac in rows],
    )
    for (i, j), text in labels.items():
        ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if not math.isnan(grid[i, j]) else "k")
    fig.colorbar(im, ax=ax, label="MFU %" if use_mfu else "tokens/s per worker")
    ax.set_title("Parallel configurations: grey = not measured (mem/batch: pruned, FAIL/OOM: failed)")
    fig.tight_layout()
    path = os.path.join(out, "heatmap.png")
    fig.savefig(path, dpi=110)
    os.chmod(path, PRIVATE_FILE)
    plt.close(fig)
    return path
