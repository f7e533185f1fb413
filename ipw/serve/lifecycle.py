"""A proxy's life: ``start`` (the managed server, the sensors and their idle baseline, the run folder, then the
socket) and ``Proxy.stop`` (the requests in flight, the meter's span, the energy audit, the run folder finished)."""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, cast

from ipw.backends.base import BackendSpec
from ipw.errors import IpwError
from ipw.metering.meter import SWITCH_INTERVAL_S, Meter
from ipw.metering.window import IdleBaseline, Window, measure_idle
from ipw.results import BackendEntry, RunManifest
from ipw.sanitize import read_key, register
from ipw.serve.options import MAX_ERROR_BODY, METERED, ServeOptions, Upstream
from ipw.serve.preflight import abandon, check_resume, listen, new_folder, refuse_self, refuse_unreachable
from ipw.serve.session import Session
from ipw.serve.shell import ProxyServer


@dataclass
class Proxy:
    """A running proxy (``start``): its URL, and ``stop`` to finish the run folder."""

    server: ProxyServer
    session: Session
    backend: Any  # a managed upstream server (an OpenAIBackend), or None
    sensors: list[Any]
    thread: threading.Thread
    started_s: float
    switch_interval_s: float = 0.005  # the interpreter's, restored at stop

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{cast(str, host)}:{port}/v1"  # an IP server's address: (host, port, ...)

    def stop(self, grace_s: float = 30.0, status: str = "complete", reason: str | None = None) -> dict[str, Any]:
        """Stop accepting, let the requests in flight finish (at most ``grace_s``), end the meter's span
        and finish the run folder; returns the session's manifest line."""
        self.server.shutdown()
        self.server.server_close()
        sys.setswitchinterval(self.switch_interval_s)
        deadline = time.monotonic() + grace_s
        while self.session.meter.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.session.meter.in_flight()
        energy = self.session.meter.close()  # every ended request settled: its record is with the writer
        session = self.session
        session.writer.close()
        session.pending_log.close()  # empty now: finish removes it
        folder = session.folder
        try:
            entry = folder.manifest.entries()[0]  # written at start
            # before the power trace and the sensors' close: the audit's read of the counter past the end is in both
            audit = self._energy_audit(max(1, len(entry.sessions or ())))
            for sensor in self.sensors:
                if sensor.supports_trace:
                    folder.add_power(session.spec.name, sensor.trace())
            line = {
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - (time.monotonic() - self.started_s))),
                "start_s": session.meter.started_s, "end_s": session.meter.ended_s,
                "wall_s": round(time.monotonic() - self.started_s, 3), "requests": session.requests,
                "energy_split": session.options.energy_split, "split_methods": dict(session.split_methods),
                "pricing": asdict(session.meter.pricing()),
                "errors": session.errors, "in_flight_peak": session.meter.in_flight_peak,
                "unfinished_at_stop": left, "energy": energy, "idle_baseline": asdict(session.idle),
                "sampler_overhead": {s.name: s.overhead() for s in self.sensors},
                "meter_cost": {k: round(v, 4) for k, v in session.meter.cost.items()},
                **({"routing": session.routing_line()} if session.router is not None else {}),
                **({"energy_audit": audit} if audit else {}),
            }
            entry = dataclasses.replace(entry, sessions=(*(entry.sessions or ())[:-1], line))  # the last is this one
            folder.write_manifest(backends=[entry.to_json()], dataset=_dataset(session))
            folder.finish(status, **({"reason": reason} if reason else {}))
        finally:
            if session.otel is not None:
                session.otel.close()  # the last export, bounded (otel.SHUTDOWN_S), once the folder is finished
            for sensor in self.sensors:
                sensor.close()
            if self.backend is not None:
                self.backend.close()
        return line

    def _energy_audit(self, n: int) -> list[dict[str, Any]]:
        """The session's energy audit (``ipw.telemetry.audit``; ``ipw run`` has one per backend and level): the
        counter over the span of this session's requests (both routes' with --route: they share the meter) vs
        their energies plus the idle between them, its lines "in session N"; [] without an NVML sensor."""
        from ipw.telemetry.audit import audit_dicts

        session = self.session
        if not any(s.supports_energy_windows for s in self.sensors):
            return []
        try:
            records = [r for name in dict.fromkeys(spec.name for spec in session.specs.values())
                       for r in session.folder.records_of(name)]
        except Exception as exc:  # the audit never costs the session
            return [{"error": f"{type(exc).__name__}: {exc}"}]
        return audit_dicts(self.sensors, records, since_s=session.meter.started_s, scope=f"in session {n}")



