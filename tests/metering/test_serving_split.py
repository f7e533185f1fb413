"""The split of overlapping requests' energy (docs/ARCHITECTURE.md, 'Energy method'; docs/SERVING.md): by the work each request
does in each slice, its prompt tokens over the prefill the server timed and its output tokens as they
arrive; conserved (parts + unattributed == the span's energy); labelled per record."""

import dataclasses
import json
import threading
import time

import numpy as np
import pandas as pd
import pytest

from ipw.backends.base import BackendBase, Completion, ServerTimings
from ipw.telemetry.base import EnergyReading, SensorBase, SensorInfo
from ipw.metering.split import Request, by_time, split_concurrent, split_method


def test_prefill_beside_decode_hand_made():
    """Request A decodes through both slices; B arrives at 0.5 s and prefills 30 prompt tokens in
    [0.5, 1.0], then decodes.  By work, slice 0's 10 J goes 3:30; by decode tokens alone A would have
    paid for B's prefill."""
    edges = [0.0, 1.0, 2.0]
    energy = [10.0, 20.0]
    a = Request(0.0, 2.0, (0.25, 0.5, 0.75, 1.25, 1.5, 1.75))
    b = Request(0.5, 2.0, (1.1, 1.4, 1.7), prefill_s=(0.5, 1.0), prefill_tokens=30)
    split = split_concurrent(edges, energy, [a, b])
    assert split.per_request_j == pytest.approx((10 * 3 / 33 + 10.0, 10 * 30 / 33 + 10.0))
    assert split.unattributed_j == 0.0 and sum(split.per_request_j) == pytest.approx(30.0)
    decode_only = split_concurrent(edges, energy, [a, Request(0.5, 2.0, b.token_times_s)])
    assert decode_only.per_request_j == pytest.approx((10.0 + 10.0, 0.0 + 10.0))
    # a prefill that straddles the slice edge is spread evenly over its duration
    c = Request(0.5, 2.0, (), prefill_s=(0.5, 1.5), prefill_tokens=10)
    split = split_concurrent(edges, energy, [Request(0.0, 2.0, (0.2, 1.2)), c])
    assert split.per_request_j == pytest.approx((10 * 1 / 6 + 20 * 1 / 6, 10 * 5 / 6 + 20 * 5 / 6))
    # an instant prefill (prompt_ms 0) lands in the slice of that instant
    d = Request(0.5, 2.0, (), prefill_s=(1.5, 1.5), prefill_tokens=4)
    split = split_concurrent(edges, energy, [Request(0.0, 2.0, (0.2, 1.2)), d])
    assert split.per_request_j == pytest.approx((10.0 + 20 * 1 / 5, 20 * 4 / 5))
    # labels: the best weighting each request's data allows
    assert [split_method(r) for r in (b, a, Request(0, 1))] == ["work", "decode_tokens", "time"]
    # by active time alone: A is active all of slice 0, B half of it
    assert split_concurrent(edges, energy, by_time([a, b])).per_request_j == pytest.approx((10 * 2 / 3 + 10.0, 10 / 3 + 10.0))


class ConstantPower(SensorBase):
    """A sensor drawing ``power_w`` watts: each window costs power x its length; it can cut windows
    (``Window.cut``), so consecutive windows tile time."""

    name = "constant"
    supports_cut = True

    def __init__(self, power_w: float) -> None:
        self.power_w = power_w
        self.windows: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def info(self):
        return SensorInfo("constant", True, "rapl.package", "measured", "cpu_package", ("cpu",))

    def begin(self, t_s=None):
        return time.monotonic() if t_s is None else t_s

    def cut(self, token, t_s=None):
        now = time.monotonic() if t_s is None else t_s
        with self.lock:
            self.windows.append((token, now))
        return [EnergyReading("cpu", self.power_w * (now - token), "rapl.package", "measured", "cpu_package",
                              now - token)], now

    def end(self, token, t_s=None):
        return self.cut(token, t_s)[0]

    def close(self):
        pass


