"""The aggregators and the agent tree without Ray: merged rows, lost children, hosted
(local) children, the tree's shape and routes, calls applied in the order they were sent."""

from __future__ import annotations

import math

import pytest
from agent_testlib import Clock, ScriptedRanks, node, report

from elastic.agent.aggregator import AggregatorCore
from elastic.agent.bell import Doorbell
from elastic.agent.node import LINGER_S, NodeCore
from elastic.messages import Attach, Poll, PollReply

pytestmark = pytest.mark.timeout(30)


def test_aggregator_merges_its_nodes_rows_and_reports_a_lost_child():
    clock = Clock()
    agg = AggregatorCore(Doorbell(None), clock=clock, child_wait_s=0.0)
    nodes = []
    for i in range(3):
        backend = ScriptedRanks()
        core = NodeCore(f"n{i}", backend, clock=clock)
        core.command(1, Attach({10 * i: (f"r{10 * i}", i)}))
        core.pump(0)
        nodes.append((core, backend))
        agg.adopt(f"n{i}", core, [f"n{i}"], local=True)
    for i, (core, backend) in enumerate(nodes):
        backend.pending(f"r{10 * i}", Poll)[0].answer(PollReply(i, 1, "train", 0.0, [report(1, 1.0 + i)]))
        core.pump(0)
    for _ in range(50):
        agg.pump(0.05)
        if sum(len(r.ranks) for r in agg.rows) == 3:
            break
    clock.t += LINGER_S * 1.5
    d = agg.digest(None, 0.0)
    assert [(r.step, sorted(r.ranks.tolist())) for r in d.rows] == [(1, [0, 1, 2])]  # one block for the step
    assert d.seqs == {"n0": 1, "n1": 1, "n2": 1}
    nodes[1][0].gone = True  # node n1 is lost with its agent
    for _ in range(50):
        agg.pump(0.05)
        if agg.dead:
            break
    assert agg.digest(None, 0.0).lost == {"n1": math.inf}


def test_a_local_child_with_news_rings_its_aggregator_and_is_asked_without_waiting():
    """Hosted nodes (the control-plane benchmark's) take no thread in their aggregator: a
    node whose pump made news rings the aggregator's bell, and the aggregator asks it then
    (a done future) instead of keeping a long poll in flight for it."""
    clock = Clock()
    bell = Doorbell(None)
    agg = AggregatorCore(bell, clock=clock, child_wait_s=10.0)
    core, backend, _ = node(ranks=1)
    core.clock = clock
    agg.adopt("n0", core, ["n0"], local=True)
    agg.pump(0.0)  # the first ask (a new link asks for everything)
    assert not core.has_news() and bell.answer(0.0) is False
    backend.pending("r0", Poll)[0].answer(PollReply(0, 1, "train", 0.0, [report(1)]))
    core.pump(0)  # rows linger, but the poll's state change is news
    assert core.has_news() and bell.answer(0.0) is True
    agg.pump(0.0)
    assert agg.children["n0"].request is None and not core.has_news()  # asked and taken at once


class _Method:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, sender, seq, *args):  # control calls are numbered per receiver
        self.log.append((self.name, args))
        self.log.append(("#", seq))


class _Handle:
    """Records the calls made to it, like an actor handle's ``.remote``."""

    def __init__(self, name):
        self.name, self.log = name, []

    def __getattr__(self, method):
        return _Method(self.log, method)


