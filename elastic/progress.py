"""Live progress on the terminal: step, loss, tokens/s, DP and ETA, plus notable events."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class ProgressDisplay:
    """An ``EventLog`` listener. On a TTY the step line redraws in place; elsewhere it is
    written every ``every`` steps, and at most once every ``every_s`` seconds.

    ``total_steps`` None: a run whose length is not known (a ``TorchTrainer`` loop): no ETA.
    A step without ``tokens_per_s`` (a user's loop) shows steps/s instead."""

    def __init__(self, total_steps: int | None, stream: TextIO | None = None, every: int = 1, every_s: float = 0.0):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.every = max(1, every)
        self.every_s = every_s
        self.tty = self.stream.isatty()
        self._t0 = time.monotonic()
        self._first_step: tuple[int, float] | None = None
        self._last_line = float("-inf")

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "step":
            self._step(event)
        elif kind == "job_start":
            self._line(f"job started: dp={event['dp']} tp={event['tp']} pp={event['pp']} on {event['nodes']} node(s)")
        elif kind == "failure":
            self._line(f"FAILURE {event['cause']} ranks={event['ranks']}: {event['detail']}")
        elif kind == "resize":
            self._line(
                f"resize dp {event['old_dp']} -> {event['new_dp']} (grad_accum={event['grad_accum']}, "
                f"{event['reason']})"
            )
        elif kind == "restore":
            self._line(f"restored step {event['step']} from {event['source']} in {event['duration_s']:.2f}s")
        elif kind == "checkpoint" and event["tier"] == "storage" and event.get("committed") is False:
            self._line(f"checkpoint step {event['step']} -> storage NOT COMMITTED: {event.get('error')}")
        elif kind == "checkpoint" and event["tier"] == "storage":
            self._line(
                f"checkpoint step {event['step']} -> storage ({event['bytes'] / 1e6:.1f} MB, "
                f"blocked {event['blocking_s'] * 1e3:.1f} ms)"
            )
        elif kind == "eval":
            self._line(f"eval  step {event['step']:>5}/{self.total}  eval_loss {event['eval_loss']:.4f}")
        elif kind == "job_end":
            reason = f": {event['reason']}" if event.get("reason") and event["status"] == "failed" else ""
            self._line(f"job {event['status']} after {event['steps']} steps{reason}")

    def _step(self, e: dict[str, Any]) -> None:
        now = time.monotonic()
        if self._first_step is None:
            self._first_step = (e["step"], now)
        s0, t0 = self._first_step
        rate = (e["step"] - s0) / (now - t0) if now > t0 and e["step"] > s0 else 0.0
        eta = (self.total - e["step"]) / rate if rate > 0 and self.total is not None else float("nan")
        loss = "nan" if e.get("loss") is None else f"{e['loss']:.4f}"
        total = "" if self.total is None else f"/{self.total}"
        speed = f"{e['tokens_per_s']:>9.0f} tok/s" if e.get("tokens_per_s") is not None else f"{rate:>7.2f} steps/s"
        text = (
            f"step {e['step']:>5}{total}  loss {loss}  {speed}  "
            f"dp {e['dp']} (accum {e['grad_accum']})  ETA {_fmt_eta(eta)}"
        )
        if self.tty:
            self.stream.write("\r" + text + "   ")
            self.stream.flush()
        elif (e["step"] % self.every == 0 and now - self._last_line >= self.every_s) or e["step"] == self.total:
            self._last_line = now
            self.stream.write(text + "\n")
            self.stream.flush()

    def _line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(text + "\n")
        self.stream.flush()


def _fmt_eta(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "--:--"
    m, s = divmod(int(seconds), 60)
    return f"{m:02d}:{s:02d}"


def format_summary(result: Any, run_dir: str) -> str:
    lines = [
        "",
        f"run {result.status}: {result.steps} steps in {result.wall_s:.1f}s, final loss "
        + ("n/a" if result.final_loss is None else f"{result.final_loss:.4f}"),
        "  mean throughput   "
        + ("n/a" if result.mean_tokens_per_s is None else f"{result.mean_tokens_per_s:,.0f} tokens/s"),
        f"  failures          {result.failures}",
        "  dp history        " + ", ".join(f"step {s}: dp {d}" for s, d in result.dp_history),
    ]
    for r in result.recoveries:
        lines.append(
            f"  recovery          {r.cause}: downtime_s {r.downtime_s:.2f} (detect_s {r.detect_s:.2f} + recover_s "
            f"{r.recover_s:.2f}), lost_steps {r.lost_steps}"
        )
        if r.breakdown:
            lines.append(
                "                    where it went: " + ", ".join(f"{k} {v:.3f}" for k, v in r.breakdown.items())
            )
    for f in getattr(result, "checkpoint_failures", None) or []:
        lines.append(f"  checkpoint failed step {f['step']}: {f['cause']}")
    stop = getattr(result, "stop", None)
    if stop:
        ckpt = stop.get("checkpoint_step")
        lines.append(
            f"  stopped           on {stop.get('signal')}: "
            + (f"checkpoint of step {ckpt} committed" if ckpt is not None else "no checkpoint")
            + f" ({stop.get('stop_reason')}); continue with --resume"
        )
    lines.append(f"  artefacts         {run_dir}/events.jsonl, {run_dir}/summary.json")
    return "\n".join(lines)
