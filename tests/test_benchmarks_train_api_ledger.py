"""The figures of ``benchmarks/train_api_recovery.py`` from its ledgers
(``benchmarks/recovery/train_api_ledger.py``), on hand-written ledgers whose answers are known:
a Ray Train-like restart from a checkpoint whose loader begins the epoch again, and an exact
in-place recovery. Pure: no Ray, nothing trains.
"""

from __future__ import annotations

import json

from benchmarks.recovery.train_api_ledger import analyse, kill_target, lineage, read_ledger, row_counts

ROWS, GLOBAL = 96, 12  # 8 steps of 12 rows


def _steps(first: int, last: int, world: int, start_row: int, t0: float, pid0: int) -> list[dict]:
    """Steps ``first..last`` at ``world`` ranks, global rows consecutive from ``start_row``
    (rank r takes every world-th row of the step's block, as a DistributedSampler does): a
    ``batch`` line before each step and a ``step`` line after, as the script writes them."""
    out, per = [], GLOBAL // world
    for k, step in enumerate(range(first, last + 1)):
        block = range(start_row + k * GLOBAL, start_row + (k + 1) * GLOBAL)
        for rank in range(world):
            rows = [i for j, i in enumerate(block) if j % world == rank]
            assert len(rows) == per
            ts = t0 + k + rank * 0.01
            line = {"step": step, "epoch": 0, "rank": rank, "world_size": world, "pid": pid0 + rank}
            line |= {"node_id": f"n{pid0 + rank}", "rss_mb": 100.0 + step}
            out.append({**line, "kind": "batch", "rows": rows, "ts": ts - 0.005})
            out.append({**line, "kind": "step", "applied": True, "ts": ts})
    return out


def _enters(world: int, resume: int, t: float, pid0: int) -> list[dict]:
    return [
        {"kind": "enter", "rank": r, "world_size": world, "pid": pid0 + r, "node_id": f"n{pid0 + r}"}
        | {"resume_step": resume, "ts": t}
        for r in range(world)
    ]


def test_a_restart_whose_loader_begins_the_epoch_again_trains_rows_twice_and_never():
    """World 4 trains steps 1-4 (checkpoint at 2), the kill lands after step 4 (ts 103.5), world
    3 resumes from step 2 with the loader at the epoch's start: steps 3-8 take rows 0-71 again."""
    recs = _enters(4, 0, 99.0, 10) + _steps(1, 4, 4, 0, 100.0, 10)
    recs += _enters(3, 2, 120.0, 20) + _steps(3, 8, 3, 0, 121.0, 20)
    out = analyse(sorted(recs, key=lambda r: r["ts"]), kill_ts=[103.5], rows=ROWS, steps_per_epoch=8)
    assert out["old_size"] == 4 and out["new_size"] == 3
    assert out["first_step_at_new_size"] == 3 and out["resume_step"] == 2
    assert out["recovery_s"] == 121.0 + 2 * 0.01 - 103.5  # the last rank of the new group's first step
    assert out["last_step_at_old_size"] == 4 and out["steps_trained_again"] == 2
    # Lineage: steps 1-2 at world 4 (rows 0-23), steps 3-8 at world 3 (rows 0-71).
    assert (out["rows_twice"], out["rows_once"], out["rows_never"], out["rows_more"]) == (24, 48, 24, 0)
    assert out["epoch_steps_done"] == 8 and out["entries_after_kill"] == 3
    assert out["survivor_processes_kept"] == 0


def test_an_in_place_recovery_with_the_rows_not_yet_trained_counts_each_row_once():
    """The survivors (same pids) go on at step 5 at world 3 with rows 48-95: nothing trained again."""
    recs = _enters(4, 0, 99.0, 10) + _steps(1, 4, 4, 0, 100.0, 10)
    recs += _steps(5, 8, 3, 48, 104.2, 10)
    out = analyse(sorted(recs, key=lambda r: r["ts"]), kill_ts=[103.5], rows=ROWS, steps_per_epoch=8)
    assert out["steps_trained_again"] == 0 and out["first_step_at_new_size"] == 5
    assert (out["rows_once"], out["rows_twice"], out["rows_never"]) == (ROWS, 0, 0)
    assert out["survivor_processes_kept"] == 3


def test_a_step_trained_again_replaces_the_earlier_one_rank_by_rank():
    recs = _steps(1, 2, 4, 0, 100.0, 10) + _steps(2, 2, 3, 60, 110.0, 20)
    steps = lineage(recs)
    assert [(r["kind"], r["world_size"]) for r in steps[1]] == [("batch", 4)] * 4
    assert [(r["world_size"], r["pid"]) for r in steps[2]] == [(3, 20), (3, 21), (3, 22)]
    counts = row_counts(recs, ROWS, 8)
    assert counts["rows_once"] == 24 and counts["epoch_steps_done"] == 2  # rows 0-11 and 60-71


