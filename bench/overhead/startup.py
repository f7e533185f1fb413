"""Start-up time of ``ipw --help`` and ``ipw list`` (target: under 0.5 s, median of >= 5 runs).

Each round runs, one after the other: a bare interpreter (``python -c pass``, the floor), ``ipw --help``
and ``ipw list``, through the installed console script (.venv/bin/ipw), stdout and stderr to
/dev/null; the wall time of each child process is measured from spawn to exit. It also records which
heavy modules each command imports (tests/commands/test_startup.py asserts the same without timing) and the
largest imports of ``ipw list`` (``python -X importtime``).

    .venv/bin/python bench/overhead/startup.py                 # 9 rounds, writes docs/PERFORMANCE.md
    .venv/bin/python bench/overhead/startup.py --rounds 5 --no-write

Output: docs/PERFORMANCE.md, section "Start-up: ipw --help and ipw list" (``--no-write``: printed only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this file is bench/<question>/<script>.py
sys.path.insert(0, str(ROOT / "bench"))
from _shared import DOC, machine, write_section  # noqa: E402

IPW = str(Path(sys.executable).with_name("ipw"))
TARGET_S = 0.5
SECTION = "## Start-up: ipw --help and ipw list"
HEAVY = ("numpy", "pandas", "pyarrow", "psutil", "pynvml", "llama_cpp", "matplotlib", "jinja2")
COMMANDS = {"python -c pass": [sys.executable, "-c", "pass"], "ipw --help": [IPW, "--help"], "ipw list": [IPW, "list"]}
PROBE = """
import json, sys
from ipw.cli import main
try:
    main(sys.argv[2:])
except SystemExit:
    pass
json.dump(sorted(sys.modules), open(sys.argv[1], "w"))
"""


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=ROOT)
    return time.perf_counter() - start


def heavy_imports(args: list[str]) -> list[str]:
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        subprocess.run([sys.executable, "-c", PROBE, fh.name, *args], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True, cwd=ROOT)
        loaded = {m.split(".")[0] for m in json.loads(Path(fh.name).read_text())}
    return [m for m in HEAVY if m in loaded]


def top_imports(args: list[str], n: int = 6) -> list[tuple[str, float]]:
    """The top-level imports (of ipw's and the CLI's own modules) with the largest cumulative time."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ipw.cli", *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT)
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)", line)
        if m and len(m.group(2)) <= 2:
            rows.append((m.group(3).strip(), int(m.group(1)) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:n]


def measure(rounds: int) -> dict:
    for cmd in COMMANDS.values():  # compile caches, page cache
        wall(cmd)
    times = {k: [] for k in COMMANDS}
    load = []
    for _ in range(rounds):
        load.append(round(os.getloadavg()[0], 2))
        for name, cmd in COMMANDS.items():
            times[name].append(wall(cmd))
    return {"times": times, "load_avg": load,
            "median": {k: statistics.median(v) for k, v in times.items()},
            "heavy": {"ipw --help": heavy_imports(["--help"]), "ipw list": heavy_imports(["list"])},
            "top_list": top_imports(["list"])}


def write_doc(res: dict, rounds: int) -> None:
    rows = []
    for name, ts in res["times"].items():
        med = res["median"][name]
        target = "" if name.startswith("python") else f"< {TARGET_S} s"
        verdict = "" if name.startswith("python") else ("PASS" if med < TARGET_S else "FAIL")
        heavy = ", ".join(res["heavy"].get(name, [])) or ("none" if name in res["heavy"] else "")
        rows.append(f"| `{name}` | **{med:.3f} s** | {max(ts):.3f} s | {target} | {verdict} | {heavy} |")
    top = ", ".join(f"{m} {s * 1000:.0f} ms" for m, s in res["top_list"])
    body = f"""{SECTION}

Wall time from spawn to exit of the installed console script (`.venv/bin/ipw`), output to /dev/null,
median of {rounds} rounds (each round: a bare interpreter, `ipw --help`, `ipw list`, one after the other);
{machine()}.

| command | median | slowest | target | | heavy modules imported |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Every run: {'; '.join(f"`{k}` " + ', '.join(f'{t:.2f}' for t in v) for k, v in res['times'].items())} (s).
Load average before each round: {', '.join(map(str, res['load_avg']))} (2 shared cores).

`ipw --help` imports only typer (and ipw's CLI module): every command imports what it needs inside its
function. `ipw list` probes the sensors, which imports psutil, the NVML binding and numpy (the CPU model
sensor's snapshot code), but no engine, pandas or plotting. Largest imports of `ipw list`
(`python -X importtime`, cumulative, one run): {top}. `tests/commands/test_startup.py` checks the imports (not
the times) in CI.

Reproduce (writes this section):

```bash
.venv/bin/python bench/overhead/startup.py --rounds {rounds}
```
"""
    write_section(DOC, SECTION, body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    res = measure(args.rounds)
    print(json.dumps({"median_s": res["median"], "load_avg": res["load_avg"], "heavy": res["heavy"]}, indent=1))
    if not args.no_write:
        write_doc(res, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
