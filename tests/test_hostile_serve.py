"""Hardening, round 5 (issue 55): ``ipw serve`` against hostile clients, upstreams and kills.  Real parts
throughout: the openai stub (tests/openai_stub.py) and small HTTP servers on 127.0.0.1 as upstreams, a real
``ipw serve`` subprocess where a kill or a start-up refusal is the case."""

from __future__ import annotations

import http.client
import json
import os
import sys
from pathlib import Path


from ipw.serve import ServeOptions, start
from openai_stub import Stub

ROOT = Path(__file__).resolve().parents[1]
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
