"""Backends and sensors declare what they can do (issue 31): base classes with no-op defaults, checked when
a backend kind is registered and when a sensor enters a window, and no ``hasattr``/``getattr`` probe of a
backend or a sensor anywhere in ipw/."""

import re
from pathlib import Path

import pytest

from ipw.backends.base import BackendBase, BackendSpec, create_backend, register_backend, unregister_backend
from ipw.telemetry.base import EnergyReading, SensorBase, SensorInfo
from ipw.metering.window import Window

PACKAGE = Path(__file__).resolve().parents[2] / "ipw"
PROBE = re.compile(r"\b(hasattr|getattr)\(\s*([^,()]+(?:\([^()]*\))?[^,()]*)\s*,")

#: The hasattr/getattr calls ipw/ may make, by file: the expression probed.  None of them is a backend or
#: a sensor.  A new entry needs a reason here; a probe of a backend or sensor is a missing declaration in
#: ipw/backends/base.py (BackendBase) or ipw/telemetry/base.py (SensorBase) instead.
ALLOWED = {
    # exceptions: an optional attribute of whatever was raised
    "ipw/cli.py": {"exc"},
    "ipw/running/ray_runner.py": {"exc"},
    "ipw/metering/record.py": {"error"},
    # pynvml: constants and fields that differ between its versions
    "ipw/telemetry/sampler.py": {"nvml", "v", "v.value"},
    "ipw/telemetry/nvml_reads.py": {"nvml", "exc", "s.sampleValue"},
    "ipw/telemetry/nvml.py": {"exc", "pynvml"},
    # values read from a dataset or a Parquet row (numpy scalars and arrays)
    "ipw/inputs/datasets.py": {"value"},
    "ipw/inputs/presets.py": {"value"},
    "ipw/results/schema.py": {"value"},
    "ipw/results/manifest.py": {"self"},  # a dataclass's own fields, by name
    "ipw/results/entry.py": {"self"},
    "ipw/results/log.py": {"row"},
    # the platform, a lazy import, third-party objects (vLLM, tokenizers, a stream)
    "ipw/export/mlflow.py": {"found"},  # an MLflow server's answer, whatever the server is
    "ipw/telemetry/snapshots.py": {"os"},
    "ipw/__init__.py": {"importlib.import_module(_LAZY[name])"},
    "ipw/backends/vllm.py": {"tokenizer", "llm", "out", "metrics"},
    "ipw/inputs/convert.py": {"tokenizer"},
    "ipw/commands/doctor.py": {"self.file"},
    # a dataclass's fields by name (frames of per-query values, rendered fits)
    "ipw/analysis/compare.py": {"pq"},
    "ipw/analysis/render.py": {"f[what]", "s"},  # s: a steady level's own fields (SteadyLevel), by name
    # inside the worker process: the engine object (not a Backend) is called by the method a request
    # names, and a batching engine says so with its ``concurrency``; the engine class is imported by name
    "ipw/backends/worker.py": {"engine", "importlib.import_module(module)"},
}


def probes() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in PROBE.finditer(line):
                out.append((rel, n, m.group(2).strip()))
    return out


def test_the_grep_finds_probes():
    assert PROBE.search('if hasattr(backend, "attach"):').group(2) == "backend"
    assert PROBE.search('x = getattr(self.backend, "energy_estimate", None)').group(2) == "self.backend"
    assert PROBE.search("getattr(importlib.import_module(m), name)").group(2) == "importlib.import_module(m)"
    assert {("ipw/cli.py", "exc"), ("ipw/telemetry/sampler.py", "nvml")} <= {(f, w) for f, _, w in probes()}


def test_no_probe_of_a_backend_or_sensor():
    bad = [f"{f}:{n}: {what}" for f, n, what in probes() if what not in ALLOWED.get(f, set())]
    assert not bad, ("hasattr/getattr on something not allow-listed (a backend or sensor must declare the member "
                     "in BackendBase/SensorBase instead):\n" + "\n".join(bad))


