"""The `openai` backend against a real HTTP server on 127.0.0.1 that injects faults.

The server is the standard library's ``http.server`` in a thread: it streams SSE like an
OpenAI-compatible endpoint, and a script of actions makes it answer 429/500/503, malformed streams,
empty answers or nothing at all.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from ipw.backends.base import BackendSpec, GenerationSettings, QueryError, create_backend
from ipw.errors import IpwError
from ipw.telemetry.base import SensorBase

WORDS = ["The", " answer", " is", " 5", "."]


class FakeEndpoint:
    """``script``: actions for the next requests (``ok`` once it is empty)."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.usage = True
        self.chunk_delay_s = 0.01
        self.required_key: str | None = None
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):
                status = 401 if endpoint.required_key and not endpoint.authorized(self) else 200
                endpoint.send_json(self, status, {"object": "list", "data": [{"id": "fake"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with endpoint.lock:
                    endpoint.requests.append({"path": self.path, "body": body,
                                              "auth": self.headers.get("Authorization"), "t": time.monotonic()})
                    action = endpoint.script.pop(0) if endpoint.script else "ok"
                endpoint.respond(self, action, body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that gave up (timeout tests)
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def authorized(self, handler) -> bool:
        return handler.headers.get("Authorization") == f"Bearer {self.required_key}"

    @staticmethod
    def send_json(handler, status: int, data: dict, headers: dict | None = None) -> None:
        raw = json.dumps(data).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            handler.send_header(k, v)
        handler.end_headers()
        handler.wfile.write(raw)

    def respond(self, h, action: str, body: dict) -> None:
        if action in ("429", "500", "503"):
            # the error body echoes the Authorization header: the backend must scrub it
            self.send_json(h, int(action), {"error": {"message": f"busy; you sent {h.headers.get('Authorization')}"}},
                           {"Retry-After": "0"} if action == "429" else None)
            return
        if action == "slow":
            time.sleep(3.0)
        if action.startswith("trickle"):  # one byte every 0.25 s, never a newline: each resets a read timeout
            self.trickle(h, headers=action == "trickle-headers")
            return
        chat = h.path.endswith("/chat/completions")
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()

        def event(data) -> None:
            h.wfile.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())
            h.wfile.flush()

        if action == "malformed":
            event('{"choices": [{"delta": {"content": "The"')
            return
        if action == "truncated":  # the connection ends mid-answer, without [DONE]
            event({"choices": [{"index": 0, "delta": {"content": "The"}, "finish_reason": None}]})
            return
        words = [] if action == "empty" else WORDS[: body.get("max_tokens", 99)]
        for _i, word in enumerate(words):
            time.sleep(self.chunk_delay_s)
            piece = {"delta": {"content": word}} if chat else {"text": word}
            event({"choices": [{"index": 0, **piece, "finish_reason": None}]})
        event({"choices": [{"index": 0, "delta": {} if chat else {"text": ""}, "finish_reason": "stop"}]})
        if self.usage and body.get("stream_options", {}).get("include_usage"):
            event({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": len(words) * 2,
                                            "total_tokens": 17 + len(words) * 2}})
        event("[DONE]")

    @staticmethod
    def trickle(h, headers: bool) -> None:
        """Trickle a header line (``headers``) or, after complete headers, an event stream, for up to 20 s."""
        out = h.wfile
        out.write(b"HTTP/1.1 200 OK\r\n")
        if not headers:
            out.write(b"Content-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: ")
        out.flush()
        try:
            for _ in range(80):
                out.write(b"X-Slow: " if headers else b" ")
                out.flush()
                time.sleep(0.25)
        except OSError:
            pass  # the client gave up

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    ep = FakeEndpoint()
    yield ep
    ep.close()


def backend_for(url: str, **options):
    spec = BackendSpec("fake", "openai", "fake-model", options={"base_url": url, "retry_backoff_s": 0.01, **options})
    backend = create_backend(spec)
    backend.load()
    return backend


SETTINGS = GenerationSettings(max_tokens=16, temperature=0.0, top_p=0.9, top_k=7, repeat_penalty=1.0, seed=3)


def test_streaming_ttft_tokens_usage_and_settings(endpoint):
    backend = backend_for(endpoint.base_url)
    c = backend.generate("What is 2 + 3?", SETTINGS)
    assert c.text == "The answer is 5."
    assert c.prompt_tokens == 17 and c.completion_tokens == 10  # from the usage chunk
    assert len(c.token_times_s) == 5 and list(c.token_times_s) == sorted(c.token_times_s)
    assert 0 < c.ttft_s <= c.latency_s and c.first_token_s == c.token_times_s[0]
    assert c.finish_reason == "stop"
    (req,) = endpoint.requests
    assert req["path"] == "/v1/chat/completions"
    body = req["body"]
    assert body["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]
    # every generation setting is sent explicitly
    assert {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "repeat_penalty", "seed")} == {
        "max_tokens": 16, "temperature": 0.0, "top_p": 0.9, "top_k": 7, "repeat_penalty": 1.0, "seed": 3}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert backend.describe()["request_params"]["repeat_penalty"] == 1.0


def test_tokens_counted_when_no_usage(endpoint):
    endpoint.usage = False
    c = backend_for(endpoint.base_url).generate("q", SETTINGS)
    assert c.completion_tokens == 5 and c.prompt_tokens == 0


def test_completions_api_uses_few_shot_prompt(endpoint):
    backend = backend_for(endpoint.base_url, api="completions", sampling_extensions=False)
    assert backend.generate("What is 2 + 3?", SETTINGS).text == "The answer is 5."
    body = endpoint.requests[0]["body"]
    assert endpoint.requests[0]["path"] == "/v1/completions"
    assert body["prompt"].startswith("Question: ") and body["prompt"].endswith("Question: What is 2 + 3?\nAnswer:")
    assert "\n\n" in body["stop"]
    assert "top_k" not in body and "repeat_penalty" not in body  # for endpoints that reject them


def test_retries_on_429_and_5xx_then_success(endpoint):
    endpoint.script = ["429", "500", "503"]
    c = backend_for(endpoint.base_url, max_retries=3).generate("q", SETTINGS)
    assert c.text == "The answer is 5." and len(endpoint.requests) == 4
    # the window (and TTFT) starts at the first attempt: the user waited through the retries
    assert c.start_s <= endpoint.requests[0]["t"]


@pytest.mark.parametrize("script,category", [
    (["503"] * 3, "http_5xx"),
    (["429"] * 3, "http_429"),
    (["malformed"], "malformed_stream"),
    (["empty"], "empty_answer"),
    (["slow"], "timeout"),
])
def test_failures_have_categories(endpoint, script, category):
    endpoint.script = list(script)
    backend = backend_for(endpoint.base_url, max_retries=2, timeout_s=1.0)
    with pytest.raises(QueryError) as info:
        backend.generate("q", SETTINGS)
    assert info.value.category == category


def test_truncated_stream_is_retried_as_a_connection_error(endpoint):
    endpoint.script = ["truncated"]
    c = backend_for(endpoint.base_url, max_retries=1).generate("q", SETTINGS)
    assert c.text == "The answer is 5." and len(endpoint.requests) == 2
    endpoint.script = ["truncated", "truncated"]
    with pytest.raises(QueryError) as info:
        backend_for(endpoint.base_url, max_retries=1).generate("q", SETTINGS)
    assert info.value.category == "connection"


@pytest.mark.parametrize("action", ["trickle", "trickle-headers"])
def test_a_trickling_server_is_cut_at_the_total_deadline(endpoint, action):
    """A byte every 0.25 s and never a newline, in the stream or in the headers: each byte resets the read
    timeout, so only the request's total deadline (timeout_s) ends it (before: at the server's leisure)."""
    endpoint.script = [action]
    backend = backend_for(endpoint.base_url, max_retries=0, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(QueryError) as info:
        backend.generate("q", SETTINGS)
    took = time.monotonic() - t0
    assert info.value.category == "timeout" and "total deadline" in str(info.value)
    assert 1.9 <= took < 4.0, took


def test_an_endless_stream_line_is_cut_at_the_line_limit(endpoint, monkeypatch):
    """A stream line is read up to MAX_LINE_BYTES, not whole (bounded memory)."""
    from ipw.backends import openai_wire

    monkeypatch.setattr(openai_wire, "MAX_LINE_BYTES", 10)
    endpoint.script = ["trickle"]
    endpoint.trickle = staticmethod(lambda h, headers: (h.wfile.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n" + b"x" * 1000), None))
    with pytest.raises(QueryError) as info:
        backend_for(endpoint.base_url, max_retries=0, timeout_s=5.0).generate("q", SETTINGS)
    assert info.value.category == "malformed_stream" and "longer than 10 bytes" in str(info.value)


def test_connection_refused_is_a_connection_error(endpoint):
    url = endpoint.base_url
    endpoint.close()
    with pytest.raises(QueryError) as info:
        backend_for(url, max_retries=1).generate("q", SETTINGS)
    assert info.value.category == "connection"


def test_config_errors():
    from ipw.inputs.config import parse_config

    base = 'dataset = "ipw-core"\n[[backends]]\nname = "x"\nkind = "openai"\nmodel = "m"\n'
    with pytest.raises(IpwError, match="needs base_url"):
        create_backend(parse_config(base, "t.toml").backends[0])
    with pytest.raises(IpwError, match="api must be one of"):
        create_backend(parse_config(base + 'base_url = "http://h/v1"\napi = "x"\n', "t.toml").backends[0])
    with pytest.raises(IpwError, match=r"t.toml:6: field 'backends\[0\].concurrency': expected int"):
        parse_config(base + 'concurrency = "4"\n', "t.toml")
    with pytest.raises(IpwError, match="server must be one of"):
        create_backend(parse_config(base.replace('"m"', '"smollm2-135m"') + 'server = "tgi"\n', "t.toml").backends[0])


def test_missing_key_variable_and_rejected_key(endpoint, monkeypatch):
    monkeypatch.delenv("IPW_TEST_NO_SUCH_KEY", raising=False)
    with pytest.raises(IpwError, match="IPW_TEST_NO_SUCH_KEY"):
        backend_for(endpoint.base_url, api_key_env="IPW_TEST_NO_SUCH_KEY")
    endpoint.required_key = "right"
    monkeypatch.setenv("IPW_TEST_KEY", "wrong")
    with pytest.raises(IpwError, match="HTTP 401"):
        backend_for(endpoint.base_url, api_key_env="IPW_TEST_KEY")


# -- through the runner ---------------------------------------------------------------------------


def write_config(path: Path, dataset: Path, url: str, **options) -> Path:
    opts = "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    path.write_text(f'dataset = "{dataset}"\nout_dir = "{path.parent / "res"}"\nwarmup = 1\nidle_s = 0.0\n'
                    '[generation]\nmax_tokens = 8\n'
                    f'[[backends]]\nname = "api"\nkind = "openai"\nmodel = "fake-model"\nrole = "cloud"\n'
                    f'base_url = "{url}"\nretry_backoff_s = 0.01\nmax_retries = 1\n{opts}')
    return path


def only_run(out: Path) -> Path:
    (run_dir,) = list(out.iterdir())
    return run_dir


def test_api_key_never_reaches_the_run_folder(endpoint, small_jsonl, tmp_path, monkeypatch, run_cli):
    secret = "sk-ipw-test-5f1c9e0a7b3d4e2f"
    monkeypatch.setenv("IPW_TEST_API_KEY", secret)
    endpoint.required_key = secret
    # warm-up ok, then a 500 whose body echoes the Authorization header (scrubbed), a retry, ...
    endpoint.script = ["ok", "500", "500", "ok", "malformed"]
    cfg = write_config(tmp_path / "api.toml", small_jsonl, endpoint.base_url, api_key_env="IPW_TEST_API_KEY")
    out = tmp_path / "res"
    code, stdout, err = run_cli("run", cfg, "--out", out)
    assert code == 0, err
    assert all(r["auth"] == f"Bearer {secret}" for r in endpoint.requests)  # the key was used
    run_dir = only_run(out)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"manifest.json", "records.jsonl", "records.parquet"}
    for p in files:
        assert secret.encode() not in p.read_bytes(), p
        assert secret[3:15].encode() not in p.read_bytes(), p
    assert secret not in stdout + err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config"]["backends"][0]["options"]["api_key_env"] == "IPW_TEST_API_KEY"
    assert manifest["backends"][0]["api_key_sent"] is True
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert frame["error_category"].fillna("").tolist() == ["http_5xx", "", "malformed_stream", ""]
    assert "***" in frame["error"][0]


def test_failed_queries_become_error_records(endpoint, small_jsonl, tmp_path, run_cli):
    endpoint.script = ["ok", "empty", "slow", "ok", "429", "429"]
    cfg = write_config(tmp_path / "api.toml", small_jsonl, endpoint.base_url, timeout_s=1.0)
    out = tmp_path / "res"
    code, _, err = run_cli("run", cfg, "--out", out)
    assert code == 0, err
    run_dir = only_run(out)
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "complete"
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert frame["error_category"].fillna("").tolist() == ["empty_answer", "timeout", "", "http_429"]
    assert list(frame["correct"])[::3] == [0.0, 0.0]
    ok = frame[frame["error"].isna()].iloc[0]
    assert ok["ttft_s"] > 0 and ok["completion_tokens"] == 10 and ok["prompt_tokens"] == 17


def test_remote_endpoint_energy_is_an_api_estimate(endpoint, small_jsonl, tmp_path, run_cli):
    from ipw.telemetry.api_estimate import ApiEnergyEstimate

    table = ApiEnergyEstimate.load()
    cfg = write_config(tmp_path / "api.toml", small_jsonl, endpoint.base_url, remote=True)
    out = tmp_path / "res"
    code, _, err = run_cli("run", cfg, "--out", out, "--limit", "2")
    assert code == 0, err
    run_dir = only_run(out)
    frame = pd.read_parquet(run_dir / "records.parquet")
    assert set(frame["energy_quality"]) == {"estimated"}
    assert set(frame["energy_source"]) == {"estimate.api"}
    assert set(frame["energy_scope"]) == {"datacenter_estimate"}
    expected = 10 * table.per_output_token_wh.central * 3600  # 10 completion tokens in the usage chunk
    assert frame["energy_j"].tolist() == pytest.approx([expected, expected])
    parts = json.loads(frame["energy_parts"][0])
    assert [p["source"] for p in parts] == ["estimate.api"]  # no local sensor mixed in
    sensors = json.loads((run_dir / "manifest.json").read_text())["backends"][0]["sensors"]
    assert [s["source"] for s in sensors] == ["estimate.api"]
    assert sensors[0]["params"]["sources"]  # cited


def test_api_energy_table_is_cited_and_ordered():
    from ipw.telemetry.api_estimate import ApiEnergyEstimate

    table = ApiEnergyEstimate.load()
    for src in table.sources:
        assert src["citation"] and src["date"] and src["value"]
    assert table.range_j(10, ok=True).low < table.range_j(10, ok=True).high
    assert table.range_j(10, ok=False).central == 0.0


class RateSensor(SensorBase):
    """A fake sensor of constant power (so energy = power × time): checks how energy is split."""

    name = "rate"

    def __init__(self, power_w: float = 10.0) -> None:
        self.power_w = power_w
        self.windows: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def info(self):
        from ipw.telemetry.base import SensorInfo

        return SensorInfo("rate", True, "test.rate", "measured", "gpu", ("dev0",))

    def begin(self, t_s=None):
        return time.monotonic() if t_s is None else t_s

    def end(self, t0, t_s=None):
        from ipw.telemetry.base import EnergyReading

        t1 = time.monotonic() if t_s is None else t_s
        with self.lock:
            self.windows.append((t0, t1))
        return [EnergyReading("dev0", self.power_w * (t1 - t0), "test.rate", "measured", "gpu", t1 - t0)]

    def close(self):
        pass


def test_concurrency_overlaps_windows_keeps_order_and_splits_energy(endpoint, tmp_path):
    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    endpoint.chunk_delay_s = 0.05
    rows = [{"id": f"q{i}", "prompt": f"What is {i} + 0?", "answer": str(i), "scorer": "numeric"} for i in range(8)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path / "api.toml", data, endpoint.base_url, concurrency=4)
    config = load_config(str(cfg))
    folder, queries = start_run(config, command=["test"])
    sensor = RateSensor()
    execute(folder, config, queries, lambda r: None, probe=lambda backend: [sensor])
    frame = pd.read_parquet(folder.path / "records.parquet")
    assert list(frame["query_id"]) == [f"q{i}" for i in range(8)]  # query order
    assert frame["error"].isna().all()
    # each record has its own window, and they overlap (several requests in flight)
    starts, ends = frame["start_s"].tolist(), frame["end_s"].tolist()
    assert all(s < e for s, e in zip(starts, ends))
    overlaps = sum(1 for i in range(8) for j in range(8) if i < j and starts[j] < ends[i] and starts[i] < ends[j])
    assert overlaps >= 4
    in_flight = max(sum(s <= t < e for s, e in zip(starts, ends)) for t in starts)
    assert 2 <= in_flight <= 4
    # the sensor windows (segments) never overlap, and the records' parts sum to what was measured
    segs = sorted(sensor.windows)
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(segs, segs[1:]))
    measured = sum(sensor.power_w * (t1 - t0) for t0, t1 in sensor.windows)
    level = json.loads((folder.path / "manifest.json").read_text())["backends"][0]["levels"][0]["energy"]["dev0"]
    assert level["span_j"] == pytest.approx(measured, rel=1e-6)  # windows with no request in flight included
    assert frame["energy_j"].sum() + level["unattributed_j"] == pytest.approx(measured, rel=1e-6)
    # and each record's share is less than the energy of its whole (overlapped) window
    assert (frame["energy_j"] < sensor.power_w * (frame["end_s"] - frame["start_s"]) + 1e-9).all()
    assert (frame["energy_j"] > 0).all()


class _Discard(list):
    """A list that keeps nothing (the fake endpoint's and sensor's logs would grow with the requests)."""

    def append(self, item) -> None:
        pass


def test_long_concurrent_run_keeps_memory_flat(endpoint, tmp_path, monkeypatch):
    """What the runner holds while 8 requests are in flight does not grow with the number of queries:
    each accounting period's slices and requests are dropped once it is split and its records are taken,
    so memory is bounded by one period's requests (here periods of 0.2 s; a level's are 30 s). Python heap
    (tracemalloc) after 200 and after 1,200 records; before the fix it grew by ~2 KB a query. The
    5,335-query run against a real llama.cpp server is in docs/RELIABILITY.md."""
    import ipw.running.runner

    monkeypatch.setattr(ipw.running.runner, "RUN_PERIOD_S", 0.2)
    import tracemalloc

    from ipw.inputs.config import load_config
    from ipw.running.runner import execute
    from runfolders import start_run

    endpoint.chunk_delay_s = 0.0
    endpoint.requests = _Discard()
    n = 1200
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"What is {i} + 0?", "answer": str(i),
                                        "scorer": "numeric"}) + "\n" for i in range(n)))
    config = load_config(str(write_config(tmp_path / "api.toml", data, endpoint.base_url, concurrency=8)))
    folder, queries = start_run(config, command=["test"])
    sensor = RateSensor()
    sensor.windows = _Discard()
    heap: dict[int, int] = {}

    def progress(record) -> None:
        heap[len(heap) + 1] = tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        execute(folder, config, queries, progress, probe=lambda backend: [sensor])
    finally:
        tracemalloc.stop()
    assert len(heap) == n
    growth = heap[n] - heap[200]
    assert growth < 200 * 1024, f"the heap grew by {growth / 1024:.0f} KiB over {n - 200} queries"
    frame = pd.read_parquet(folder.path / "records.parquet")
    assert frame["error"].isna().all() and len(frame) == n


