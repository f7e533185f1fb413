"""Test doubles shared by the judge, coverage and preset tests: a backend whose reply is a function of
the prompt, and a sensor that reports a fixed estimated energy per window."""

import time

from ipw.backends.base import BackendBase, Completion
from ipw.telemetry.base import EnergyReading, SensorBase, SensorInfo


class ScriptedBackend(BackendBase):
    """A backend that answers ``reply(prompt)`` at once; ``tokens`` gives (prompt, completion) counts."""

    def __init__(self, spec):
        self.spec = spec

    def reply(self, prompt: str) -> str:
        raise NotImplementedError

    def tokens(self, prompt: str, text: str) -> tuple[int, int]:
        return 100, 2

    def load(self):
        pass

    def generate(self, prompt, settings):
        now = time.monotonic()
        text = self.reply(prompt)
        return Completion(text, *self.tokens(prompt, text), now, now, now + 0.001, (now,), "stop")

    def pids(self):
        return []

    def describe(self):
        return {"engine": "scripted"}

    def close(self):
        pass


class FixedSensor(SensorBase):
    """A sensor whose every window costs ``energy_j`` joules, estimated (CPU model)."""

    name = "fixed"

    def __init__(self, energy_j: float):
        self.energy_j = energy_j

    def info(self):
        return SensorInfo("fixed", True, "model.cpu", "estimated", "cpu_package")

    def begin(self, t_s=None):
        return None

    def end(self, token, t_s=None):
        return [EnergyReading("cpu", self.energy_j, "model.cpu", "estimated", "cpu_package", 0.001)]

    def close(self):
        pass