class ScriptedServer(BackendBase):
    """What the scripted servers below share: a backend that only answers (``generate``)."""

    def __init__(self, spec):
        self.spec = spec

    def load(self):
        pass

    def pids(self):
        return []

    def describe(self):
        return {"engine": type(self).__name__}

    def close(self):
        pass


def run_scripted(tmp_path, backend: type, prompts: dict[str, str], split: str, sensor) -> tuple:
    """One ``ipw run`` of ``backend`` on ``prompts`` (id -> prompt) with ``sensor``: its folder's records and
    the manifest's first level line."""
    from ipw.backends.base import register_backend, unregister_backend
    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": q, "prompt": p, "answer": "4", "scorer": "numeric"}) + "\n"
                            for q, p in prompts.items()))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'dataset = "{data}"\nwarmup = 0\nidle_s = 0\nout_dir = "{tmp_path / "runs"}"\n'
                   f'energy_split = "{split}"\n\n[[backends]]\nname = "srv"\nkind = "scripted"\nmodel = "m"\n'
                   'role = "cloud"\n')
    register_backend("scripted", backend, replace=True)
    try:
        config = load_config(str(cfg))
        folder, queries = start_run(config, command=["test"])
        assert execute(folder, config, queries, lambda r: None, probe=lambda backend: [sensor]) == "complete"
    finally:
        unregister_backend("scripted")
    level = json.loads((folder.path / "manifest.json").read_text())["backends"][0]["levels"][0]
    return folder, pd.read_parquet(folder.path / "records.parquet"), level


class PrefillBesideDecode(ScriptedServer):
    """A scripted server: q-decode streams 19 output tokens over 0.6 s (its prompt already cached: no
    prefill work); q-prefill, sent at the same moment, waits 0.1 s in the queue, prefills 300 prompt
    tokens in [0.1, 0.2] s (as the server times it) and streams 12 output tokens until 0.9 s."""

    concurrency = 2
    token_times: dict[str, tuple[float, ...]] = {}  # what each request streamed, for the test's own count

    def generate(self, prompt, settings):
        start = time.monotonic()
        if "decode" in prompt:
            times = tuple(start + 0.03 * k for k in range(1, 20))
            timings, length = ServerTimings(0, 0.0, 19, 570.0), 0.6
        else:
            times = tuple(start + 0.25 + 0.05 * k for k in range(12))
            timings, length = ServerTimings(300, 100.0, 12, 550.0), 0.9
        self.token_times["decode" if "decode" in prompt else "prefill"] = times
        time.sleep(max(0.0, start + length - time.monotonic()))
        return Completion("4", 12, len(times), start, times[0], time.monotonic(), times, "stop", timings)


