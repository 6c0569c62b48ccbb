"""``train.optimizer`` and ``train.schedule`` (elastic/optim.py): the spec keys, the
optimizers built against torch's own, the LR curve of each schedule, the memory model's
state bytes."""

from __future__ import annotations

import math

import pytest
import torch

from elastic.errors import SpecError
from elastic.optim import TrainConfig, build_optimizer, lr_factor
from elastic.parallel.memory_model import estimate_for_spec
from elastic.spec import JobSpec

pytestmark = pytest.mark.timeout(60)

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16}


def spec(train: dict) -> JobSpec:
    return JobSpec.from_dict({"model": MODEL, "train": train})


@pytest.mark.parametrize(
    ("train", "field", "words"),
    [
        ({"optimizer": {"name": "lion"}}, "train.optimizer", "'adamw' or 'sgd'"),
        ({"optimizer": {"name": "sgd", "betas": [0.9, 0.9]}}, "train.optimizer.betas", "unknown key"),
        ({"optimizer": {"name": "sgd", "nesterov": True}}, "train.optimizer.nesterov", "momentum > 0"),
        ({"optimizer": {"eps": 0}}, "train.optimizer.eps", "greater than 0"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "train.optimizer.betas.1", "less than 1"),
        ({"schedule": "step"}, "train.schedule", "'wsd'"),
        ({"decay_fraction": 0}, "train.decay_fraction", "greater than 0"),
    ],
)
def test_bad_optimizer_or_schedule_is_refused_naming_the_field(train, field, words):
    with pytest.raises(SpecError) as err:
        spec(train)
    assert err.value.field == field and words in str(err.value)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        loss = model(torch.randn(4, 6, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    ("opt_cfg", "reference"),
    [
        (
            {"name": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            lambda d, n: torch.optim.SGD(
                [{"params": d, "weight_decay": 0.01}, {"params": n, "weight_decay": 0.0}],
                lr=0.1,
                momentum=0.9,
                nesterov=True,
            ),
        ),
        ("sgd", lambda d, n: torch.optim.SGD(d + n, lr=0.1)),
        (
            {"betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05},
            lambda d, n: torch.optim.AdamW(
                [{"params": d, "weight_decay": 0.05}, {"params": n, "weight_decay": 0.0}],
                lr=0.1,
                betas=(0.8, 0.99),
                eps=1e-6,
            ),
        ),
    ],
)
def test_built_optimizer_steps_as_torch_does(opt_cfg, reference):
    """Three steps of the built optimizer equal torch's own with the same arguments (bitwise;
    decay on the matrices only), and the state it keeps is that optimizer's."""
    cfg = TrainConfig(lr=0.1, optimizer=opt_cfg, schedule="constant", warmup_steps=0)
    ours, theirs = _model(), _model()
    opt, _ = build_optimizer(ours, cfg)
    d = [p for p in theirs.parameters() if p.dim() >= 2]
    n = [p for p in theirs.parameters() if p.dim() < 2]
    _steps(ours, opt)
    _steps(theirs, reference(d, n))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    keys = {k for st in opt.state.values() for k in st}
    want = {"momentum_buffer"} if isinstance(opt, torch.optim.SGD) else {"step", "exp_avg", "exp_avg_sq"}
    assert type(opt).__name__ == ("SGD" if "sgd" in str(opt_cfg) else "AdamW")
    assert keys <= want | {"momentum_buffer"} and (keys == want or opt_cfg == "sgd")


def test_adamw_default_is_unchanged():
    """No ``train.optimizer``: AdamW, betas (0.9, 0.95), eps 1e-8, ``train.weight_decay``."""
    opt, _ = build_optimizer(_model(), TrainConfig(weight_decay=0.3))
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8


def test_each_schedule_follows_its_curve():
    """100 steps, warmup 10, floor 0.1: the factor at chosen steps, by hand."""

    def curve(schedule: str, **kw) -> list[float]:
        cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule, **kw)
        return [lr_factor(s, cfg) for s in (0, 9, 10, 55, 79, 80, 90, 100)]

    warm = [0.1, 1.0]
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90)) for s in (10, 55, 79, 80, 90, 100)]
    assert curve("cosine") == pytest.approx(warm + cos, abs=1e-12)
    lin = [1 - 0.9 * (s - 10) / 90 for s in (10, 55, 79, 80, 90, 100)]
    assert curve("linear") == pytest.approx(warm + lin, abs=1e-12)
    assert curve("constant") == pytest.approx(warm + [1.0] * 6)
    # wsd, last 20% decaying: flat to step 80, then linear to the floor at step 100
    assert curve("wsd") == pytest.approx(warm + [1.0, 1.0, 1.0, 1.0, 1 - 0.9 * 0.5, 0.1], abs=1e-12)
    assert curve("wsd", decay_fraction=0.5)[3:] == pytest.approx(
        [1 - 0.9 * 5 / 50, 1 - 0.9 * 29 / 50, 1 - 0.9 * 0.6, 0.28, 0.1]
    )


def test_memory_model_counts_each_optimizers_state():
    """Per-rank state: AdamW 8 bytes a parameter, SGD with momentum 4, plain SGD none."""
    est = {
        name: estimate_for_spec(spec({"optimizer": o}), 1)
        for name, o in [("adamw", {}), ("momentum", {"name": "sgd", "momentum": 0.9}), ("plain", "sgd")]
    }
    params = est["adamw"].params // 4
    assert est["adamw"].optimizer == 8 * params
    assert est["momentum"].optimizer == 4 * params
    assert est["plain"].optimizer == 0
