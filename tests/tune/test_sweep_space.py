"""Step 1 of a sweep without Ray: space checks, enumeration, pruning, the staged search and
the report files (on hand-made results)."""

from __future__ import annotations

import json
import os

import pytest

from elastic.errors import SpecError
from elastic.parallel.memory_model import estimate_memory
from elastic.tune import report
from elastic.tune.search import StagedSearch
from elastic.tune.space import Cluster, config_key, default_space, enumerate_space, parse_space
from jobs.spec import JobSpec

pytestmark = pytest.mark.timeout(60)

RAW = {
    "name": "tiny",
    "model": {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": 64, "seq_len": 16},
    "parallel": {"micro_batch": 2},
    "elastic": {"min_dp": 1, "max_dp": 4},
    "train": {"global_batch": 8},
}
BIG = Cluster(worker_slots=4, slots_per_node=4, memory_per_worker_bytes=1 << 40)


def spec():
    return JobSpec.from_dict(RAW)


@pytest.mark.parametrize(
    "space, field",
    [
        ({"dp": [1, 2]}, "space.dp"),
        ({"tp": [1], "flash": [True]}, "space.flash"),
        ({"zero": [0, 7]}, "space.zero"),
        ({"tp": [3]}, "space.tp"),  # 3 does not divide n_heads = 2
        ({"micro_batch": []}, "space.micro_batch"),
        ({}, "space"),
        (None, "space"),
    ],
)
def test_bad_spaces_name_the_key(space, field):
    with pytest.raises(SpecError) as info:
        parse_space(space, spec())
    assert info.value.field == field, str(info.value)
    assert "\n" not in str(info.value)


def test_shard_group_is_judged_per_configuration():
    """HSDP in the sweep space: a shard group needs zero >= 1 and whole groups of DP ranks, and
    one that is not smaller than dp is plain FSDP: each of those is pruned, not an error."""
    space = parse_space({"zero": [0, 3], "shard_group": [None, 2, 4]}, spec())
    cands = {(c.config["zero"], c.config["shard_group"]): c for c in enumerate_space(spec(), space, BIG)}
    assert cands[(3, 2)].status == "feasible" and cands[(3, 2)].config["dp"] == 4
    assert cands[(0, 2)].status == "pruned_batch" and "shard_group" in cands[(0, 2)].reason
    assert cands[(3, 4)].status == "pruned_batch" and "no replication" in cands[(3, 4)].reason
    assert cands[(3, 2)].key == "dp4-tp1-pp1-z3-sg2-mb2" and cands[(3, None)].key == "dp4-tp1-pp1-z3-mb2"
    # the memory model divides the sharded state by the group, not by dp
    assert cands[(3, 2)].predicted_mem_bytes > cands[(3, None)].predicted_mem_bytes


def test_unreachable_micro_batch_is_pruned_not_rejected():
    space = parse_space({"micro_batch": [2, 3]}, spec())  # 3 does not divide global_batch 8
    cands = {c.config["micro_batch"]: c for c in enumerate_space(spec(), space, BIG)}
    assert cands[3].status == "pruned_batch" and "global_batch" in cands[3].reason
    assert cands[2].status == "feasible"


def test_enumeration_dp_from_cluster_and_batch():
    space = parse_space({"tp": [1, 2], "pp": [1, 2], "micro_batch": [1, 2, 4, 8]}, spec())
    cands = enumerate_space(spec(), space, Cluster(4, 2, 1 << 40))
    assert len(cands) == 16
    by = {(c.config["tp"], c.config["pp"], c.config["micro_batch"]): c for c in cands}
    # dp: the largest allowed degree whose replicas fit the 4 slots, and grad_accum keeps 8 exact.
    assert by[(1, 1, 2)].config["dp"] == 4 and by[(1, 1, 2)].config["grad_accum"] == 1
    assert by[(2, 2, 2)].config["dp"] == 1 and by[(2, 2, 2)].config["grad_accum"] == 4
    assert by[(1, 1, 8)].config["dp"] == 1  # 8 / 8 = one micro-batch: only dp 1
    for c in cands:
        if c.status == "feasible":
            cfg = c.config
            assert cfg["dp"] * cfg["micro_batch"] * cfg["grad_accum"] == 8
            assert cfg["dp"] * cfg["tp"] * cfg["pp"] <= 4


def test_tp_larger_than_a_node_is_pruned():
    space = parse_space({"tp": [1, 2]}, spec())
    cands = {c.config["tp"]: c for c in enumerate_space(spec(), space, Cluster(4, 1, 1 << 40))}
    assert cands[2].status == "pruned_batch" and "larger than a node" in cands[2].reason
    assert cands[1].status == "feasible"


def test_memory_pruning_uses_the_memory_model():
    space = parse_space({"zero": [0, 3], "activation_checkpointing": [False, True]}, spec())
    s = spec()
    full = enumerate_space(s, space, BIG)
    preds = {config_key(c.config): c.predicted_mem_bytes for c in full}
    c0 = next(c for c in full if c.config["zero"] == 0 and not c.config["activation_checkpointing"])
    want = estimate_memory(s.model, dp=4, zero=0, micro_batch=2, dtype_bytes=4, num_microbatches=1).total
    assert c0.predicted_mem_bytes == want
    budget = sorted(preds.values())[1]  # only the two smallest fit
    pruned = enumerate_space(s, space, Cluster(4, 4, budget))
    status = {config_key(c.config): c.status for c in pruned}
    assert sorted(status.values()).count("feasible") == 2
    for key, st in status.items():
        assert st == ("feasible" if preds[key] <= budget else "pruned_memory"), key


def test_default_space_fits_model_and_cluster():
    sp = default_space(spec(), Cluster(4, 2, 1 << 40))
    assert sp["tp"] == [1, 2] and sp["pp"] == [1, 2] and 8 in sp["micro_batch"]


def _cfg(dp, tp, pp, zero, mb, ac=False):
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "micro_batch": mb,
        "grad_accum": 8 // (dp * mb),
        "activation_checkpointing": ac,
    }


