"""CPU seconds (user + system) of a process tree, sampled from ``/proc`` by a thread of the
benchmark's driver. On a machine shared with other work, wall-clock ratios move with the
neighbours' load, while CPU per step barely does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

SAMPLE_S = 0.2


class TreeCPU(threading.Thread):
    """Samples the CPU seconds of the tree below ``root``.

    Each sample is ``(unix time, whole tree, training processes)``, where ``is_trainer(cmdline)``
    says which processes train; a process that has exited keeps counting with its last
    reading, so a sum never drops.
    """

    def __init__(self, root: int, is_trainer: Callable[[str], bool], every_s: float = SAMPLE_S):
        super().__init__(daemon=True)
        self.root, self.is_trainer, self.every_s = root, is_trainer, every_s
        self.samples: list[tuple[float, float, float]] = []
        self._last: dict[int, tuple[float, bool]] = {}
        self._halt = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    @classmethod
    def watching(cls, is_trainer: Callable[[str], bool]) -> Callable[[int], TreeCPU]:
        """An observer for ``proc.run_logged``: started on the child's pid."""

        def start(pid: int) -> TreeCPU:
            sampler = cls(pid, is_trainer)
            sampler.start()
            return sampler

        return start

    def _scan(self) -> None:
        stats: dict[int, tuple[int, float]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick)
        tree, frontier = {self.root}, [self.root]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            for c in children.get(frontier.pop(), []):
                if c not in tree:
                    tree.add(c)
                    frontier.append(c)
        for pid in tree:
            if pid not in stats:
                continue
            # A Ray worker process becomes an actor after it starts (its title changes): look
            # again until it is one.
            trainer = (pid in self._last and self._last[pid][1]) or self._trainer(pid)
            self._last[pid] = (stats[pid][1], trainer)

    def _trainer(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return self.is_trainer(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            return False

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            self._scan()
            total = sum(c for c, _ in self._last.values())
            trainers = sum(c for c, t in self._last.values() if t)
            self.samples.append((time.time(), total, trainers))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def cpu_between(self, t0: float, t1: float) -> tuple[float, float]:
        """(whole tree, training processes) CPU seconds spent between unix times t0 and t1."""

        def at(t: float, i: int) -> float:
            pts = self.samples
            for (ta, *a), (tb, *b) in zip(pts, pts[1:]):
                if ta <= t <= tb:
                    return a[i] + (b[i] - a[i]) * (t - ta) / (tb - ta) if tb > ta else a[i]
            raise ValueError("time outside the sampled window")

        return at(t1, 0) - at(t0, 0), at(t1, 1) - at(t0, 1)