# --- backends -----------------------------------------------------------------------------------------

class Minimal(BackendBase):
    def generate(self, prompt, settings):
        raise AssertionError("not called")


def test_a_backend_gets_every_default():
    register_backend("minimal", Minimal, replace=True)
    try:
        b = create_backend(BackendSpec("m", "minimal", "model"))
    finally:
        unregister_backend("minimal")
    assert (b.concurrency, b.levels, b.remote, b.energy_estimate) == (1, (), False, None)
    assert b.preflight() is None and b.attach("/tmp") is None and b.recover() is None
    assert b.pids() == [] and b.describe() == {} and b.close() is None


def test_registration_checks_the_contract():
    class NoGenerate(BackendBase):
        pass

    with pytest.raises(TypeError, match="does not define generate"):
        register_backend("bad", NoGenerate)

    class Duck:  # outside the hierarchy: needs every member, and is then registered as a BackendBase
        def __init__(self, spec):
            self.spec = spec

        def load(self): ...

        def generate(self, prompt, settings): ...

    with pytest.raises(TypeError, match="does not define pids, describe, close"):
        register_backend("bad", Duck)
    with pytest.raises(TypeError, match="factory must be"):
        register_backend("bad", 42)

    Duck.pids = Duck.describe = Duck.close = lambda self: None
    register_backend("duck", Duck, replace=True)
    register_backend("plain", lambda spec: object(), replace=True)
    try:
        duck = create_backend(BackendSpec("d", "duck", "model"))
        assert isinstance(duck, Duck) and isinstance(duck, BackendBase) and duck.remote is False
        with pytest.raises(TypeError, match="not a BackendBase"):
            create_backend(BackendSpec("p", "plain", "model"))
    finally:
        unregister_backend("duck")
        unregister_backend("plain")


def test_built_in_backends_meet_the_contract():
    from ipw.backends.base import _resolve, backend_kinds

    for kind in backend_kinds():
        assert issubclass(_resolve(kind), BackendBase), kind


# --- sensors ------------------------------------------------------------------------------------------

class Tick(SensorBase):
    name = "tick"

    def __init__(self):
        self.n = 0

    def info(self):
        return SensorInfo("tick", True, "test.tick", "measured", "cpu_package", ("cpu",))

    def begin(self, t_s=None):
        self.n += 1
        return self.n

    def end(self, token, t_s=None):
        return [EnergyReading("cpu", 1.0, "test.tick", "measured", "cpu_package", 0.1)]


def test_a_sensor_gets_every_default():
    s = Tick()
    assert not (s.supports_cut or s.supports_split or s.supports_trace or s.supports_energy_windows)
    part, nxt = s.cut(1)  # end, then begin
    assert part[0].energy_j == 1.0 and nxt == 1
    assert s.split(1, 0.0) == [] and s.trace() == {} and s.overhead() == {} and s.energy_windows([]) == {}
    closed, following = Window([s]).cut([nxt])
    assert closed.readings()[0].energy_j == 1.0 and following == [2]


def test_a_declared_capability_needs_its_method():
    with pytest.raises(TypeError, match="declares supports_trace but does not define trace"):
        class Liar(Tick):
            supports_trace = True


def test_a_window_takes_sensors_only():
    class Duck:
        def begin(self): ...

    with pytest.raises(TypeError, match="not a sensor: subclass ipw.telemetry.base.SensorBase"):
        Window([Duck()])


def test_built_in_sensors_declare_what_they_do():
    from ipw.telemetry.cpu_model import CpuModelSensor
    from ipw.telemetry.nvml import NvmlSensor
    from ipw.telemetry.rapl import RaplSensor

    assert RaplSensor.supports_cut and RaplSensor.supports_split and not RaplSensor.supports_trace
    assert CpuModelSensor.supports_cut and CpuModelSensor.supports_split
    assert NvmlSensor.supports_cut and NvmlSensor.supports_trace and NvmlSensor.supports_energy_windows
    assert not NvmlSensor.supports_split
