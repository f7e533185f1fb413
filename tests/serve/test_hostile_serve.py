"""Hardening, round 5 (issue 55): ``ipw serve`` against hostile clients, upstreams and kills.  Real parts
throughout: the openai stub (tests/openai_stub.py) and small HTTP servers on 127.0.0.1 as upstreams, a real
``ipw serve`` subprocess where a kill or a start-up refusal is the case."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ipw.serve import ServeOptions, start
from openai_stub import Stub
from test_node_power import authed_emulator  # noqa: F401 - a fixture: sushy-emulator behind basic authentication

ROOT = Path(__file__).resolve().parents[2]
IPW = [sys.executable, "-m", "ipw.cli"]


def _recording(stub: Stub) -> list[tuple[str, str, str | None]]:
    """Every request ``stub`` gets, as (method, path, Authorization header): the start-up probe's GET too."""
    seen: list[tuple[str, str, str | None]] = []

    class Recording(stub.server.RequestHandlerClass):  # type: ignore[name-defined]
        def parse_request(self):
            ok = super().parse_request()
            if ok:
                seen.append((self.command, self.path, self.headers.get("Authorization")))
            return ok

    stub.server.RequestHandlerClass = Recording
    return seen


def _proxy(tmp_path, upstream: str, **options):
    """An in-process proxy in front of ``upstream`` (this process's work is the upstream's)."""
    opts = ServeOptions(upstream=upstream, name=options.pop("name", "stub"), port=0, idle_s=0.0, **options)
    return start(opts, tmp_path / "out", upstream_pids=[os.getpid()], command=["test"])