@pytest.mark.parametrize("split", ["local", "priced"])
def test_runner_splits_a_prefill_beside_a_decode_by_work(tmp_path, split):
    """``local``: the shared slice by the work done in it; ``priced``: the one accounting period (A alone, both,
    B alone: no gap) by each request's priced work, prompt tokens at the default weight (too few bins for a fit)."""
    sensor = ConstantPower(100.0)
    folder, frame, level = run_scripted(tmp_path, PrefillBesideDecode, {q: f"{q}: 2 + 2?" for q in ("q-decode", "q-prefill")},
                                        split, sensor)
    frame = frame.set_index("query_id")
    a, b = frame.loc["q-decode"], frame.loc["q-prefill"]
    assert b.start_s < a.end_s and a.start_s < b.end_s  # they overlap
    method = "work" if split == "local" else "priced"
    assert set(frame["concurrency"]) == {2} and set(frame["split_method"]) == {method}
    # the sensor's windows: before A, A alone until B's request starts, both until A ends, B alone (the span
    # ends with the last request, not when the records are built)
    windows = sorted(sensor.windows)
    assert len(windows) == 4 and all(w1[0] == w0[1] for w0, w1 in zip(windows, windows[1:]))  # they tile
    first, both, last = (t1 - t0 for t0, t1 in windows[1:4])
    assert both > 0.5
    # in the shared slice [B's start, A's end): A's output tokens there (all 19 unless B's thread started
    # late), B's 300 prompt tokens (its prefill lies inside) and its outputs before A ended (7 of 12)
    times = PrefillBesideDecode.token_times
    work_a = sum(b.start_s <= t < a.end_s for t in times["decode"])
    work_b = 300 + sum(b.start_s <= t < a.end_s for t in times["prefill"])
    p = 100.0
    local_a = p * first + p * both * work_a / (work_a + work_b)
    local_b = p * both * work_b / (work_a + work_b) + p * last
    # all of A's work (its 12-token prompt, cached, is priced whole, and 19 outputs); all of B's (300 + 12)
    priced_a = p * (first + both + last) * (12 + 19) / (12 + 19 + 300 + 12)
    priced_b = p * (first + both + last) * (300 + 12) / (12 + 19 + 300 + 12)
    expected_a, expected_b = (local_a, local_b) if split == "local" else (priced_a, priced_b)
    assert a.energy_j == pytest.approx(expected_a, rel=1e-9)
    assert b.energy_j == pytest.approx(expected_b, rel=1e-9)
    # the split's own uncertainty: the distance to the other split
    assert a.split_uncertainty_j == pytest.approx(abs(local_a - priced_a), rel=1e-3)
    # conserved: the records' parts plus the unattributed time equal the span the sensor measured
    assert level["concurrency"] == 2 and level["requests"] == 2 and level["split_methods"] == {method: 2}
    tally = level["energy"]["cpu"]
    span = sum(p * (t1 - t0) for t0, t1 in sensor.windows)
    assert tally["span_j"] == pytest.approx(span, rel=1e-6)
    assert tally["parts_j"] + tally["unattributed_j"] == pytest.approx(tally["span_j"], rel=1e-6)
    assert frame["energy_j"].sum() == pytest.approx(tally["parts_j"], rel=1e-6)
    assert tally["unattributed_j"] == pytest.approx(p * (windows[0][1] - windows[0][0]), abs=1e-5)  # µJ rounding
    assert level["end_s"] == pytest.approx(b.end_s, abs=1e-3)


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0,4"], r"--concurrency '0,4': each level must be an integer from 1 to 10000, got 0"),
    (["--concurrency", "1" + "0" * 23], r"each level must be an integer from 1 to 10000, got 1000000000000"),
    (["--concurrency", "1,four"], r"--concurrency '1,four': expected requests in flight as whole numbers"),
    (["--concurrency", "4", "--backend", "smollm2-135m"], r"no backend of this run serves concurrent requests"),
    (["--energy-split", "fair"], r"--energy-split: must be one of priced, local, got 'fair'"),
])
def test_bad_concurrency_is_a_usage_error(run_cli, args, message):
    import re

    code, _, err = run_cli("run", *args)
    assert code == 2 and re.search(message, " ".join(err.split())), err
    assert "Traceback" not in err


class Waves(ScriptedServer):
    """A scripted batching server with 3 slots: identical requests (20 prompt tokens prefilled in 5 ms, then 10
    output tokens 20 ms apart) queue for a slot, so 8 requests in flight run in waves of 3, 3 and 2, and the
    last wave decodes with fewer co-decoders."""

    concurrency = 8
    slots = threading.Semaphore(3)

    def generate(self, prompt, settings):
        start = time.monotonic()
        with self.slots:
            first = time.monotonic() + 0.005
            times = tuple(first + 0.02 * k for k in range(10))
            time.sleep(max(0.0, times[-1] - time.monotonic()))
        return Completion("4", 20, 10, start, times[0], time.monotonic(), times, "stop",
                          ServerTimings(20, 5.0, 10, 200.0))


