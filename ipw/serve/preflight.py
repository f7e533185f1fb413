"""What ``ipw serve`` checks before it serves, each refusal one line (exit 2) and no run folder left: the
listening socket, an upstream that is the proxy itself or that nothing answers at, a ``--resume`` of
another proxy's folder; and the run folder, new or resumed."""

from __future__ import annotations

import errno
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ipw import __version__
from ipw.errors import IpwError
from ipw.results import RunFolder, RunManifest, new_run_id
from ipw.sanitize import redact_url, scrub
from ipw.serve.handler import Handler
from ipw.serve.options import ServeOptions, Upstream
from ipw.serve.shell import ProxyServer


def listen(host: str, port: int) -> ProxyServer:
    """The proxy's listening socket (not serving yet), or one line naming --host or --port (exit 2)."""
    try:
        return ProxyServer((host, port), Handler)
    except socket.gaierror as exc:
        raise IpwError(f"--host {host!r}: not a name or address of this machine ({exc.strerror})") from None
    except OverflowError:  # a port the socket module refuses (checked earlier by the command)
        raise IpwError(f"--port {port}: must be 0 (a free port) to 65535") from None
    except (TypeError, ValueError) as exc:  # a NUL in the name
        raise IpwError(f"--host {host!r}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise IpwError(f"--host {host!r}: not an address of this machine ({exc.strerror})") from None
        raise IpwError(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def refuse_self(upstream: Upstream, host: str, port: int) -> None:
    """An IpwError when ``upstream`` is the proxy's own address (``host``:``port``, where it listens): each
    request would be forwarded to itself."""
    import ipaddress

    import psutil

    if upstream.port != port:
        return
    try:
        targets = {ai[4][0] for ai in socket.getaddrinfo(upstream.host, port, socket.AF_INET, socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return  # a name that does not resolve here is not this machine
    if host in ("", "0.0.0.0"):  # every address of this machine
        mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
        looped = any(ipaddress.ip_address(t).is_loopback or t in mine for t in targets)
    else:
        try:
            bound = {ai[4][0] for ai in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            return
        looped = bool(targets & bound)
    if looped:
        raise IpwError(f"--upstream {upstream.url}: that is this proxy's own address ({host or '0.0.0.0'}:{port}), "
                       "so every request would be forwarded to itself; give the server to forward to")


#: how long the start waits for an upstream to accept a connection (a hosted API across the world: well under this)
CONNECT_PROBE_S = 10.0


def refuse_unreachable(upstream: Upstream, option: str) -> None:
    """An IpwError naming ``option`` when nothing accepts a connection at ``upstream``'s address (a port nobody
    listens on, a name that does not resolve): every request would fail, so the proxy does not start."""
    try:
        socket.create_connection((upstream.host, upstream.port), timeout=CONNECT_PROBE_S).close()
    except (OSError, UnicodeError) as exc:
        why = (exc.strerror if isinstance(exc, OSError) else None) or type(exc).__name__
        raise IpwError(f"{option} {upstream.url}: nothing accepts a connection there ({why}); start the server "
                       "first, or give the address where it listens") from None


def abandon(folder: RunFolder, sensors: list[Any], backend: Any, reason: str) -> None:
    for sensor in sensors:
        sensor.close()
    if backend is not None:
        backend.close()
    folder.finish("failed", reason=scrub(reason))


def check_resume(manifest: RunManifest, options: ServeOptions, resume: str | Path) -> None:
    """``--resume`` of a serve folder with the routing, upstream and name it was made with (else two backends' or
    routings' records would mix in one run under one name): an IpwError naming both values."""
    made = (manifest.config or {}).get("serve")
    if not isinstance(made, dict):
        raise IpwError(f"{resume}: not a folder of ipw serve (resume a run with ipw run --resume)")
    check_resume_route(made, options, resume)

    def upstream(url: Any) -> str:
        if not url:
            return "--backend (a server ipw starts)"
        try:
            return f"--upstream {Upstream.parse(str(url)).url}"
        except IpwError:
            return f"--upstream {redact_url(str(url))}"

    then, now = upstream(made.get("upstream")), upstream(options.upstream)
    if then != now:
        raise IpwError(f"--resume {resume}: the folder was made with {then}, not {now}: resume it with the same "
                       "upstream, or start a new folder")
    if made.get("name") != options.name:
        raise IpwError(f"--resume {resume}: the folder's records are named {made.get('name')!r}, not "
                       f"{options.name!r} (--name): resume it with --name {made.get('name')!r}, or start a new folder")


def check_resume_route(made: dict[str, Any], options: ServeOptions, resume: str | Path) -> None:
    """``--resume`` of a ``--route`` folder with the router (its content: its SHA-256, or its path in folders
    written before the digest) and the cloud it was made with, and of a folder without --route without one."""
    then = str(made.get("route") or "")
    if bool(then) != bool(options.route):
        was = f"with --route {then}" if then else "without --route"
        now = f"with --route {options.route}" if options.route else "without --route"
        raise IpwError(f"--resume {resume}: the folder was made {was}, not {now}: resume it as it was made, or start "
                       "a new folder")
    if not then:
        return
    digest = str(made.get("route_sha256") or "")
    if (digest != options.route_sha256) if digest else Path(then).resolve() != Path(options.route).resolve():
        def router(path: str, sha: str) -> str:
            return f"{path}" + (f" (sha256 {sha[:12]})" if sha else "")

        raise IpwError(f"--resume {resume}: the folder was made with the router {router(then, digest)}, not "
                       f"{router(options.route, options.route_sha256)}: resume it with the router it was made with, "
                       "or start a new folder")

    def cloud(url: Any) -> str:
        try:
            return Upstream.parse(str(url)).url
        except IpwError:
            return redact_url(str(url))

    if cloud(made.get("cloud_upstream")) != cloud(options.cloud_upstream):
        raise IpwError(f"--resume {resume}: the folder was made with --cloud {cloud(made.get('cloud_upstream'))}, not "
                       f"--cloud {cloud(options.cloud_upstream)}: resume it with the same cloud, or start a new folder")


def new_folder(options: ServeOptions, out_dir: str | Path, resume: str | Path | None,
            command: list[str] | None) -> RunFolder:
    """A new run folder, or the one ``--resume`` names (a serve folder that did not finish)."""
    from ipw.telemetry.hardware import node_identity

    config = {"source": "ipw serve", "serve": asdict(options)}
    if resume is not None:  # checked (check_resume) by the caller
        folder = RunFolder.reopen(resume)
        folder.write_manifest(status="running", resumed_at=(folder.manifest.resumed_at or [])
                              + [time.strftime("%Y-%m-%dT%H:%M:%S")])
        return folder
    identity, hardware = node_identity()
    run_id = new_run_id()
    return RunFolder.create(out_dir, run_id, RunManifest(
        run_id=run_id, ipw_version=__version__, command=[scrub(a) for a in (command if command is not None else sys.argv)],
        config=config, dataset={"name": "ipw serve", "n_queries": 0, "fingerprint": "sha256:" + "0" * 16},
        hardware=hardware, hardware_by_id={identity.hardware_id: hardware},
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S"), backends=[]))
