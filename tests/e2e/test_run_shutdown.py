"""A run whose managed server dies mid-run ends, and leaves nothing running (issue 55, "a run that never exits").

On the H200 a vLLM server killed (SIGKILL) mid-run left its engine core behind: a process it forked, in its
process group, that ignores SIGTERM and holds every descriptor the server had when it forked, the listening
socket among them.  The port then still accepted connections that nobody would ever answer: each request
ipw sent there waited for its whole ``timeout_s`` (300 s in configs/gpu-vllm.toml), and the request threads
went on taking the next queries until the runner reached the failed one, so a run took a multiple of
``timeout_s`` to end, past the device call's limit, and wrote a timeout error for each of those queries.

Here a stand-in for vLLM's OpenAI server (a real HTTP server in a real process, started by ipw as a managed
``server = "vllm"`` through the backend's ``python`` option) does the same on the CPU: it binds its port,
forks an "engine core" that ignores SIGTERM and SIGINT and keeps every descriptor, answers slowly, and kills
itself (SIGKILL) right after its sixth answer while other requests are in flight (those that
finished in the same moment may have their answers too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from processes import gone

IPW = [sys.executable, "-m", "ipw.cli"]
ROOT = Path(__file__).resolve().parents[2]

#: The stand-in.  Any other use of this "python" (ipw asks it for vLLM's version) runs the real interpreter.
FAKE_VLLM = '''
import json, os, signal, socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if sys.argv[1:3] != ["-m", "vllm.entrypoints.openai.api_server"]:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
args = sys.argv[3:]
port, alias = int(args[args.index("--port") + 1]), args[args.index("--served-model-name") + 1]
DIE_AFTER = 6  # answers; the request threads keep 4 in flight, so others are mid-answer at the kill
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))
sock.listen(64)  # bound before the engine starts, as vLLM's server does: the fork inherits it
engine = os.fork()
if engine == 0:  # the "engine core": same process group, every descriptor kept, SIGTERM and SIGINT ignored
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        time.sleep(60)
with open(PID_FILE, "a") as fh:
    fh.write(f"{os.getpid()} {engine}\\n")
answered, lock = 0, threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write((fmt % args) + "\\n")
        sys.stderr.flush()

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": alias, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        global answered
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for word in ("one", " two", " three", " four"):
            chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
            self.wfile.flush()
            time.sleep(0.3)
        self.wfile.write(b"data: [DONE]\\n\\n")
        self.wfile.flush()
        with lock:
            answered += 1
            if answered == DIE_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)


server = ThreadingHTTPServer(("127.0.0.1", port), Handler, bind_and_activate=False)
server.socket.close()
server.socket = sock
server.serve_forever()
'''


def _setup(tmp_path: Path, n: int) -> tuple[Path, Path]:
    """The stand-in as a backend's ``python``, a model folder it "serves", n queries, and the config: 4 in
    flight, the GPU config's request timeout (300 s)."""
    pid_file = tmp_path / "pids.txt"
    fake = tmp_path / "fake-python"
    fake.write_text(f"#!{sys.executable}\nPID_FILE = {str(pid_file)!r}\n{FAKE_VLLM}")
    fake.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i:02d}", "prompt": f"What is {i} + 1?", "answer": str(i + 1),
                                        "scorer": "numeric"}) + "\n" for i in range(n)))
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'dataset = "{data}"\nout_dir = "{tmp_path / "res"}"\nwarmup = 0\nidle_s = 0\n'
                   '[generation]\nmax_tokens = 16\n'
                   f'[[backends]]\nname = "fake-vllm"\nkind = "openai"\nmodel = "{model}"\nrole = "cloud"\n'
                   f'server = "vllm"\npython = "{fake}"\nconcurrency = 4\ntimeout_s = 300.0\n'
                   'server_timeout_s = 120.0\n')
    return cfg, pid_file


def test_a_run_whose_server_dies_with_an_engine_left_behind_ends_and_leaves_nothing(tmp_path):
    n = 24
    cfg, pid_file = _setup(tmp_path, n)
    # stdout and stderr are pipes, as a device call's are: communicate() returns once nothing holds them
    proc = subprocess.Popen(IPW + ["run", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    t0 = time.monotonic()
    try:
        # far below the 2 x 300 s the old code took, far above what the run takes on a loaded machine
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"ipw run had not ended {time.monotonic() - t0:.0f} s after its start: {err[-3000:]}") from None
    took_s = time.monotonic() - t0
    (run_dir,) = [p.parent for p in (tmp_path / "res").glob("*/manifest.json")]
    server_pid, engine_pid = map(int, pid_file.read_text().split())

    assert proc.returncode == 1, err[-3000:]  # a stopped backend: the run failed, --resume continues it
    lines = [line for line in err.splitlines() if "exited mid-run" in line]
    assert len(lines) == 1 and lines[0].startswith(
        "backend stopped: backend 'fake-vllm': the vLLM server exited mid-run (SIGKILL (signal 9)"), err[-3000:]
    assert "Traceback" not in err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "ipw run --resume" in manifest["reason"]
    # every record is an answer: no query was sent to the dead server's port to wait for its timeout
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert [r["error"] for r in records] == [None] * len(records), [r["error"] for r in records]
    assert 4 <= len(records) < n and {r["output"] for r in records} == {"one two three four"}
    assert all(r["end_s"] - r["start_s"] < 60 for r in records)
    # the server and the engine it left are gone (the engine ignored SIGTERM), and soon: not after a timeout
    assert gone(server_pid) and gone(engine_pid)
    assert took_s < 200, f"{took_s:.0f} s"

    # --resume runs the queries left against a new server (which again dies after six answers)
    pid_file.unlink()
    resumed = subprocess.run(IPW + ["run", "--resume", str(run_dir)], capture_output=True, text=True, cwd=ROOT,
                             timeout=240)
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert all(r["error"] is None for r in records) and len({r["query_id"] for r in records}) == len(records)
    assert len(records) >= 8 and {r["output"] for r in records} == {"one two three four"}
    assert all(gone(int(pid)) for pid in pid_file.read_text().split())


def test_the_exit_watchdog_ends_the_process_when_its_report_cannot_be_written():
    """The console script's exit watchdog (``ipw.cli.entry``) ends a process whose exit is held (here by a
    thread that never ends) even when its report cannot be written: stderr is a pipe nobody reads, full, and
    the thread that filled it holds it locked in a write that never returns.  The report was written on the
    watchdog's own thread, which then never reached its exit."""
    script = ("import sys, threading\n"
              "def flood():\n"
              "    while True:\n"
              "        sys.stderr.write('x' * 65536)\n"
              "        sys.stderr.flush()\n"
              "threading.Thread(target=flood, name='flood').start()\n"
              "from ipw.cli import entry\n"
              "sys.argv = ['ipw', '--version']\n"
              "entry()\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "IPW_EXIT_GRACE_S": "1"})
    try:
        code = proc.wait(timeout=120)  # stdout and stderr are not read until it has exited
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    assert code == 0, "the process did not end: the watchdog's report blocked its exit"
