"""``ipw serve``: a measuring OpenAI-compatible proxy.  Clients (an app, an agent, a load generator)
talk to it as to any OpenAI endpoint; it forwards ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` to an upstream server, meters this machine's devices with the sensors of ``ipw run``
while requests are in flight, and hands each response its own energy (``usage.energy``), split from
overlapping requests' as under ``ipw run``'s concurrent load (``ipw.metering.meter.Meter``).  Every request
becomes a record of a run folder that ``compare``, ``report`` and ``check`` read.

Standard library only (``http.server`` threads, ``http.client`` upstream): a stream passes through
event by event, unbuffered; only its last usage event waits for the sensors to cover the request's end.

One module a job, each importing only those above it:

- ``options``: what it was asked (``ServeOptions``), the upstream's address (``Upstream``), the API's paths;
- ``request``: one request from its body to its record (query id, routing text, ``Ended``, ``usage.energy``);
- ``session``: the meter, the run folder and the records (``Session``);
- ``clients``, ``shell``: client connections and their deadlines; the server and the handler's base;
- ``exchange``: one metered exchange (forward, relay, record); ``handler``: the routes;
- ``preflight``: the checks before it serves, and the run folder; ``lifecycle``: ``start`` and ``Proxy.stop``.

The OpenAI wire format (events, choice text, usage, timings, deadlines) is ``ipw.backends.openai_wire``,
shared with the HTTP backend.
"""

from ipw.serve.lifecycle import Proxy, managed_backend, start
from ipw.serve.options import ServeOptions, Upstream

__all__ = ["Proxy", "ServeOptions", "Upstream", "managed_backend", "start"]
