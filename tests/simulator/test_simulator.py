"""The failure simulator (docs/simulate.md), checked against Meta's closed form, Llama 3's
published run and our own 4-node measurements. Pure Python, no Ray: seconds in all."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from elastic.control import policies
from elastic.simulator import cli, model, scaling
from elastic.simulator.control_plane import ControlPlane
from elastic.simulator.costs import (
    CAUSES,
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    Costs,
    cluster_costs,
    load_measured,
    local_costs,
)

pytestmark = pytest.mark.timeout(120)


def constant_costs(u0: float, w: float, step_s: float = 6.0, detect: float = 30.0) -> Costs:
    return Costs(
        detect_s={c: detect for c in CAUSES},
        reconfigure_s=0.0,
        pg_init_s=0.0,
        restore_memory_s=0.0,
        restore_peer_s=0.0,
        restore_storage_s=0.0,
        restart_s=u0 - detect,
        grow_s=0.0,
        step_s=step_s,
        snapshot_blocking_s=0.0,
        ckpt_blocking_s=w,
        ckpt_write_s=0.0,
        sdc_check_every_steps=0,
    )


def accounted(res: model.Result, wall: float) -> float:
    return res.ettr * wall + sum(v for k, v in res.breakdown_s.items() if k != "reduced_dp")


@pytest.mark.parametrize("interval_s,u0", [(1800.0, 600.0), (600.0, 300.0), (3600.0, 120.0)])
def test_restart_matches_the_closed_form_within_2_percent(interval_s, u0):
    """Constant costs, no waiting for capacity: Meta's E[ETTR] ~ (1 - N r (u0 + dt/2)) / (1 + w/dt)."""
    job = model.Job(gpus=8192, spares=0)
    sc = model.Scenario(failure_rate=6.5, days=365, repair_hours=0.0, seed=1)
    w = 30.0
    costs = constant_costs(u0, w)
    res = model.simulate(job, sc, costs, "restart", interval_s)
    closed = model.closed_form_ettr(job.job_nodes, sc.rate_per_node_s, u0, interval_s, w)
    print(f"dt={interval_s:g} u0={u0:g}: simulated {res.ettr:.4f}, closed form {closed:.4f}, {res.failures} failures")
    assert abs(res.ettr - closed) / closed < 0.02
    assert accounted(res, sc.days * model.DAY) == pytest.approx(sc.days * model.DAY, rel=1e-9)


def test_llama3_run_restart_ettr_is_consistent_with_more_than_90_percent():
    """16,384 GPUs, 419 unexpected interruptions in 54 days (Llama 3, arXiv 2407.21783)."""
    job = model.Job(gpus=LLAMA3_GPUS)
    rate = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * job.job_nodes) * 1000
    sc = model.Scenario(failure_rate=rate, days=LLAMA3_DAYS, seed=0)
    costs = cluster_costs("restart", job.gpus, job.tp, job.pp, batch=job.batch)
    events = model.cluster_events(job, sc)
    reaction = model.Reaction(job)
    interval, _ = model.best_interval(job, sc, costs, "restart", events, reaction)
    res = model.simulate(job, sc, costs, "restart", interval, events, reaction)
    print(f"Llama 3: {res.failures} interruptions, restart ETTR {res.ettr:.4f} at a {interval:.0f} s interval")
    assert abs(res.failures - LLAMA3_INTERRUPTIONS) < 3 * math.sqrt(LLAMA3_INTERRUPTIONS)
    assert 0.90 < res.ettr < 1.0


def test_goal_inplace_reaches_097_at_16k_gpus_and_beats_restart():
    job = model.Job(gpus=16384)
    sc = model.Scenario(failure_rate=6.5, days=30, seed=0)
    events = model.cluster_events(job, sc)
    reaction = model.Reaction(job)
    out = {}
    for s in ("inplace", "restart"):
        costs = cluster_costs(s, job.gpus, job.tp, job.pp, batch=job.batch)
        interval, _ = model.best_interval(job, sc, costs, s, events, reaction)
        out[s] = model.simulate(job, sc, costs, s, interval, events, reaction)
        assert accounted(out[s], sc.days * model.DAY) == pytest.approx(sc.days * model.DAY, rel=1e-9)
    print({s: (round(r.ettr, 4), round(r.goodput, 4), cli.dominant(r)) for s, r in out.items()})
    assert out["inplace"].ettr >= 0.97
    assert out["inplace"].goodput >= 0.97
    assert out["inplace"].ettr > out["restart"].ettr


