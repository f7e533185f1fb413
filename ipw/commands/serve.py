"""``ipw serve`` and ``ipw wrap``: the measuring proxy, on its own or around a client command."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from ipw.commands.output import sigterm_as_interrupt, stdout
from ipw.errors import IpwError
from ipw.options import ProxyOptions, ServeOnly, WrapOnly
from ipw.sanitize import is_secret_env


def proxy_options(proxy: ProxyOptions, port: int, serve: ServeOnly | None = None):
    """The proxy's options (``ipw.serve.ServeOptions``) and its managed server (None: an upstream), checked before
    anything starts (the bounds, choices and pairings of ``ipw.options`` are checked already). ``serve``: ``ipw
    serve``'s own options (a router between two upstreams)."""
    from ipw.limits import check_name
    from ipw.serve import ServeOptions, Upstream, managed_backend

    upstream, name = proxy.upstream, proxy.name
    router = route = cloud = None
    if serve is not None and serve.route is not None:  # --route ROUTER --local URL --cloud URL
        from ipw.analysis.router import load_router

        route, cloud = serve.route, serve.cloud
        assert serve.local is not None and cloud is not None  # --route requires both (ipw.options)
        router = load_router(route)
        if len(router.local) != 1:
            raise IpwError(f"{route}: the router chooses among {len(router.local)} local backends "
                           f"({', '.join(router.local)}); ipw serve --route forwards to one --local upstream")
        Upstream.parse(cloud)
        upstream = serve.local
        name = name or router.local[0]
    elif (upstream is None) == (proxy.backend is None):
        raise IpwError("give --upstream URL (a running OpenAI-compatible server) or --backend SERVER:MODEL "
                       "(a server ipw starts), one of them")
    if proxy.token is not None and len(proxy.token) < 8:
        raise IpwError("--token: use at least 8 characters")
    if proxy.energy_wait and not proxy.energy_in_response:
        raise IpwError("--energy-wait holds answers for an energy that --no-energy-in-response leaves out: give one")
    managed = None
    if upstream is not None:
        parsed = Upstream.parse(upstream)
        default_name = f"serve:{parsed.host}:{parsed.port}"
    else:
        assert proxy.backend is not None  # one of --upstream, --backend: checked above
        managed = managed_backend(proxy.backend, name, proxy.n_threads, proxy.n_gpu_layers, proxy.parallel,
                                  proxy.n_ctx)
        default_name = managed.spec.name
    name = check_name(name, "--name") if name is not None else None  # as a config's backend name is checked
    options = ServeOptions(upstream=upstream or "", name=name or default_name, host=proxy.host, port=port,
                           api_key_env=proxy.api_key_env, token_required=proxy.token is not None,
                           log_prompts=proxy.log_prompts, max_body_bytes=int(proxy.max_body_mb * (1 << 20)),
                           timeout_s=proxy.timeout_s, idle_s=proxy.idle_s, role=proxy.role,
                           energy_in_response=proxy.energy_in_response, energy_wait=proxy.energy_wait,
                           energy_split=proxy.energy_split, metrics=proxy.metrics,
                           **({"route": str(route), "cloud_upstream": cloud or "", "cloud_name": router.cloud}
                              if router is not None else {}))
    return options, managed