@pytest.mark.parametrize("split", ["priced", "local"])
def test_identical_requests_in_two_waves_get_equal_shares(tmp_path, split):
    """Identical work gets an identical share whichever scheduling wave it ran in (the priced split, within
    1%); the time-local split charges the last wave, which decodes with fewer co-decoders, more.  Both conserve
    exactly."""
    _, frame, level = run_scripted(tmp_path, Waves, {f"q{i}": "2 + 2?" for i in range(8)}, split, ConstantPower(100.0))
    shares = frame["energy_j"].to_numpy()
    spread = (shares.max() - shares.min()) / shares.mean()
    tally = level["energy"]["cpu"]
    assert tally["parts_j"] + tally["unattributed_j"] == pytest.approx(tally["span_j"], rel=1e-6)
    assert shares.sum() == pytest.approx(tally["parts_j"], rel=1e-6)
    if split == "priced":
        assert set(frame["split_method"]) == {"priced"}
        assert spread < 0.01, shares
        assert level["pricing"]["prefill_weight"] > 0
    else:
        assert set(frame["split_method"]) == {"work"}
        assert spread > 0.2, shares  # the last wave's two requests pay the static power of a wave of three


def test_priced_split_prices_whole_prompts_and_conserves():
    """The priced split spreads the busy slices' energy by priced work over the whole span: a request whose
    prompt was in its slot's cache (1 prompt token computed of 40) costs what an identical uncached one costs,
    whatever slices each ran in; a prompt without server timings is placed from the start to the first token
    and priced too; the parts and the idle slices add up."""
    edges = [0.0, 1.0, 2.0, 3.0]
    energy = [30.0, 10.0, 5.0]  # the last slice has no request in flight
    cached = Request(0.0, 1.5, (0.3, 0.6, 0.9, 1.2), prefill_s=(0.0, 0.3), prefill_tokens=1, prompt_tokens=40)
    fresh = Request(0.5, 2.0, (0.8, 1.1, 1.4, 1.7), prefill_s=(0.5, 0.8), prefill_tokens=40, prompt_tokens=40)
    untimed = Request(0.2, 1.0, (0.4, 0.6), prompt_tokens=10)  # a server without timings (vLLM)
    split = split_concurrent(edges, energy, [cached, fresh, untimed], split="priced", prefill_weight=0.5)
    work = [0.5 * 40 + 4, 0.5 * 40 + 4, 0.5 * 10 + 2]
    assert split.per_request_j == pytest.approx(tuple(40.0 * w / sum(work) for w in work))
    assert split.unattributed_j == 5.0 and sum(split.per_request_j) + 5.0 == pytest.approx(45.0)
    assert [split_method(r, "priced") for r in (cached, untimed, Request(0, 1, (0.5,)), Request(0, 1))] == [
        "priced", "priced_ttft", "priced_decode", "time"]