def test_staged_search_screens_groups_then_refines_the_best():
    configs = [_cfg(2, 1, 1, z, mb, ac) for z in (0, 3) for mb in (1, 2, 4) for ac in (False, True)]
    configs += [_cfg(1, 2, 1, 0, mb) for mb in (1, 2)]
    s = StagedSearch(configs, refine_groups=1, metric="tokens_per_s", mode="max")
    first = [s.suggest(f"t{i}") for i in range(3)]
    assert [f["cfg"] for f in first] == [_cfg(2, 1, 1, 0, 4), _cfg(2, 1, 1, 3, 4), _cfg(1, 2, 1, 0, 2)]
    assert s.suggest("t3") is None  # waits for the screening results
    for tid, tps in (("t0", 100.0), ("t1", 300.0), ("t2", 50.0)):
        s.on_trial_result(tid, {"tokens_per_s": tps, "status": "running"})
        s.on_trial_complete(tid, {"tokens_per_s": tps, "status": "running"})
    rest = []
    while (nxt := s.suggest(f"r{len(rest)}")) not in (None, StagedSearch.FINISHED):
        rest.append(nxt["cfg"])
    assert {(c["zero"]) for c in rest} == {3} and len(rest) == 5  # the rest of the zero-3 group


def test_staged_search_respects_max_trials():
    configs = [_cfg(2, 1, 1, z, 2) for z in (0, 1, 2, 3)]
    s = StagedSearch(configs, max_trials=2, metric="tokens_per_s", mode="max")
    assert s.suggest("a") and s.suggest("b")
    assert s.suggest("c") == StagedSearch.FINISHED


