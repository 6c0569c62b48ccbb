"""A stand-in for the ``wandb`` module (its real client needs a network or a login): the
calls the W&B callback makes, recorded. Shared by the tracking tests."""

from __future__ import annotations

import types


class FakeWandb(types.ModuleType):
    """The part of ``wandb``'s API the callback uses, recording every call."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        fake = self

        class Run:
            def define_metric(self, name, step_metric=None):
                fake.calls.append(("define_metric", name, step_metric))

            def log(self, data):
                fake.calls.append(("log", data))

            def finish(self):
                fake.calls.append(("finish",))

        return Run()