def _post(proxy_url: str, body: dict, path: str = "/completions") -> tuple[int, bytes]:
    from urllib.parse import urlsplit

    u = urlsplit(proxy_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", u.path + path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# -- 1. each upstream gets only its own credential ----------------------------------------------------------

def test_route_sends_the_cloud_key_to_the_cloud_only(tmp_path, monkeypatch):
    """``--route --api-key-env VAR``: the key is the cloud's.  The local upstream never sees it: not on a routed
    request, not on /v1/models, not on the start-up probe."""
    from test_router import trained

    _, router = trained(tmp_path)
    key = "sk-CLOUDonly7Qz2Lp0WdQv"
    monkeypatch.setenv("IPW_TEST_CLOUD_KEY", key)
    local, cloud = Stub(), Stub()
    local_seen, cloud_seen = _recording(local), _recording(cloud)
    opts = ServeOptions(upstream=local.base_url, name="small", port=0, idle_s=0.2, route=str(router),
                        cloud_upstream=cloud.base_url, cloud_name="big", api_key_env="IPW_TEST_CLOUD_KEY")
    proxy = start(opts, tmp_path / "out", upstream_pids=[os.getpid()], command=["test"])
    try:
        assert _post(proxy.url, {"prompt": "Question 1: easy apple river stone?", "stream": True})[0] == 200
        assert _post(proxy.url, {"prompt": "Question 2: apple river stone music?", "stream": True})[0] == 200
        host, port = proxy.server.server_address[:2]
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proxy.stop()
        local.close()
        cloud.close()
    assert [m for m, _, _ in local_seen].count("POST") == 1 and any(m == "GET" for m, _, _ in local_seen)
    assert all(auth is None for _, _, auth in local_seen), local_seen  # the probe, the request, /v1/models
    assert [auth for m, _, auth in cloud_seen if m == "POST"] == [f"Bearer {key}"], cloud_seen


# -- 2. an answered request is on disk when its answer leaves -----------------------------------------------

def _serve(tmp_path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    """A real ``ipw serve`` subprocess: it, its URL and its run folder, once it accepts requests."""
    proc = subprocess.Popen([*IPW, "serve", "--port", "0", "--idle-s", "0.2", "--upstream-pid", str(os.getpid()),
                             "--out", str(tmp_path / "out"), *args], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    lines: list[str] = []
    while not lines or "run folder" not in lines[-1]:  # a note may come first (a stale lock taken over)
        lines.append(proc.stderr.readline())
        assert lines[-1], lines
    match = re.search(r"(http://127\.0\.0\.1:\d+/v1) -> .*run folder (\S+)\.", lines[-1])
    assert match, lines
    return proc, match.group(1), Path(match.group(2))


def _ask_stream(url: str, prompt: str) -> dict:
    """One streamed completion through the proxy, read to its end: its usage.energy."""
    status, body = _post(url, {"prompt": prompt, "stream": True, "max_tokens": 2})
    assert status == 200, body
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    return next(e["usage"]["energy"] for e in events if (e.get("usage") or {}).get("energy"))


@pytest.mark.parametrize("n,after_s", [(12, 0.0), (5, 0.05)], ids=["12-at-once", "5-after-50ms"])
def test_a_kill_right_after_the_answers_loses_no_answered_request(tmp_path, n, after_s):
    """SIGKILL right after the last answer: every answered request is in the folder (those whose energy had not
    settled with their provisional energy, labelled estimated and provisional, never measured); ``--resume``
    takes them into records.jsonl once, and the finished folder holds each request once."""
    from ipw.results import load_run, read_log
    from ipw.serve.request import prompt_digest

    stub = Stub()
    stub.llama_server = True
    procs = []
    try:
        proc, url, folder = _serve(tmp_path, "--upstream", stub.base_url)
        procs.append(proc)
        prompts = [f"question {i}" for i in range(n)]
        energies = [_ask_stream(url, p) for p in prompts]
        time.sleep(after_s)
        proc.kill()  # SIGKILL: nothing settles or finishes
        proc.wait()
        assert all(e["provisional"] is True for e in energies)
        rows = read_log(folder)
        want = {prompt_digest({"prompt": p})[0] for p in prompts}
        assert sorted(r["query_id"] for r in rows) == sorted(want), "every answered request is in the folder"
        for r in rows:  # not settled before the kill: labelled so (here the CPU model's settled values are estimated too)
            if r["energy_source"].startswith("provisional:"):
                assert r["energy_quality"] == "estimated" and r["energy_j"] == r["provisional_energy_j"]
                assert all(p["quality"] == "estimated" for p in json.loads(r["energy_parts"]))
        _, frame = load_run(folder)  # what compare reads from a killed folder
        assert len(frame) == n
        proc, url, again = _serve(tmp_path, "--upstream", stub.base_url, "--resume", str(folder))
        procs.append(proc)
        assert again == folder
        _ask_stream(url, "one more")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stub.close()
    manifest, frame = load_run(folder)
    assert manifest.status == "complete" and len(frame) == n + 1
    assert not frame.duplicated(["backend", "query_id", "repeat"]).any()
    assert len(read_log(folder)) == n + 1 == len((folder / "records.jsonl").read_text().splitlines())


def test_a_folder_read_before_the_energy_settles_shows_each_answered_request_labelled_provisional(tmp_path):
    """While the sensors hold the windows back, the answered requests are in the folder with the provisional
    energy their answers carried, labelled estimated (a ``provisional:`` source), never measured; once settled,
    each request is there once, with its settled energy, and pending.jsonl is gone."""
    from ipw.results import PENDING_FILE, load_run, read_log
    from test_serve import _gated

    stub = Stub()
    held_after = [float("inf")]  # windows that end after this are held back (NVML's buffer not there yet)
    sensor = _gated(lambda part: part.end < held_after[0])
    opts = ServeOptions(upstream=stub.base_url, name="stub", port=0, idle_s=0.0)
    proxy = start(opts, tmp_path / "out", upstream_pids=[os.getpid()], command=["test"],
                  probe=lambda pids, remote=False: [sensor])
    folder = proxy.session.folder.path
    ask = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        stub.modes = ["json"] * 4
        assert _post(proxy.url, ask, "/chat/completions")[0] == 200  # settled: a power for the provisional values
        deadline = time.monotonic() + 30
        while not (folder / "records.jsonl").read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        held_after[0] = time.monotonic()
        answers = [_post(proxy.url, ask, "/chat/completions") for _ in range(3)]
        assert [status for status, _ in answers] == [200] * 3
        given = [json.loads(body)["usage"]["energy"] for _, body in answers]
        assert all(e["provisional"] is True and e["energy_j"] > 0 for e in given), given
        rows = read_log(folder)  # what a kill now would leave
        assert len((folder / "records.jsonl").read_text().splitlines()) == 1 and len(rows) == 4
        pending = [r for r in rows if r["repeat"] > 0]
        assert all(r["energy_quality"] == "estimated" and r["energy_source"].startswith("provisional:")
                   for r in pending), pending
        assert [r["energy_j"] for r in pending] == [e["energy_j"] for e in given]
        assert len(load_run(folder)[1]) == 4
    finally:
        held_after[0] = float("inf")
        proxy.stop(grace_s=5)
        stub.close()
    rows = read_log(folder)
    assert len(rows) == 4 and all(r["energy_quality"] == "measured" and r["energy_source"] == "test.gate" for r in rows)
    assert not (folder / PENDING_FILE).exists() and len(load_run(folder)[1]) == 4


# -- 3. a deadline for a client's whole request, not per read ------------------------------------------------

def test_a_client_that_trickles_its_request_is_cut_at_the_request_deadline(tmp_path, monkeypatch):
    """A byte now and then (each within the per-read idle timeout) held a proxy thread for ever: a request's head
    and body get ``CLIENT_REQUEST_S`` from their first byte, whatever the reads.  An idle kept-alive connection
    is the idle timeout's (the deadline starts at a request's first byte)."""
    import socket

    from ipw.serve import clients

    monkeypatch.setattr(clients, "CLIENT_REQUEST_S", 1.0)
    stub = Stub()
    proxy = _proxy(tmp_path, stub.base_url)
    host, port = proxy.server.server_address[:2]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"

    def trickled(first: bytes, rest: bytes) -> float:
        """Seconds until the proxy closes a connection that sends ``first`` then ``rest`` a byte per 0.1 s."""
        sock = socket.create_connection((host, port), timeout=30)
        t0 = time.monotonic()
        try:
            sock.sendall(first)
            for i in range(len(rest)):
                sock.sendall(rest[i:i + 1])
                time.sleep(0.1)
        except OSError:  # closed by the proxy
            pass
        else:
            pytest.fail("the proxy read the whole trickled request")
        finally:
            sock.close()
        return time.monotonic() - t0

    try:
        assert trickled(b"", head + b"X-Slow: " + b"a" * 300) >= 1.0  # the head; 30 s if it were not cut
        assert trickled(head + b"Content-Length: %d\r\n\r\n" % (len(body) + 300), body + b" " * 300) >= 1.0  # the body
        with socket.create_connection((host, port), timeout=30) as sock:  # idle between requests: not cut
            time.sleep(1.5)
            sock.sendall(head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        proxy.stop()
        stub.close()


# -- 4. request ids that tell nothing of the prompt ----------------------------------------------------------

def test_a_request_id_is_unguessable_and_its_settled_energy_is_found_by_it(tmp_path):
    """The id an answer carries (its settled energy's URL) was the prompt's SHA-256 and a repeat count: any client
    could ask whether a prompt had been sent.  Now it is random; the settled energy is found by it alone."""
    from ipw.serve.request import prompt_digest

    stub = Stub()
    proxy = _proxy(tmp_path, stub.base_url)
    host, port = proxy.server.server_address[:2]

    def get(path: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        conn.request("GET", path)
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())
        conn.close()
        return out

    ask = {"messages": [{"role": "user", "content": "a secret question"}]}
    try:
        stub.modes = ["json", "json"]
        ids = [json.loads(_post(proxy.url, ask, "/chat/completions")[1])["usage"]["energy"]["request_id"]
               for _ in range(2)]
        digest = prompt_digest(ask)[0]
        assert len(set(ids)) == 2 and all(digest not in i and len(i) >= 22 for i in ids), ids
        deadline = time.monotonic() + 30
        while get(f"/v1/ipw/energy/{ids[1]}")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, settled = get(f"/v1/ipw/energy/{ids[1]}")
        assert status == 200 and settled["request_id"] == ids[1] and settled["provisional"] is False
        for guess in (f"{digest}/0", f"{digest}/1"):  # what a client could compute from a prompt
            assert get(f"/v1/ipw/energy/{guess}")[0] == 404
    finally:
        proxy.stop()
        stub.close()


# -- 5.-9. refused before anything starts: one line, exit 2, no folder (a resumed one as it was) ------------

def _refused(*args: str, env: dict[str, str] | None = None) -> str:
    """``ipw serve ARGS`` in a subprocess that must exit 2 with one line, before it serves: its stderr."""
    try:
        done = subprocess.run([*IPW, "serve", "--port", "0", *args], capture_output=True, text=True, timeout=60,
                              cwd=ROOT, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"it started serving: {exc.stderr!r}")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_a_timeout_too_long_for_a_socket_is_refused(tmp_path):
    """``--timeout-s 1e300`` started, then every request was dropped (the socket's timeout overflowed)."""
    stub = Stub()
    try:
        for value in ("1e300", "86401"):
            assert "--timeout-s" in _refused("--upstream", stub.base_url, "--timeout-s", value, "--out",
                                             str(tmp_path / "out"))
    finally:
        stub.close()
    assert not (tmp_path / "out").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_upstream_nobody_listens_on_is_refused_before_the_folder(tmp_path):
    """An upstream port nobody listens on left a ``failed`` run folder (found after it was made)."""
    from test_router import trained

    dead = f"http://127.0.0.1:{_free_port()}/v1"
    out = tmp_path / "out"
    assert "--upstream" in _refused("--upstream", dead, "--out", str(out))
    assert "--upstream" in _refused("--upstream", dead, "--upstream-pid", str(os.getpid()), "--out", str(out))
    _, router = trained(tmp_path)
    stub = Stub()
    try:
        assert "--cloud" in _refused("--route", str(router), "--local", stub.base_url, "--cloud", dead, "--out", str(out))
        assert "--local" in _refused("--route", str(router), "--local", dead, "--cloud", stub.base_url, "--out", str(out))
    finally:
        stub.close()
    assert not out.exists()


# -- 7. /health at the descriptor limit; a Content-Length that int() reads but HTTP does not -----------------

def test_health_answers_at_the_descriptor_limit(tmp_path):
    """A proxy out of file descriptors (RLIMIT_NOFILE lowered, every one held by an idle client) left ``/health``
    waiting in the listen queue until idle clients timed out (60 s): out of descriptors, the proxy closes its
    longest-idle client connections (an idle kept-alive connection may be closed at any time) and goes on."""
    import resource
    import socket
    import urllib.request

    limit = 160

    def lowered() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    stub = Stub()
    proc = subprocess.Popen([*IPW, "serve", "--port", "0", "--idle-s", "0", "--upstream", stub.base_url,
                             "--upstream-pid", str(os.getpid()), "--out", str(tmp_path / "out")],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=lowered)
    idle: list[socket.socket] = []
    try:
        line = ""
        while "run folder" not in line:
            line = proc.stderr.readline()
            assert line, "ipw serve ended before it served"
        host, port = re.search(r"http://(127\.0\.0\.1):(\d+)/v1 ->", line).groups()
        for _ in range(limit + 40):  # more than the proxy can hold: the rest wait in its listen queue
            idle.append(socket.create_connection((host, int(port)), timeout=10))
        health = json.loads(urllib.request.urlopen(f"http://{host}:{port}/health", timeout=20).read())
        assert health["status"] == "ok"
        stub.modes = ["json"]
        assert _post(f"http://{host}:{port}/v1", {"messages": [{"role": "user", "content": "hi"}]},
                     "/chat/completions")[0] == 200
    finally:
        for sock in idle:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        stub.close()


def test_a_content_length_of_a_non_ascii_digit_is_a_400(tmp_path):
    """``Content-Length: ³`` (``int()`` reads it as 3, ``isdigit()`` says yes) ended the handler with no answer."""
    import socket

    stub = Stub()
    proxy = _proxy(tmp_path, stub.base_url)
    host, port = proxy.server.server_address[:2]
    try:
        for value in ("³", "²", "¹"):  # a header is read as Latin-1: these are the bytes b3, b2, b9
            with socket.create_connection((host, port), timeout=30) as sock:
                sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {value}\r\n\r\n{{}}"
                             .encode("latin-1"))
                answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 400 ") and b"Content-Length" in answer, (value, answer)
    finally:
        proxy.stop()
        stub.close()
    assert not stub.bodies


# -- 8. a BMC that refuses the credentials ------------------------------------------------------------------

@pytest.mark.skipif(not (Path(sys.executable).parent / "sushy-emulator").exists(),
                    reason="sushy-tools not installed (the dev extra)")
def test_a_bmc_that_refuses_the_credentials_is_refused_before_the_folder(request, tmp_path):
    """``IPW_NODE_POWER`` at a Redfish BMC (sushy-emulator behind basic authentication) that refuses the
    credentials: ``ipw serve`` left a ``failed`` folder; now one line, exit 2, no folder, no password shown."""
    bmc = request.getfixturevalue("authed_emulator")
    stub = Stub()
    try:
        err = _refused("--upstream", stub.base_url, "--out", str(tmp_path / "out"),
                       env={"IPW_NODE_POWER": bmc, "IPW_BMC_USER": "admin",
                            "IPW_BMC_PASSWORD": "wrong-password"})
    finally:
        stub.close()
    assert "refused the credentials (HTTP 401" in err and "wrong-password" not in err, err
    assert not (tmp_path / "out").exists()


# -- 9. --resume of a --route folder with another router or cloud --------------------------------------------

def test_resume_of_a_route_folder_with_another_router_or_cloud_is_refused(tmp_path):
    """``--resume`` of a ``--route`` folder with another router file (or the same path retrained), another
    ``--cloud``, or no ``--route`` at all mixed two routings' records in one run: one line naming both, exit 2,
    the folder as it was."""
    import shutil

    from ipw.cli import main
    from test_router import trained, write_routing_run

    _, router = trained(tmp_path)
    other = tmp_path / "other.json"
    assert main(["route", "train", str(write_routing_run(tmp_path / "b", "other", rule="random", seed=7)),
                 "--out", str(other), "--no-score"]) == 0
    local, cloud, cloud2 = Stub(), Stub(), Stub()
    procs = []
    try:
        proc, _, folder = _serve(tmp_path, "--route", str(router), "--local", local.base_url, "--cloud", cloud.base_url)
        procs.append(proc)
        proc.kill()  # SIGKILL: the folder stays running, to be resumed
        proc.wait()
        before = (folder / "manifest.json").read_text()
        same = ["--route", str(router), "--local", local.base_url]
        moved = tmp_path / "moved.json"
        shutil.copy(router, moved)
        for args, words in (
            (["--route", str(other), "--local", local.base_url, "--cloud", cloud.base_url], ("router", str(other))),
            ([*same, "--cloud", cloud2.base_url], ("--cloud", cloud2.base_url)),
            (["--upstream", local.base_url], ("--route",)),
        ):
            err = _refused(*args, "--resume", str(folder), "--upstream-pid", str(os.getpid()), "--idle-s", "0")
            assert all(w in err for w in words), (args, err)
            assert (folder / "manifest.json").read_text() == before, args  # not resumed, not failed
        shutil.copy(other, router)  # the same path, retrained
        err = _refused(*same, "--cloud", cloud.base_url, "--resume", str(folder), "--upstream-pid", str(os.getpid()))
        assert "router" in err and (folder / "manifest.json").read_text() == before, err
        shutil.copy(moved, router)  # the router it was made with, at its path: resumed
        proc, _, again = _serve(tmp_path, *same, "--cloud", cloud.base_url, "--resume", str(folder))
        procs.append(proc)
        assert again == folder
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for s in (local, cloud, cloud2):
            s.close()