def _local_failure_time(costs: Costs, strategy: str, interval: float, step: float, kill_step: int) -> float:
    """The benchmark kills the node as soon as step ``kill_step`` is done (before its checkpoint is)."""
    if strategy == "restart":
        return kill_step * (interval + costs.ckpt_blocking_s) - costs.ckpt_blocking_s + 1e-6
    return kill_step * step * (1 + costs.snapshot_blocking_s / step) + 1e-6


@pytest.mark.parametrize("strategy", ["inplace", "restart"])
def test_four_node_cluster_reproduces_the_measured_recovery(strategy):
    """benchmarks/results/recovery.json: ours and Ray Train (tuned, a checkpoint every step),
    one node SIGKILLed at step 12 of a 4-node DDP job (on our side a node is added back)."""
    m = load_measured()
    job = model.Job(gpus=m.nodes, gpus_per_node=1, nodes_per_rack=m.nodes, tp=1, pp=1, spares=0, global_batch=12)
    sc = model.Scenario(failure_rate=0.0, days=0.01, repair_hours=1.0 / 3600)
    costs = local_costs(strategy, m)
    reaction = model.Reaction(job)
    interval = model.effective_interval(costs, costs.step_s if strategy == "restart" else 1e9)
    t_fail = _local_failure_time(costs, strategy, interval, costs.step_s, m.kill_step)
    start = ((m.nodes, 1),)
    events = [model.Event(t_fail, "fail", "host", 0.0, ((m.nodes - 1, 1),), m.nodes)]
    if strategy == "inplace":  # the benchmark adds the node back on our side only
        events.append(model.Event(t_fail + m.node_back_s, "repair", key=start, healthy=m.nodes))
    res = model.simulate(job, sc, costs, strategy, interval, (start, events), reaction)
    rec = res.recoveries[0]
    first_step = reaction.step_s(rec["dp_after"], costs.step_s)
    simulated = rec["downtime_s"] + first_step
    measured = m.recovery_ours_s if strategy == "inplace" else m.recovery_raytrain_s
    lost = m.lost_ours if strategy == "inplace" else m.lost_raytrain
    print(
        f"{strategy}: recovery simulated {simulated:.2f} s vs measured {measured:.2f} s; "
        f"lost {rec['lost_steps']} vs {lost}"
    )
    assert rec["dp_before"] == m.nodes and rec["dp_after"] == m.nodes - 1
    assert abs(simulated - measured) / measured < 0.20
    assert abs(rec["lost_steps"] - lost) <= 0.2 * max(lost, 1e-9)
    # ours grows back once the node returns
    assert res.timeline[-1][1] == (m.nodes if strategy == "inplace" else m.nodes - 1)


def test_planner_at_node_granularity_gives_the_same_replicas_as_per_gpu():
    big = model.Job(gpus=512, nodes_per_rack=4, spares=3)
    node_level = model.Reaction(big)
    gpu_level = model.Reaction(big)
    gpu_level.node_level = False
    assert node_level.node_level
    for key in [((4, 16), (3, 1)), ((4, 14), (3, 3), (2, 1)), ((4, 10), (0, 6), (1, 1))]:
        a, b = node_level.plan(key), gpu_level.plan(key)
        assert (a.max_replicas, a.dp) == (b.max_replicas, b.dp)


@pytest.mark.parametrize("per_rack", [2, 20, 24, 32])
def test_reduced_histograms_count_the_same_replicas_as_the_whole_cluster(per_rack):
    """The planner is called on a few racks and the other full racks are counted by arithmetic;
    this must equal planning the whole cluster."""
    job = model.Job(gpus=4096, nodes_per_rack=per_rack, spares=0)
    reduced, exact = model.Reaction(job), model.Reaction(job)
    exact.exact = True
    full = job.total_nodes // per_rack
    for key in [
        ((per_rack, full),),
        ((per_rack - 1, 3), (per_rack, full - 3)),
        ((0, 1), (per_rack - 2, 2), (per_rack, full - 3)),
        ((per_rack - 1, 7), (per_rack, full - 7)),
    ]:
        assert reduced.replicas(key) == exact.replicas(key), key
        assert reduced.survivors(key, 16) == exact.survivors(key, 16)
    assert reduced.planner_calls == exact.planner_calls


def test_reaction_uses_the_batch_policy_largest_allowed_dp():
    """Losing one of 128 replicas with 2,048 micro-batches and no spare: DP drops to 64,
    the largest divisor of 2,048 below 128 (policies.allowed_dps), not to 127."""
    job = model.Job(gpus=16384, spares=0)
    r = model.Reaction(job)
    racks = job.total_nodes // job.nodes_per_rack
    assert r.dp(((2, racks),)) == 128
    assert r.dp(((1, 1), (2, racks - 1))) == 64 == policies.target_dp(127, r.allowed)
    assert r.survivors(((2, racks),), 128) == 64