# -- concurrency levels and llama-server's timings --------------------------------------------------


def test_concurrency_levels():
    from ipw.backends.openai_http import concurrency_levels

    assert concurrency_levels(1) == (1,) and concurrency_levels(4) == (4,)
    assert concurrency_levels([16, 1, 4, 4]) == (1, 4, 16)
    for bad in (0, -2, [], [1, 0], [1, "4"], True, [True], 2.5, "4", None):
        with pytest.raises(IpwError, match=r"backend 'srv': field 'concurrency'"):
            concurrency_levels(bad, "srv")


def test_concurrency_as_a_list_in_a_config(endpoint):
    from ipw.inputs.config import parse_config

    base = ('dataset = "ipw-core"\n[[backends]]\nname = "x"\nkind = "openai"\nmodel = "m"\n'
            f'base_url = "{endpoint.base_url}"\n')
    backend = create_backend(parse_config(base + "concurrency = [16, 1, 4]\n", "t.toml").backends[0])
    assert backend.levels == (1, 4, 16) and backend.concurrency == 1
    assert backend.describe()["concurrency_levels"] == [1, 4, 16]
    assert create_backend(parse_config(base + "concurrency = 3\n", "t.toml").backends[0]).levels == (3,)
    with pytest.raises(IpwError, match=r"backend 'x': field 'concurrency': each level must be an integer from 1 to 10000, got 0"):
        create_backend(parse_config(base + "concurrency = [1, 0]\n", "t.toml").backends[0])
    with pytest.raises(IpwError, match="n_gpu_layers applies to server = \"llama-server\" only"):
        create_backend(parse_config(base.replace(f'base_url = "{endpoint.base_url}"\n', 'server = "llama-cpp"\n')
                                    .replace('"m"', '"smollm2-135m"') + "n_gpu_layers = 99\n", "t.toml").backends[0])
    with pytest.raises(IpwError, match="dtype, gpu_memory_utilization apply to server = \"vllm\" only"):
        create_backend(parse_config(base + "dtype = \"bfloat16\"\ngpu_memory_utilization = 0.5\n", "t.toml").backends[0])


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("mode", ["ok", "json"])
def test_llama_server_timings_are_read(api, mode):
    """The chunks as llama-server streams them (recorded from the real binary: usage and ``timings`` in
    the last chunk before [DONE]), and its JSON body: ``timings`` becomes Completion.server_timings."""
    from openai_stub import TIMINGS, Stub

    from ipw.backends.base import ServerTimings

    stub = Stub()
    try:
        stub.llama_server = True
        stub.modes = [mode]
        c = backend_for(stub.base_url, api=api).generate("What is 6 * 7?", SETTINGS)
        assert c.text == "42" and c.finish_reason == "length"
        assert c.server_timings == ServerTimings(prompt_n=31, prompt_ms=12.5, predicted_n=1, predicted_ms=0.001)
        assert c.prompt_tokens == TIMINGS["prompt_n"] and c.completion_tokens == TIMINGS["predicted_n"]  # usage
        assert stub.bodies[-1]["stream_options"] == {"include_usage": True}
        # a server that sends no timings: none recorded (the plain stub streams chat deltas only)
        stub.llama_server = False
        stub.modes = [mode]
        if api == "chat" or mode == "json":
            assert backend_for(stub.base_url, api=api).generate("q", SETTINGS).server_timings is None
    finally:
        stub.close()


