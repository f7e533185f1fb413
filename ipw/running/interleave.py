"""Interleaved A/B blocks in one job (``ipw check --rerun``): the baseline (A) and the candidate (B) run the
same queries in short alternating blocks, so that a machine whose speed drifts during the job weighs on both
alike. The query set is split into shards (``ipw run --shard K/N``); each shard runs as a *pair* of blocks, A
then B or B then A, every pair reversed from the one before (a linear drift cancels), and the job goes over
the shards in rounds (round 2 repeats round 1's shards, so the A blocks of the first and last rounds give the
drift the job saw). Each block is one ``ipw run`` in a process of its own, with the side's own interpreter:
two configurations (a model or setting change) or two checkouts/virtual environments of ipw and its engines
(a code change) compare the same way.

The verdict is ``ipw.analysis.check.check_interleaved``: energy and time are tested over the pairs, whose
two blocks ran minutes apart at most; this module only plans the order and runs the blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ipw.errors import IpwError

_MAIN = "import sys; from ipw.cli import main; raise SystemExit(main(sys.argv[1:]))"


def job_plan(n_blocks: int, n_shards: int = 1) -> tuple[tuple[str, int], ...]:
    """(side, shard) of every block in order: pair k runs shard ``k % n_shards + 1`` (1-based), A then B when k is
    even and B then A when odd. ``n_blocks`` is a multiple of 4 (as many A B as B A pairs: the A blocks' mean
    time equals the B blocks', which makes a linear drift cancel) and of ``2 * n_shards`` (whole rounds)."""
    if n_blocks < 4 or n_blocks % 4:
        raise IpwError(f"--blocks {n_blocks}: give a multiple of 4 (A B B A ...), at least 4")
    if n_shards < 1 or n_blocks % (2 * n_shards):
        raise IpwError(f"--shards {n_shards}: --blocks {n_blocks} must be a whole number of rounds of 2 blocks a "
                       "shard (a multiple of 2 x --shards)")
    return tuple((side, k % n_shards + 1) for k in range(n_blocks // 2)
                 for side in (("A", "B") if k % 2 == 0 else ("B", "A")))


@dataclass(frozen=True)
class Block:
    index: int  # 0-based position in the job
    side: str  # "A" (baseline) or "B" (candidate)
    shard: int  # 1-based shard of the query set it ran
    run_dir: Path
    wall_s: float


def run_blocks(plan: tuple[tuple[str, int], ...], run_block: Callable[[int, str, int], Path],
               progress: Callable[[str], None] = lambda line: None) -> tuple[Block, ...]:
    """Run every block of ``plan`` (``job_plan``) with ``run_block(index, side, shard) -> run folder``, one after
    the other."""
    blocks = []
    for i, (side, shard) in enumerate(plan):
        t0 = time.monotonic()
        run_dir = run_block(i, side, shard)
        blocks.append(Block(i, side, shard, Path(run_dir), time.monotonic() - t0))
        progress(f"block {i + 1}/{len(plan)} ({side}, shard {shard}): {blocks[-1].wall_s:.0f} s, {run_dir}")
    return tuple(blocks)


def subprocess_runner(configs: dict[str, Path], pythons: dict[str, str], out: Path, run_args: list[str],
                      n_shards: int = 1) -> Callable[[int, str, int], Path]:
    """A block runner that makes each block with ``PYTHON -c 'ipw.cli.main' run CONFIG --out OUT/NN-SIDE
    [--shard K/N] ...`` (the side's interpreter: its ipw, its llama.cpp)."""

    def run_block(index: int, side: str, shard: int) -> Path:
        folder = out / f"{index + 1:02d}-{side}"
        sharding = ["--shard", f"{shard}/{n_shards}"] if n_shards > 1 else []
        cmd = [pythons[side], "-c", _MAIN, "run", str(configs[side]), "--out", str(folder), *sharding, *run_args]
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


def run_job(configs: tuple[Path, Path], plan: tuple[tuple[str, int], ...], *, n_shards: int, out: Path | None,
            pythons: tuple[str | None, str | None], backends: tuple[str, ...] = (), limit: int | None = None,
            progress: Callable[[str], None] = print) -> list[tuple[str, Any, Any]]:
    """The interleaved job of ``ipw check --rerun``: the two configs compared (``paired``) and the interpreters
    found before the first block, then every block of ``plan`` (``job_plan``), each an ``ipw run`` of its side over
    its shard, in a folder ``OUT/interleaved-STAMP``; returns each block as (side, manifest, records), for
    ``ipw.analysis.check.check_interleaved``."""
    import datetime as dt
    import shutil

    from ipw.results import load_run

    for config in configs:
        if not Path(config).is_file():
            raise IpwError(f"--rerun {config}: not found (give two config files, baseline then candidate)")
    paired(configs, backends, limit)  # before the first block, not after the last
    python = {}
    for side, given, option in (("A", pythons[0], "--base-python"), ("B", pythons[1], "--cand-python")):
        found = shutil.which(given) if given else default_python()
        if not found:
            raise IpwError(f"{option} {given}: not found or not executable")
        python[side] = found
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    job = Path(out or "results") / f"interleaved-{stamp}"
    job.mkdir(parents=True, exist_ok=False)
    run_args = [a for b in backends for a in ("--backend", b)] + (["--limit", str(limit)] if limit is not None else [])
    progress(f"interleaved job {job}: {len(plan)} blocks over {n_shards} shard(s), "
             f"{' '.join(side for side, _ in plan)}, A = {configs[0]} ({python['A']}), "
             f"B = {configs[1]} ({python['B']})")
    done = run_blocks(plan, subprocess_runner({"A": Path(configs[0]), "B": Path(configs[1])}, python, job, run_args,
                                              n_shards),
                      progress=progress)
    return [(b.side, *load_run(b.run_dir, require=("dataset.fingerprint",))) for b in done]


def paired(configs: tuple[Path, Path], backends: tuple[str, ...], limit: int | None) -> None:
    """What the verdict pairs the blocks on, compared from the two configs as each block's ``ipw run`` loads
    them (with the job's --backend and --limit): the query set (its fingerprint) and the backends (each of the
    baseline's, by name, in the candidate). One line naming what differs (exit 2)."""
    from ipw.inputs.config import apply_overrides, load_config
    from ipw.inputs.datasets import load_query_set

    loaded = []
    for config in configs:
        c = apply_overrides(load_config(str(config)), {"backend": list(backends), "limit": limit})
        loaded.append((c, load_query_set(c.dataset, limit=c.limit, **c.dataset_options())))
    (a, qa), (b, qb) = loaded
    reasons = []
    if qa.fingerprint != qb.fingerprint:
        reasons.append(f"the query sets differ (dataset {a.dataset}: {len(qa)} queries, {qa.fingerprint}; dataset "
                       f"{b.dataset}: {len(qb)} queries, {qb.fingerprint})")
    names = [x.name for x in b.backends]
    missing = [x.name for x in a.backends if x.name not in names]
    if missing:
        reasons.append(f"backend(s) {', '.join(missing)} of the baseline missing from the candidate (its backends: "
                       f"{', '.join(names)})")
    if reasons:
        raise IpwError(f"--rerun {configs[0]} {configs[1]}: not comparable: " + "; ".join(reasons))