def _summary(proxy: Any, line: dict[str, Any], console: Console) -> None:
    from rich.table import Table

    session = proxy.session
    spans = line["energy"]
    table = Table(title=f"ipw serve: {session.spec.name}"
                  + (f" or {session.specs['cloud'].name} (--route)" if session.router is not None else ""))
    for col in ("requests", "errors", "in flight (peak)", "energy (J)", "J/request", "unattributed (J)", "quality"):
        table.add_column(col)
    unattributed = [row.get("unattributed_j") for row in spans.values()]
    table.add_row(str(session.requests), str(session.errors), str(line["in_flight_peak"]),
                  f"{session.energy_j:.4g}", f"{session.energy_j / session.requests:.4g}" if session.requests else "n/a",
                  "n/a" if not unattributed or None in unattributed else f"{sum(unattributed):.4g}",
                  ", ".join(sorted(session.energy_quality)) or "n/a")
    console.print(table)
    routing = line.get("routing")
    if routing:
        saved = routing["saved_vs_cloud_only"]
        console.print(
            f"routing ({routing['router']}): {routing['local']['requests']} requests to {routing['local']['backend']} "
            f"(local), {routing['cloud']['requests']} to {routing['cloud']['backend']} (cloud; "
            f"{routing['unscored_to_cloud']} the router could not score); routing {routing['routing_ms_per_request']} "
            "ms/request; energy saved vs all to the cloud: "
            + ("n/a (needs energy of requests on both routes)" if saved is None else
               f"{saved['saved_j']:.4g} J (local measured {saved['local_measured_j']:.4g} J against "
               f"{saved['cloud_counterfactual_j']:.4g} J estimated from the cloud's measured J/token)"),
            highlight=False, markup=False, soft_wrap=True)
    console.print(f"run folder: {session.folder.path}  (ipw compare / ipw report / ipw check read it)")


def _audit_lines(proxy: Any, line: dict[str, Any], console: Console) -> None:
    """The session's energy audit lines that disagree beyond their uncertainty or miss the ±0.3% target
    (``ipw.telemetry.audit.flagged_lines``, as ``ipw run`` prints its own), one line each."""
    from ipw.telemetry.audit import flagged_lines

    for text in flagged_lines(proxy.session.spec.name, line.get("energy_audit")):
        console.print(text, highlight=False, markup=False, soft_wrap=True)


def _start(options, managed, given: ProxyOptions, resume: Path | None, console: Console):
    from ipw.backends.openai_http import is_loopback
    from ipw.serve import start

    token = given.token
    proxy = start(options, given.out or Path("results"), token=token, backend=managed,
                  upstream_pids=list(given.upstream_pid) or None, resume=resume,
                  notice=lambda text: console.print(text, highlight=False, markup=False, soft_wrap=True))
    if token is None and not is_loopback(options.host):  # once it listens (a --host it cannot use is refused)
        console.print(f"ipw serve: warning: listening on {options.host} without --token: anyone who reaches port "
                      f"{proxy.server.server_address[1]} can use the upstream (and its key)", highlight=False,
                      markup=False)
    return proxy


def serve_command(given: ProxyOptions, serve: ServeOnly) -> int:
    options, managed = proxy_options(given, serve.port, serve)
    console = Console(stderr=True)
    sigterm_as_interrupt()
    proxy = _start(options, managed, given, serve.resume, console)
    try:  # from here on a SIGTERM (or Ctrl-C), even as soon as the first line is out, finishes the folder
        target = proxy.session.upstream.url + (f" or {proxy.session.cloud.url} (--route {options.route})"
                                               if proxy.session.cloud is not None else "")
        console.print(f"ipw serve: {proxy.url} -> {target}; run folder {proxy.session.folder.path}. "
                      "Ctrl-C (or SIGTERM) stops it and finishes the folder.", highlight=False, markup=False,
                      soft_wrap=True)
        shown = -1
        while True:
            time.sleep(0.5)
            s = proxy.session
            if s.requests != shown and int(time.monotonic()) % 10 == 0:
                shown = s.requests
                console.print(f"ipw serve: {s.requests} requests ({s.errors} errors), {s.meter.in_flight()} in flight, "
                              f"{s.energy_j:.4g} J", highlight=False, markup=False, soft_wrap=True)
    except KeyboardInterrupt:
        console.print("ipw serve: stopping (requests in flight may finish)", highlight=False, markup=False, soft_wrap=True)
    line = proxy.stop()
    _summary(proxy, line, stdout())
    _audit_lines(proxy, line, console)
    return 0