def test_llama_server_stream_without_usage_has_timings_on_the_finish_chunk():
    from openai_stub import llama_server_events

    from ipw.backends.openai_wire import server_timings

    events = llama_server_events(chat=True, include_usage=False)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert server_timings(events[-1]["timings"]).prompt_n == 31
    assert all("timings" not in e for e in events[:-1])
    events = llama_server_events(chat=True, include_usage=True)
    assert events[-1]["choices"] == [] and "usage" in events[-1] and "timings" in events[-1]


def test_server_timings_parsing():
    from ipw.backends.base import ServerTimings
    from ipw.backends.openai_wire import server_timings

    full = {"cache_n": 0, "prompt_n": 38, "prompt_ms": 113.7, "predicted_n": 6, "predicted_ms": 91.9}
    assert server_timings(full) == ServerTimings(38, 113.7, 6, 91.9)
    assert server_timings({**full, "prompt_ms": 0}) == ServerTimings(38, 0.0, 6, 91.9)
    for bad in (None, [], "x", {k: v for k, v in full.items() if k != "predicted_ms"}, {**full, "prompt_n": "38"},
                {**full, "predicted_n": True}):
        assert server_timings(bad) is None


def test_an_answer_of_the_wrong_shape_is_read_as_no_text_and_no_count():
    """What an answer holds is taken only where it has the expected shape: a choice, delta or message that is not
    an object, text that is not a string, a token count that is not a whole number from 0 to MAX_TOKEN_COUNT
    (1e30, "9", -1, 2.5, True) and server timings with such counts are read as absent, never as an error later."""
    from ipw.backends.openai_wire import MAX_TOKEN_COUNT, choice_text, server_timings, token_count

    assert [choice_text(c, "chat") for c in ("x", {"delta": "abc"}, {"delta": {"content": 5}}, {"message": [1]},
                                             {"delta": {"content": "ok"}})] == ["", "", "", "", "ok"]
    assert [choice_text(c, "completions") for c in ({"text": 5}, {"text": "ok"}, None)] == ["", "ok", ""]
    assert [token_count(v) for v in (1e30, "9", -1, 2.5, True, None, 7, 7.0, MAX_TOKEN_COUNT)] == \
        [None, None, None, None, None, None, 7, 7, MAX_TOKEN_COUNT]
    good = {"prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 4.0}
    assert server_timings(good) is not None
    for key, bad in (("prompt_n", 1e30), ("predicted_n", -2), ("prompt_ms", float("nan")), ("predicted_ms", 1e12)):
        assert server_timings({**good, key: bad}) is None, key
