"""Interleaved A/B blocks in one job (``ipw check --rerun``): the baseline (A) and the candidate (B) each run
the whole query set several times, in the order A B B A, A B B A, ... so that a machine whose speed drifts
during the job weighs on both alike (a linear drift cancels exactly). Each block is one ``ipw run`` in a
process of its own, with the side's own interpreter: two configurations (a model or setting change) or two
checkouts/virtual environments of ipw and its engines (a code change) compare the same way.

The pairing and the verdict are ``ipw.analysis.check.check_interleaved``; this module only decides the order
and runs the blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ipw.errors import IpwError

_MAIN = "import sys; from ipw.cli import main; raise SystemExit(main(sys.argv[1:]))"


def block_order(n_blocks: int) -> tuple[str, ...]:
    """A B, B A, A B, B A, ...: every pair of blocks reversed from the one before; a multiple of 4 so that
    the A blocks' mean time equals the B blocks' (what makes a linear drift cancel)."""
    if n_blocks < 4 or n_blocks % 4:
        raise IpwError(f"--blocks {n_blocks}: give a multiple of 4 (A B B A ...), at least 4")
    return tuple(side for k in range(n_blocks // 2) for side in (("A", "B") if k % 2 == 0 else ("B", "A")))


@dataclass(frozen=True)
class Block:
    index: int  # 0-based position in the job
    side: str  # "A" (baseline) or "B" (candidate)
    run_dir: Path
    wall_s: float


def run_blocks(order: tuple[str, ...], run_block: Callable[[int, str], Path],
               progress: Callable[[str], None] = lambda line: None) -> tuple[Block, ...]:
    """Run every block in ``order`` with ``run_block(index, side) -> run folder``, one after the other."""
    blocks = []
    for i, side in enumerate(order):
        t0 = time.monotonic()
        run_dir = run_block(i, side)
        blocks.append(Block(i, side, Path(run_dir), time.monotonic() - t0))
        progress(f"block {i + 1}/{len(order)} ({side}): {blocks[-1].wall_s:.0f} s, {run_dir}")
    return tuple(blocks)


def subprocess_runner(configs: dict[str, Path], pythons: dict[str, str], out: Path,
                      run_args: list[str]) -> Callable[[int, str], Path]:
    """A block runner that makes each block with ``PYTHON -c 'ipw.cli.main' run CONFIG --out OUT/NN-SIDE ...``
    (the side's interpreter: its ipw, its llama.cpp)."""

    def run_block(index: int, side: str) -> Path:
        folder = out / f"{index + 1:02d}-{side}"
        cmd = [pythons[side], "-c", _MAIN, "run", str(configs[side]), "--out", str(folder), *run_args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise IpwError(f"block {index + 1} ({side}, {configs[side]}) failed with exit {proc.returncode}: {tail[0]}")
        runs = [p for p in folder.iterdir() if p.is_dir()]
        if len(runs) != 1:
            raise IpwError(f"block {index + 1} ({side}): expected one run folder in {folder}, found {len(runs)}")
        return runs[0]

    return run_block


def default_python() -> str:
    return sys.executable