def test_a_recovery_not_completed_by_every_rank_is_not_timed():
    recs = _enters(4, 0, 99.0, 10) + _steps(1, 3, 4, 0, 100.0, 10)
    first_at_3 = [r for r in _steps(4, 4, 3, 36, 110.0, 20) if r["rank"] < 2]
    out = analyse(recs + first_at_3, kill_ts=[102.5], rows=ROWS, steps_per_epoch=8)
    assert "recovery_s" not in out and out["old_size"] == 4
    assert analyse([], kill_ts=[1.0], rows=ROWS, steps_per_epoch=8) == {}


def test_the_kill_target_is_the_node_of_the_rank_in_the_latest_group_and_lines_are_read_in_time_order(tmp_path):
    recs = _enters(4, 0, 99.0, 10) + _steps(1, 1, 4, 0, 100.0, 10)
    assert kill_target(recs, 1, 4) == ("n11", [11])
    for rank in range(4):
        mine = [r for r in recs if r["rank"] == rank]
        text = "".join(json.dumps(r) + "\n" for r in mine)
        (tmp_path / f"rank{rank}-{10 + rank}.jsonl").write_text(text + ('{"kind": "st' if rank == 0 else ""))
    got = read_ledger(str(tmp_path))
    assert len(got) == len(recs)  # the line being written is left out
    assert [r["ts"] for r in got] == sorted(r["ts"] for r in recs)


def test_every_kill_has_its_figures_and_the_survivors_memory_is_followed_across_re_entries():
    """Three kills, 4 -> 3 -> 2 -> 1, the survivor (pid 10, rank 0 throughout) kept in place;
    its RSS is read at its last step before the next kill: steps 4, 6 and 8 (104, 106, 108 MB)
    after the 1st, 2nd and 3rd re-entries; the others left with their nodes."""
    recs = _enters(4, 0, 99.0, 10) + _steps(1, 2, 4, 0, 100.0, 10)  # kill at 101.5
    recs += _steps(3, 4, 3, 24, 102.0, 10)  # kill at 103.5
    recs += _steps(5, 6, 2, 48, 104.0, 10)  # kill at 105.5
    recs += _steps(7, 8, 1, 72, 106.0, 10)
    recs.sort(key=lambda r: r["ts"])
    assert kill_target(recs, 1, 3) == ("n11", [11])
    out = analyse(recs, kill_ts=[101.5, 103.5, 105.5], rows=ROWS, steps_per_epoch=8)
    assert [(r["old_size"], r["new_size"], r["steps_trained_again"]) for r in out["recoveries"]] == [
        (4, 3, 0),
        (3, 2, 0),
        (2, 1, 0),
    ]
    assert out["recovery_s"] == out["recoveries"][0]["recovery_s"] and out["new_size"] == 3
    assert out["rows_once"] == ROWS
    assert out["survivor_rss_mb_after_each_kill"] == {"10": [104.0, 106.0, 108.0]}
    assert out["survivor_rss_growth"] == 108.0 / 104.0 - 1


def test_a_held_back_step_is_not_trained_and_its_rows_served_again_count_once():
    """Ours with ``prepare_optimizer``: step 3's all-reduce fails on the 3 survivors, their
    optimizer step changes nothing (``applied`` false), and the loop, which counts its own
    steps, goes on at 4 with step 3's rows re-cut at 3 ranks: nothing trained again."""
    recs = _enters(4, 0, 99.0, 10) + _steps(1, 2, 4, 0, 100.0, 10)
    held = [r if r["kind"] == "batch" else dict(r, applied=False) for r in _steps(3, 3, 4, 24, 102.0, 10)]
    held = [r for r in held if r["kind"] == "batch" or r["rank"] != 1]  # rank 1 died inside step 3
    recs += held + _steps(4, 9, 3, 24, 103.0, 10)  # 6 steps of 12 rows at 3 ranks: rows 24-95
    recs.sort(key=lambda r: r["ts"])
    out = analyse(recs, kill_ts=[101.9], rows=ROWS, steps_per_epoch=9)
    assert out["steps_not_applied"] == [3]
    assert (out["first_step_at_new_size"], out["last_step_at_old_size"], out["steps_trained_again"]) == (4, 2, 0)
    assert (out["rows_once"], out["rows_twice"], out["rows_never"]) == (ROWS, 0, 0)
    assert out["epoch_steps_done"] == 8  # the loop's step 3 was never trained


def test_the_rows_of_a_rank_killed_inside_a_step_the_survivors_applied_count():
    """Rank 1 wrote its batch of step 3 and died after its gradients went into the all-reduce:
    the 3 survivors applied step 3 at world 4, so its rows were trained."""
    recs = _enters(4, 0, 99.0, 10) + [r for r in _steps(1, 3, 4, 0, 100.0, 10) if r["step"] < 3 or r["rank"] != 1]
    recs += [r for r in _steps(3, 3, 4, 24, 102.0, 10) if r["kind"] == "batch" and r["rank"] == 1]
    recs += _steps(4, 8, 3, 36, 103.0, 10)
    recs.sort(key=lambda r: r["ts"])
    out = analyse(recs, kill_ts=[102.02], rows=ROWS, steps_per_epoch=8)
    assert (out["rows_once"], out["rows_twice"], out["rows_never"]) == (ROWS, 0, 0)
    assert out["last_step_at_old_size"] == 3 and out["steps_trained_again"] == 0