def test_a_streamed_answer_without_timings_has_its_prompt_placed_before_its_first_token():
    """vLLM's OpenAI server streams its tokens but times no request: the prompt is placed from the request's
    start to its first token, and the record's method says so (``priced_ttft``, ``work_ttft``); the local split
    then charges that prompt to the request, not to the requests decoding beside it.  The engine's own timing
    (vLLM in process, as ``server_timings``) places it exactly (``priced``)."""
    from ipw.backends.base import Completion, ServerTimings
    from ipw.metering.meter import request_of

    streamed = Completion("x", prompt_tokens=30, completion_tokens=3, start_s=1.0, first_token_s=1.4, end_s=2.0,
                          token_times_s=(1.4, 1.7, 2.0))
    untimed = request_of(streamed, 1.0, 2.0)
    assert (untimed.prefill_s, untimed.prefill_tokens, untimed.prefill_timed) == ((1.0, 1.4), 30, False)
    assert (split_method(untimed, "priced"), split_method(untimed, "local")) == ("priced_ttft", "work_ttft")
    engine = dataclasses.replace(streamed, server_timings=ServerTimings(30, 100.0, 3, 600.0))
    timed = request_of(engine, 1.0, 2.0)
    assert timed.prefill_s == pytest.approx((1.3, 1.4)) and timed.prefill_timed
    assert (split_method(timed, "priced"), split_method(timed, "local")) == ("priced", "work")
    # beside a request decoding alone, the local split gives the streamed request its prompt's work
    neighbour = Request(0.0, 2.0, tuple(np.linspace(0.05, 2.0, 40)))
    split = split_concurrent([1.0, 1.4, 2.0], [10.0, 10.0], [untimed, neighbour], split="local")
    assert split.per_request_j[0] > 10.0 * 30 / (30 + 8) - 1e-9  # its 30 prompt tokens against ~8 of the other's
    unknown = request_of(dataclasses.replace(streamed, prompt_tokens=0), 1.0, 2.0)
    assert unknown.prefill_s is None and split_method(unknown, "local") == "decode_tokens"


def test_a_plain_answer_is_placed_by_the_servers_timings():
    """A plain answer carries all its tokens at its end; with llama-server's timings its output tokens are
    spread over the decode time before its end and its prefill placed just before them, so that the priced
    split sees its work where the server did it (and not one burst at the end)."""
    from ipw.metering.meter import request_of

    plain = Completion("x", 40, 5, 10.0, None, 12.0, (), "stop", ServerTimings(40, 100.0, 5, 1000.0))
    r = request_of(plain, 10.0, 12.0)
    assert r.token_times_s == pytest.approx((11.0, 11.25, 11.5, 11.75, 12.0))
    assert r.prefill_s == pytest.approx((10.9, 11.0)) and r.prefill_tokens == 40 and r.output_tokens == 5
    # the server's times longer than the request's window (another clock): they start at its start
    long = Completion("x", 40, 5, 10.0, None, 12.0, (12.0,), "stop", ServerTimings(40, 100.0, 5, 5000.0))
    assert request_of(long, 10.0, 12.0).prefill_s == pytest.approx((10.0, 10.0))
    # a streamed answer keeps its own token times
    streamed = Completion("x", 40, 2, 10.0, 11.0, 12.0, (11.0, 12.0), "stop", ServerTimings(40, 100.0, 2, 1000.0))
    assert request_of(streamed, 10.0, 12.0).token_times_s == (11.0, 12.0)


def test_prices_include_the_static_power_a_token_holds_the_server_for():
    """The fit prices a token by the bins' whole energy: on a server that draws 100 W of static power, spends
    20 µs and 0.002 J of dynamic energy per prompt token and 2 ms and 0.05 J per output token, a prompt token
    costs 0.004 J and an output token 0.25 J, so it weighs 0.016 of one (by its dynamic energy alone it
    would weigh 0.04, and a class of short requests would be charged for less than the time it holds the
    server)."""
    import numpy as np

    from ipw.metering.split import PriceFit

    rng = np.random.default_rng(7)
    prefill = rng.integers(0, 3000, 200).astype(float) * (rng.random(200) < 0.4)
    decode = rng.integers(5, 60, 200).astype(float)
    seconds = 20e-6 * prefill + 2e-3 * decode
    energy = 100.0 * seconds + 0.002 * prefill + 0.05 * decode
    fit = PriceFit()
    fit.add(seconds, prefill, decode, energy * (1 + 0.01 * rng.standard_normal(200)))
    pricing = fit.pricing()
    assert pricing.fitted
    assert pricing.prefill_j == pytest.approx(0.004, rel=0.05) and pricing.decode_j == pytest.approx(0.25, rel=0.05)
    assert pricing.prefill_weight == pytest.approx(0.016, rel=0.05)