def test_report_files_from_entries(tmp_path):
    s = spec()
    entries = [
        {"config": _cfg(2, 1, 1, 0, 2), "status": "ok", "tokens_per_s": 900.0, "mfu": None},
        {"config": _cfg(2, 1, 1, 3, 2), "status": "stopped_early", "tokens_per_s": 400.0, "mfu": None},
        {"config": _cfg(2, 1, 1, 0, 4), "status": "failed", "tokens_per_s": None, "reason": "worker_error: boom"},
        {"config": _cfg(1, 2, 1, 0, 2), "status": "pruned_memory", "tokens_per_s": None, "reason": "too big"},
    ]
    for e in entries:
        e.setdefault("mfu", None)
        e.update(peak_mem_bytes=None, predicted_mem_bytes=1000, trial_s=1.0)
        e.setdefault("reason", None)
    report.write_results(str(tmp_path), entries)
    data = json.loads((tmp_path / "results.json").read_text())
    assert [d["status"] for d in data] == ["ok", "stopped_early", "failed", "pruned_memory"]
    best = report.best_entry(entries)
    path = report.write_best(str(tmp_path), s, best)
    again = JobSpec.from_yaml(path)
    assert (again.parallel.zero, again.parallel.micro_batch) == (0, 2) and again.model == s.model
    png = report.write_heatmap(str(tmp_path), entries)
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 5000
    assert "failed" in report.format_table(entries)


def test_search_state_round_trips_as_json(tmp_path):
    """Tune saves the searcher with the experiment; the file is JSON (never unpickled on a restore)."""
    configs = [
        {"dp": dp, "tp": 1, "pp": 1, "zero": 0, "micro_batch": mb, "activation_checkpointing": ac}
        for dp in (1, 2)
        for mb in (1, 2)
        for ac in (False, True)
    ]
    s = StagedSearch(configs, refine_groups=1, metric="tokens_per_s", mode="max")
    first = s.suggest("a")
    s.on_trial_complete("a", {"tokens_per_s": 5.0, "status": "ok"})
    path = str(tmp_path / "searcher.state")
    s.save(path)
    json.load(open(path))  # plain JSON
    restored = StagedSearch([], metric="tokens_per_s", mode="max")
    restored.restore(path)
    for key in ("groups", "queue", "stage", "launched", "live", "trial_config", "score", "refine_groups"):
        assert getattr(restored, key) == getattr(s, key), key
    assert restored.trial_config["a"] == first["cfg"]
    assert restored.suggest("b") == s.suggest("b")


def test_report_files_hold_no_credentials_and_are_private(tmp_path):
    """Issue 48: best.yaml and sweep.json carried checkpoint.storage_options (keys and secrets)
    in clear, 0644 in a 0755 directory; now the options are left out (named in a comment) and
    every file is 0640 in a 0750 directory, whatever the umask."""
    import stat

    from elastic.run_dirs import make_private_dir

    raw = json.loads(json.dumps(RAW))
    raw["checkpoint"] = {"storage_options": {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}}
    s = JobSpec.from_dict(raw)
    out = tmp_path / "sweep"
    old = os.umask(0o022)
    try:
        make_private_dir(str(out), "--out")
        entries = [{"config": _cfg(2, 1, 1, 0, 2), "status": "ok", "tokens_per_s": 900.0, "mfu": None}]
        entries[0].update(peak_mem_bytes=None, predicted_mem_bytes=1000, trial_s=1.0, reason=None)
        paths = [report.write_results(str(out), entries), report.write_best(str(out), s, entries[0])]
        paths.append(report.write_heatmap(str(out), entries))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o750
    for path in paths:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640, path
        text = open(path, "rb").read()
        assert b"s3cr3t-value" not in text and b"AKIAEXAMPLE" not in text, path
    best = open(paths[1]).read()
    assert "checkpoint.storage_options left out" in best
    assert JobSpec.from_yaml(paths[1]).checkpoint.storage_options == {}