def is_llama_server(upstream: Upstream, key: str | None) -> bool:
    """Whether the upstream is llama.cpp's server (its /v1/models says ``owned_by: llamacpp``)."""
    conn = upstream.connection(10.0)
    try:
        conn.request("GET", f"{upstream.prefix}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        resp = conn.getresponse()
        data = json.loads(resp.read(MAX_ERROR_BODY)) if resp.status == 200 else {}
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()
    models = data.get("data") if isinstance(data, dict) else None
    return any(isinstance(m, dict) and m.get("owned_by") == "llamacpp" for m in models or [])


def _dataset(session: Session) -> dict[str, Any]:
    """The run's "dataset": the distinct prompts its clients sent (by query id), so that two runs of the
    same client workload have the same fingerprint and ``ipw check`` pairs them."""
    digest = hashlib.sha256("\n".join(sorted(session.queries)).encode()).hexdigest()[:16]
    return {"name": "ipw serve", "n_queries": len(session.queries), "fingerprint": "sha256:" + digest,
            "categories": sorted(METERED.values())}


def managed_backend(kind_model: str, name: str | None, n_threads: int | None, n_gpu_layers: int | None,
                    parallel: int, n_ctx: int | None) -> Any:
    """``--backend SERVER:MODEL``: an OpenAIBackend whose managed server ipw starts (and stops)."""
    from ipw.backends.base import create_backend
    from ipw.backends.servers import SERVER_KINDS

    kind, sep, model = kind_model.partition(":")
    if not sep or kind not in SERVER_KINDS or not model:
        raise IpwError(f"--backend {kind_model!r}: expected SERVER:MODEL with SERVER one of {', '.join(SERVER_KINDS)}"
                       " (e.g. llama-server:smollm2-135m)")
    options: dict[str, Any] = {"server": kind, "concurrency": parallel}
    for key, value in (("n_threads", n_threads), ("n_gpu_layers", n_gpu_layers), ("n_ctx", n_ctx)):
        if value is not None:
            options[key] = value
    backend = create_backend(BackendSpec(name=name or f"{kind}:{Path(model).stem}", kind="openai", model=model,
                                         options=options))
    backend.preflight()
    return backend


def start(options: ServeOptions, out_dir: str | Path, *, token: str | None = None, backend: Any = None,
          upstream_pids: list[int] | None = None, resume: str | Path | None = None, command: list[str] | None = None,
          notice: Callable[[str], None] = lambda line: None, probe: Callable[..., list[Any]] | None = None,
          router: Any = None) -> Proxy:
    """Start the proxy: the managed server (``backend``) if any, the sensors and their idle baseline,
    the run folder (new, or ``resume``'s), then the listening socket.  Returns once it accepts requests."""
    from ipw.backends.openai_http import listening_pids
    from ipw.telemetry.cpu_model import CpuModelSensor
    from ipw.telemetry.hardware import node_identity, software_fingerprint
    from ipw.telemetry.probe import probe_sensors

    if options.route and router is None:  # a bad router file: one line, before the socket and the folder
        from ipw.analysis.router import load_router

        router = load_router(options.route)
    if options.route:  # what --resume of the folder compares (a router retrained at the same path is another one)
        options = dataclasses.replace(options, route_sha256=hashlib.sha256(Path(options.route).read_bytes()).hexdigest())
    key = read_key(options.api_key_env, options.name) if options.api_key_env else None
    if token is not None:  # the clients' token is a secret too: scrubbed from every text ipw writes
        register(token)
    from ipw.export import otel

    otel.check()  # OTEL_EXPORTER_OTLP_ENDPOINT: its settings and the extra (exit 2), before the socket and the folder
    server = listen(options.host, options.port)  # before the run folder: a refusal leaves none
    try:
        if resume is not None:  # before the folder is touched
            check_resume(RunManifest.read_unfinished(resume), options, resume)
        if backend is None:
            refuse_self(Upstream.parse(options.upstream), options.host, server.server_address[1])
            refuse_unreachable(Upstream.parse(options.upstream), "--local" if options.route else "--upstream")
        if options.route:
            refuse_self(Upstream.parse(options.cloud_upstream), options.host, server.server_address[1])
            refuse_unreachable(Upstream.parse(options.cloud_upstream), "--cloud")
        if probe is None:  # the BMC that IPW_NODE_POWER names answers with power data (as ipw run checks it)
            from ipw.telemetry.node_power import check_configured

            check_configured()
        folder = new_folder(options, out_dir, resume, command)
    except BaseException:
        server.server_close()
        raise
    sensors: list[Any] = []
    try:
        if backend is not None:
            backend.attach(folder.path)
            backend.load()
            options = dataclasses.replace(options, upstream=backend.base_url, model=options.model or backend.spec.model)
        upstream = Upstream.parse(options.upstream)
        cloud = Upstream.parse(options.cloud_upstream) if options.route else None
        if backend is not None:
            pids_fn = backend.pids
        else:
            found = upstream_pids if upstream_pids is not None else (
                [] if upstream.remote else listening_pids(upstream.port))
            if cloud is not None and upstream_pids is None and not cloud.remote:  # --route: both servers' work
                found = [*found, *(p for p in listening_pids(cloud.port) if p not in found)]
            pids_fn = lambda: list(found)  # noqa: E731 - a one-line local helper
        sensors = (probe or probe_sensors)(pids_fn, remote=upstream.remote)
        if any(isinstance(s, CpuModelSensor) for s in sensors) and not pids_fn():
            raise IpwError(f"--upstream {upstream.url}: no process of this user listens on port {upstream.port}, so "
                           "the CPU model (this machine has no RAPL) cannot see its work; give --upstream-pid PID")
        estimate = None
        if upstream.remote:
            from ipw.telemetry.api_estimate import ApiEnergyEstimate

            estimate = ApiEnergyEstimate.load(None)
        window = Window(sensors)
        idle = measure_idle(window, options.idle_s) if options.idle_s > 0 and sensors else IdleBaseline({}, {}, 0.0)
        llama = ((backend.server_kind == "llama-server") if backend is not None
                 else is_llama_server(upstream, None if options.route else key))  # --route: the key is the cloud's
        # tokens are timed as they pass, and llama-server reports each prefill at the first token
        meter = Meter(window, split=options.energy_split, live_tokens=True, expect_prefill=llama, idle_w=idle.power_w)
        session = Session(folder, options, upstream, meter, idle, estimate, key, token, notice, llama,
                          router=router, cloud=cloud)
        identity, hardware = node_identity()
        earlier = folder.manifest.entries()  # a resumed folder's sessions
        details = {"upstream": upstream.url, "remote": upstream.remote, "llama_server_timings": llama,
                   **({"managed": backend.describe()} if backend is not None else {"upstream_pids": pids_fn()}),
                   **({"route": {"router": options.route, "cloud_upstream": cloud.url, "cloud_name": options.cloud_name,
                                 "local_name": options.name}} if cloud is not None else {})}
        entry = BackendEntry(
            options.name, "serve", session.spec.model, options.role, details=details,
            sensors=tuple(asdict(s.info()) for s in sensors) + ((asdict(estimate.info()),) if estimate else ()),
            idle_baseline=asdict(idle),
            sessions=(*((earlier[0].sessions or ()) if earlier else ()), {"status": "serving"}))
        folder.write_manifest(backends=[entry.to_json()], hardware_by_id={**(folder.manifest.hardware_by_id or {}),
                                                                identity.hardware_id: hardware},
                              software=folder.manifest.software or software_fingerprint())
        server.session = session
    except BaseException as exc:
        server.server_close()
        abandon(folder, sensors, backend, f"{type(exc).__name__}: {exc}")
        raise
    meter.open()
    switch_interval_s = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # a streamed token waits less for the interpreter lock
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="ipw-serve", daemon=True)
    thread.start()
    return Proxy(server, session, backend, sensors, thread, time.monotonic(), switch_interval_s)