def test_spares_keep_dp_and_spare_failures_do_not_interrupt():
    job = model.Job(gpus=2048, spares=16)
    sc = model.Scenario(failure_rate=20, days=10, seed=3)
    costs = cluster_costs("inplace", job.gpus, job.tp, job.pp, batch=job.batch)
    res = model.simulate(job, sc, costs, "inplace", 600)
    assert res.node_failures > res.failures > 0
    assert min(r["dp_after"] for r in res.recoveries) == job.max_dp
    no_spares = model.simulate(replace(job, spares=0), sc, costs, "inplace", 600)
    assert no_spares.mean_dp_fraction < res.mean_dp_fraction


def test_cli_json_has_every_named_cost(capsys):
    rc = cli.standalone(["--gpus", "1024", "--days", "3", "--json", "--seed", "2"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"inplace", "restart"}
    for _s, d in doc.items():
        for key in ("ettr", "goodput", "mean_dp_fraction", "failures", "lost_work_s", "downtime_s", "params"):
            assert key in d, key
        p = d["params"]
        for key in ("nodes", "failure_rate", "ckpt_interval_s", "ckpt_blocking_s", "restart_s", "detect_s", "sources"):
            assert key in p, key
        assert p["ckpt_interval_auto"] is True
        assert 0 < d["ettr"] <= 1


def test_cli_auto_interval_says_so(capsys):
    assert cli.standalone(["--gpus", "1024", "--days", "3", "--strategy", "restart"]) == 0
    out = capsys.readouterr().out
    assert "--ckpt-interval-s auto picked" in out
    assert "largest cost" in out


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--gpus", "0"], "--gpus"),
        (["--failure-rate", "-1"], "--failure-rate"),
        (["--ckpt-interval-s", "soon"], "--ckpt-interval-s"),
        (["--days", "0"], "--days"),
        (["--strategy", "pray"], "--strategy"),
        (["--gpus", "64"], "--gpus"),
        (["--tp", "16"], "--tp"),
        # absurd inputs (issue 48, L15): refused with their bound, before anything is simulated
        (["--days", "1e6"], "--days: at most 3650"),
        (["--days", "0.0001"], "--days: 0.0001 days (8.64 s) hold fewer than 100 steps"),
        (["--failure-rate", "1e5"], "--failure-rate: at most 1000 failures"),
        (["--step-s", "1e9"], "--step-s: 1e+09 s: a step must take 0.001 to 3600 s"),
        (["--step-s", "1e-9"], "--step-s: 1e-09 s: a step must take 0.001 to 3600 s"),
        (["--global-batch", "100000000"], "--global-batch: 100000000 sequences make a step of 3.04e+05 s"),
        (["--gpus", "1024", "--global-batch", "1"], "--global-batch: 1 sequence(s) cannot be split over dp=8"),
        (["--ckpt-interval-s", "1e12"], "--ckpt-interval-s: at most the simulated time (--days 30 = 2.592e+06 s)"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        rc = cli.standalone(argv)
        raise SystemExit(rc)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


@pytest.mark.parametrize("seed", [1, 2])
def test_extreme_but_legal_inputs_account_every_second_and_none_negative(seed):
    """A small job without spares on a cluster where every node fails once a day, with hour
    steps: capacity comes back (a repair) while a failure is still being detected (an SDC's
    detection waits for the next check, 50 h here). That wait was charged as a negative
    ``wait_capacity`` (downtime -173 h at seed 2) and the wall clock did not add up."""
    job = model.Job(gpus=256, spares=1)
    sc = model.Scenario(failure_rate=1000, days=30, seed=seed)
    costs = model.strategy_costs("inplace", job, 3600.0)
    res = model.simulate(job, sc, costs, "inplace", 7200)
    assert min(res.breakdown_s.values()) >= 0 and res.downtime_s >= 0, res.breakdown_s
    assert accounted(res, sc.days * model.DAY) == pytest.approx(sc.days * model.DAY, rel=1e-9)


def test_a_run_that_lost_nothing_says_so(capsys):
    assert cli.standalone(["--gpus", "1024", "--days", "0.01", "--strategy", "restart", "--failure-rate", "0"]) == 0
    out = capsys.readouterr().out
    assert "restart: nothing of the wall clock was lost" in out and "0% of" not in out


def test_figures_are_written(tmp_path, monkeypatch):
    from elastic.simulator import figures

    monkeypatch.setattr(figures, "SCALES", (1024, 2048))
    out = tmp_path / "figs"
    rc = cli.standalone(["--gpus", "1024", "--days", "7", "--out", str(out), "--json"])
    assert rc == 0
    for name in ("ettr_vs_scale.png", "ettr_vs_interval.png", "timeline.png"):
        assert (out / name).stat().st_size > 10_000


def test_elastic_cli_has_simulate(capsys):
    from jobs.cli import main as elastic_main

    with pytest.raises(SystemExit) as exc:
        elastic_main(["simulate", "--nodes-per-rack", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--nodes-per-rack" in err
    assert elastic_main(["simulate", "--gpus", "1024", "--days", "2", "--strategy", "inplace", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"inplace"}


def _curve(fixed_s: float = 1.0, control=None) -> scaling.ReformCurve:
    return scaling.ReformCurve(
        fixed_s=fixed_s, rendezvous_per_rank_s=0.0, ratios={}, kept_state=True, control=control,
        sources={k: "test" for k in ("fixed_s", "comm_s", "control_s", "survivor_restore_s", "rendezvous_per_rank_s")},
    )  # fmt: skip


def test_reform_curve_goes_through_the_cited_points_and_charges_the_control_plane_as_the_costs_do():
    cp = ControlPlane(((1024, 0.2, 0.1), (16384, 1.0, 0.2)), "test")
    c = _curve(control=cp)
    assert c.comm_s(scaling.MEGASCALE[0]) == pytest.approx(scaling.MEGASCALE[1])
    assert c.comm_s(scaling.NCCLX[0]) == pytest.approx(scaling.NCCLX[1])
    assert c.comm_s(16384) < c.comm_s(100_000) < 2 * scaling.NCCLX[1]
    # one extrapolation of control_plane.json: what --json's reform_curve shows is what the costs charge
    for gpus in (1024, 8704, 16384, 31744, 100_000):
        assert c.control_s(gpus) == cp.decision_s(gpus)
    assert c.control_s(16384) == pytest.approx(1.0) and c.control_s(32768) == pytest.approx(2.0)
    assert _curve().control_s(100_000) == 0.0
    assert c.reconfigure_s(16384) == pytest.approx(1.0 + c.comm_s(16384) + 1.0)


def test_cluster_costs_charge_the_measured_curve(monkeypatch):
    c = _curve(fixed_s=0.5)
    monkeypatch.setattr("elastic.simulator.costs.load_curve", lambda: c)
    monkeypatch.setattr("elastic.simulator.costs.load_control_plane", lambda: None)
    costs = cluster_costs("inplace", 16384, 8, 16)
    # the driver's decision comes from the control-plane results once, not from the curve too
    assert costs.reconfigure_s == pytest.approx(c.fixed_s + c.comm_s(16384))
    assert costs.pg_init_s == pytest.approx(c.comm_s(16384))
    assert costs.restore_memory_s < 0.01  # survivors keep their state: a device-memory copy of their parameters
    assert costs.sources["reconfigure_s"].startswith("fixed_s: test")


@pytest.mark.timeout(120)
def test_inplace_ettr_goals_with_the_measured_curve(monkeypatch):
    """Issue 29's goals at 6.5 failures per 1,000 node-days: in-place ETTR >= 0.99 at 16,384
    GPUs and >= 0.95 at 100,000, with a re-formation of 1 s of world-independent work plus
    the communicator bounded by a cold NCCL initialisation at that scale. The driver's own
    decision (``control_plane.json``) is left out here: this checks the re-formation curve."""
    monkeypatch.setattr("elastic.simulator.costs.load_curve", lambda: _curve(fixed_s=1.0))
    monkeypatch.setattr("elastic.simulator.costs.load_control_plane", lambda: None)
    for gpus, days, goal in ((16384, 30, 0.99), (100_000, 10, 0.95)):
        job = model.Job(gpus=gpus)
        sc = model.Scenario(failure_rate=6.5, days=days, seed=0)
        costs = cluster_costs("inplace", job.gpus, job.tp, job.pp, batch=job.batch)
        events = model.cluster_events(job, sc)
        reaction = model.Reaction(job)
        interval, _ = model.best_interval(job, sc, costs, "inplace", events, reaction)
        res = model.simulate(job, sc, costs, "inplace", interval, events, reaction)
        print(f"{gpus} GPUs: in-place ETTR {res.ettr:.4f} ({cli.dominant(res)})")
        assert res.ettr >= goal