def wrap_command(command: list[str], given: ProxyOptions, wrap: WrapOnly) -> int:
    """Run ``command`` with OPENAI_BASE_URL (and OPENAI_API_BASE) pointing at the proxy; its exit code."""
    options, managed = proxy_options(given, wrap.port)
    if not command:
        raise IpwError("ipw wrap: give the command to run after --, e.g. ipw wrap --upstream URL -- python client.py")
    if shutil.which(command[0]) is None:  # before the proxy and its run folder: a typo leaves no folder
        why = "not an executable file" if os.sep in command[0] else "not found on PATH"
        raise IpwError(f"ipw wrap: cannot run {command[0]!r} ({why})")
    console = Console(stderr=True)
    proxy = _start(options, managed, given, None, console)
    token = given.token
    # the child gets no upstream key: not the variable --api-key-env names, nor any config's api_key_env
    env = {k: v for k, v in os.environ.items() if k != options.api_key_env and not is_secret_env(k, v)}
    env.update(OPENAI_BASE_URL=proxy.url, OPENAI_API_BASE=proxy.url)
    if token is not None:
        env["OPENAI_API_KEY"] = token
    else:
        env.setdefault("OPENAI_API_KEY", "ipw-wrap")  # clients that insist on a key; the proxy ignores it
    console.print(f"ipw wrap: {' '.join(command)}  (OPENAI_BASE_URL={proxy.url})", highlight=False, markup=False, soft_wrap=True)
    code = 0
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:  # found, but it does not start (a bad interpreter line, ...): no request was made
        proxy.stop(status="failed", reason=f"the command could not start: {exc.strerror}")
        if not proxy.session.requests:
            shutil.rmtree(proxy.session.folder.path, ignore_errors=True)
        raise IpwError(f"ipw wrap: cannot run {command[0]!r} ({exc.strerror})") from None
    code, stopped, killed = _wait_child(child, console)
    reason = (f"the command was killed: {killed}" if killed
              else None if code == 0 else f"the command exited with {code}")
    line = proxy.stop(status="complete" if code == 0 and not stopped else "interrupted", reason=reason)
    _summary(proxy, line, stdout())
    _audit_lines(proxy, line, console)
    return code if code >= 0 else 128 - code


#: after SIGTERM or Ctrl-C, how long ``ipw wrap`` waits for its command to exit before it kills it (SIGKILL)
WRAP_GRACE_S = 10.0


class _Terminated(Exception):
    """SIGTERM reached ``ipw wrap``."""


def _wait_child(child: subprocess.Popen, console: Console) -> tuple[int, bool, str | None]:
    """Wait for ``ipw wrap``'s command: its exit code, whether SIGTERM stopped it, and why it was killed (if it was).
    SIGTERM to ipw goes to the command too (Ctrl-C reaches it by itself: same process group); a command that
    has not exited ``WRAP_GRACE_S`` later, or at a second SIGTERM or Ctrl-C, is killed, so that ipw always
    finishes the run folder."""
    def terminated(signum, frame):
        raise _Terminated

    signal.signal(signal.SIGTERM, terminated)
    stops, stopped = 0, False
    killed: str | None = None
    deadline: float | None = None
    while True:
        try:
            try:
                code = child.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                # the folder is finished next (bounded by the proxy's grace): a later SIGTERM does not cut it short
                signal.signal(signal.SIGTERM, lambda signum, frame: None)
                return code, stopped, killed
            except subprocess.TimeoutExpired:
                console.print(f"ipw wrap: the command has not exited {WRAP_GRACE_S:g} s after it was stopped: killing it",
                              highlight=False, markup=False, soft_wrap=True)
                child.kill()
                killed, deadline = f"it had not exited {WRAP_GRACE_S:g} s after it was stopped", None
        except (KeyboardInterrupt, _Terminated) as exc:
            stops += 1
            if isinstance(exc, _Terminated):
                stopped = True
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            if child.poll() is not None:
                continue
            if stops == 1:
                deadline = time.monotonic() + WRAP_GRACE_S
                console.print(f"ipw wrap: stopping: waiting up to {WRAP_GRACE_S:g} s for the command to exit "
                              "(again: kill it now)", highlight=False, markup=False, soft_wrap=True)
            else:
                child.kill()
                killed, deadline = "ipw was stopped a second time", None
