"""What one GET /metrics costs a running ipw serve (run from the repository root, with /tmp/ipw-0630c0c made by
``git archive 0630c0c``): 200 requests through it at 4 in flight, then 100 scrapes (the proxy's CPU per scrape),
then 5 s idle (its CPU per second with nothing to do)."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "bench/serving")
from serve_cpu import cpu_s, free_port, load
from serve_metrics_cost import get, start_proxy

port = free_port()
fake = subprocess.Popen([sys.executable, "bench/serving/serve_cpu.py", "--upstream", str(port), "16", "0.001"],
                        stdout=subprocess.PIPE, text=True)
assert fake.stdout is not None and fake.stdout.readline().strip() == "ready"
proc, url = start_proxy(Path("/tmp/ipw-0630c0c"), f"http://127.0.0.1:{port}/v1", fake.pid, tempfile.mkdtemp(), [],
                        dict(os.environ))
metrics = url.removesuffix("/v1") + "/metrics"
load(url, 4, 200, iter(range(10**6)))
time.sleep(2)
before, t0 = cpu_s(proc.pid), time.perf_counter()
for _ in range(100):
    get(metrics)
print("per scrape: proxy CPU ms", (cpu_s(proc.pid) - before) * 10, "wall ms", (time.perf_counter() - t0) * 10)
before = cpu_s(proc.pid)
time.sleep(5)
print("idle: proxy CPU ms per s", (cpu_s(proc.pid) - before) * 200)
proc.terminate()
proc.wait()
fake.kill()