def test_tree_depth_keeps_the_driver_fan_in_bounded():
    from elastic.control.agent_link import tree_depth

    assert tree_depth(4, fan_in=32) == 0  # a few nodes: the driver talks to the agents
    assert tree_depth(32, fan_in=32) == 0
    assert tree_depth(128, fan_in=32) == 1  # 4 aggregators
    assert tree_depth(2048, fan_in=32) == 2  # 64 leaves under 2 top aggregators
    assert tree_depth(100_000 // 8, fan_in=32) == 3  # 391 leaves, 13 above them, 1 top


def test_agent_tree_routes_every_node_through_its_ancestors():
    from elastic.control.agent_link import AgentTree

    made = []

    def agg():
        made.append(_Handle(f"agg{len(made)}"))
        return made[-1]

    tree = AgentTree(lambda node: _Handle(node), agg, fan_in=2, kill=lambda handle: None)  # no actors to kill
    tree.add_nodes([f"n{i}" for i in range(5)], expected_nodes=20)  # depth 2: 2 per leaf, 2 leaves per top
    assert tree.depth == 2 and len(tree.channels) == 2  # 3 leaves -> 2 top aggregators
    for i in range(5):
        chain = tree.chain(f"n{i}")
        assert len(chain) == 3 and tree.channel_of(f"n{i}") == chain[-1]
        leaf, top = tree.handles[chain[1]], tree.handles[chain[2]]
        assert ("adopt", (f"n{i}", tree.handles[f"n{i}"], [f"n{i}"])) in leaf.log
        assert ("route", (chain[1], [f"n{i}"])) in top.log  # the top routes the node to its leaf
    tree.remove_node("n0")
    leaf, top = (tree.handles[k] for k in tree.chain("n1")[1:])  # n0's leaf (shared with n1), then its top
    assert ("disown", (["n0"],)) in leaf.log and ("disown", (["n0"],)) in top.log
    assert "n0" not in tree.nodes_under[tree.chain("n1")[1]] and "n1" in tree.nodes_under[tree.chain("n1")[2]]
    for handle in made:  # each receiver's calls are numbered 1, 2, 3, ...
        numbers = [n for what, n in handle.log if what == "#"]
        assert numbers == list(range(1, len(numbers) + 1))


def test_calls_apply_in_the_order_they_were_sent():
    from elastic.agent.ordered import InOrder

    done = []
    order = InOrder()
    order.run("driver", 2, done.append, "b")  # came early: held
    order.run("driver", 3, done.append, "c")
    assert done == []
    order.run("driver", 1, done.append, "a")
    assert done == ["a", "b", "c"]
    order.run("agg-new", 2, done.append, "y")  # another sender: numbered on its own
    order.run("driver", 4, done.append, "d")  # ... and the first one's go on
    order.run("agg-new", 1, done.append, "x")
    assert done == ["a", "b", "c", "d", "x", "y"]


def test_step_rows_wait_for_the_parents_linger_and_news_does_not():
    """The driver asks its channels to hold step rows for a share of a step (StepPace), so
    that thousands of nodes' rows come up in one digest; news still goes up at once."""
    import threading
    import time

    from elastic.control.agent_link import ROW_LINGER_MAX_S, StepPace

    agg = AggregatorCore(Doorbell(None), clock=time.monotonic, child_wait_s=0.0)
    clock = Clock()
    core = NodeCore("n0", ScriptedRanks(), clock=clock)
    core.command(1, Attach({0: ("r0", 0)}))
    core.pump(0)
    agg.adopt("n0", core, ["n0"], local=True)
    for step in (1, 2):  # step 1 comes with the rank's first news; step 2 is rows alone
        agg.digest(None, 0.0)
        core.backend.pending("r0", Poll)[-1].answer(PollReply(0, step, "train", 0.0, [report(step)]))
        core.pump(0)
        clock.t += LINGER_S * 1.5
        core.pump(0)
        for _ in range(50):
            agg.pump(0.05)
            if agg.rows:
                break
    t0 = time.monotonic()
    d = agg.digest(None, 5.0, False, 0.4)
    waited = time.monotonic() - t0
    assert [r.step for r in d.rows] == [2] and 0.3 <= waited < 4.0, waited  # held, then sent
    agg.rows, agg.first_row_at = list(d.rows), time.monotonic()  # rows again, and news comes

    def news() -> None:  # a child's state changed
        with agg.cond:
            agg.version += 1
            agg.cond.notify_all()

    threading.Timer(0.05, news).start()
    t0 = time.monotonic()
    d = agg.digest(None, 5.0, False, 5.0)
    assert time.monotonic() - t0 < 4.0 and [r.step for r in d.rows] == [2]  # news took the rows along

    pace = StepPace()
    for step, now in ((5, 100.0), (6, 102.0), (8, 106.0), (3, 200.0), (4, 202.0)):
        pace.saw(step, now)
    assert pace.step_s == pytest.approx(2.0) and pace.linger_s() == pytest.approx(0.2)
    pace.saw(400, 202.5)  # a burst of steps: the linger stays capped
    assert pace.linger_s() <= ROW_LINGER_MAX_S


def test_a_child_whose_lifeline_ended_is_reported_dead_at_once():
    """An actor child's lifeline ended (``lifeline.py``): it is lost (inf) in the next digest,
    without waiting for its long poll; a local child, a child already replaced or an unknown
    key is not touched."""

    class Handle:  # an actor child whose digest call never returns (its process is gone)
        class digest:
            @staticmethod
            def remote(*args):
                return object()

    clock = Clock()
    agg = AggregatorCore(Doorbell(None), clock=clock, child_wait_s=0.0)
    agg.adopt("n0", Handle(), ["n0"])
    agg.adopt("n1", NodeCore("n1", ScriptedRanks(), clock=clock), ["n1"], local=True)
    assert agg.digest(None, 0.0).lost == {}
    version = agg.version
    agg.child_gone("n0")
    agg.child_gone("n1")  # local: its end is its own process's
    agg.child_gone("n9")  # not a child
    assert agg.version == version + 1
    assert agg.digest(None, 0.0).lost == {"n0": math.inf}
    agg.adopt("n0", Handle(), ["n0"])  # replaced: alive again
    assert agg.digest(None, 0.0).lost == {}


def test_an_agent_killed_for_memory_is_a_lost_child_not_an_error():
    """Ray's memory monitor kills an agent: its calls raise OutOfMemoryError, which is not
    a RayActorError; the aggregator reports the child lost (it failed the job before)."""
    from ray.exceptions import OutOfMemoryError

    clock = Clock()
    agg = AggregatorCore(Doorbell(None), clock=clock, child_wait_s=0.0)
    core = NodeCore("n0", ScriptedRanks(), clock=clock)
    agg.adopt("n0", core, ["n0"], local=True)

    def killed(*args, **kwargs):
        raise OutOfMemoryError("1 worker(s) were killed due to the node running low on memory")

    core.digest = killed
    for _ in range(50):
        agg.pump(0.05)
        if agg.dead:
            break
    assert agg.digest(None, 0.0).lost == {"n0": math.inf}
