"""``ipw merge SHARD_RUN... --out DIR``: combine the run folders of ``ipw run --shard K/N`` into one run.

The shards must be the complete set 1..N of one split, each complete, with one config (``out_dir``
aside) and one full query set; no record may occur twice.  The merged run's manifest carries the
full set's dataset fingerprint, so ``compare``, ``report`` and ``check`` treat it like an unsharded
run; every record keeps the node that measured it (``node``, ``hardware_id``), the fingerprints of
all machines are in ``hardware_by_id``, and ``merged_from`` lists the shards.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from ipw import __version__
from ipw.errors import IpwError
from ipw.options import MergeOptions
from ipw.results import QueryRecord, RunFolder, RunManifest, new_run_id, read_log, read_power
from ipw.running.shard import combine_backend_infos

_CONFIG_IGNORED = ("out_dir", "source")  # where each shard wrote, and the config file's path


def _read_manifest(path: Path) -> RunManifest:
    return RunManifest.read(path, require=("config", "dataset.fingerprint", "dataset.n_queries"))


def _present(field: dict[str, Any] | None) -> dict[str, Any]:
    """A shard's manifest field that _read_manifest requires (config, dataset) or merge_runs has checked (shard)."""
    assert field is not None
    return field


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The first key path where two JSON values differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    return None if a == b else (where or "<root>")


def merged_carbon(carbons: list[Any]) -> dict[str, Any] | None:
    """The merged run's carbon intensity (ipw.carbon): the shards' when they all carry the same one (or none);
    shards priced differently (a live feed read at different hours) leave the merged run without one, saying so."""
    if all(c == carbons[0] for c in carbons):
        return carbons[0]
    values = ", ".join(sorted({str((c or {}).get("g_per_kwh")) for c in carbons}))
    return {"g_per_kwh": None, "source": "ipw merge",
            "error": f"the shards carry different carbon intensities ({values} gCO2e/kWh); re-price the merged run "
                     "with ipw compare --carbon-intensity"}


def merge_runs(paths: list[str | Path], out_dir: str | Path, command: list[str] | None = None) -> RunFolder:
    """Validate the shards (IpwError with the reason, one line), then write the merged run folder."""
    if not paths:
        raise IpwError("ipw merge: give the shard run folders to merge")
    shards = []
    for p in map(Path, paths):
        m = _read_manifest(p)
        info = m.shard
        if not info:
            raise IpwError(f"{p}: not a shard run (it was not made with --shard K/N); nothing to merge")
        if not (isinstance(info, dict) and isinstance(info.get("index"), int) and isinstance(info.get("count"), int)
                and isinstance(info.get("dataset"), dict) and "fingerprint" in info["dataset"]):
            raise IpwError(f"{p}: manifest field 'shard': expected index, count and dataset; the manifest "
                           "is damaged")
        if m.status != "complete":
            raise IpwError(f"{p}: shard {info['index']}/{info['count']} is {m.status}; finish it first "
                           f"(ipw run --resume {p})")
        shards.append((p, m))
    (p0, m0) = shards[0]
    count = _present(m0.shard)["count"]
    full = _present(m0.shard)["dataset"]
    config0 = {k: v for k, v in _present(m0.config).items() if k not in _CONFIG_IGNORED}
    by_index: dict[int, Path] = {}
    for p, m in shards:
        info = _present(m.shard)
        if info["count"] != count:
            raise IpwError(f"{p}: shard {info['index']}/{info['count']} is of another split than {p0} "
                           f"({_present(m0.shard)['index']}/{count})")
        if info["dataset"]["fingerprint"] != full["fingerprint"]:
            raise IpwError(f"{p}: its full query set differs from {p0}'s (dataset fingerprints "
                           f"{info['dataset']['fingerprint']} vs {full['fingerprint']})")
        diff = _first_difference(config0, {k: v for k, v in _present(m.config).items() if k not in _CONFIG_IGNORED})
        if diff:
            raise IpwError(f"{p}: its config differs from {p0}'s (field '{diff}'); shards of one run share one config")
        if info["index"] in by_index:
            raise IpwError(f"shard {info['index']}/{count} given twice ({by_index[info['index']]} and {p})")
        by_index[info["index"]] = p
    missing = [f"{k}/{count}" for k in range(1, count + 1) if k not in by_index]
    if missing:
        raise IpwError(f"missing shard(s) {', '.join(missing)}: merging needs all {count} shards of the split")
    if sum(_present(m.dataset)["n_queries"] for _, m in shards) != full["n_queries"]:
        raise IpwError(f"the shards hold {sum(_present(m.dataset)['n_queries'] for _, m in shards)} queries, but their "
                       f"full set has {full['n_queries']}")

    shards.sort(key=lambda s: _present(s[1].shard)["index"])
    run_id = new_run_id()
    order = {b["name"]: i for i, b in enumerate(_present(m0.config)["backends"])}
    seen: dict[tuple[str, str, int], Path] = {}
    rows, n_records, node_of = [], {}, {}
    for p, _m in shards:
        shard_rows = read_log(p)
        n_records[p] = len(shard_rows)
        node_of[p] = (shard_rows[0].get("node") or "") if shard_rows else ""  # for power traces without one
        for row in shard_rows:
            key = (row["backend"], row["query_id"], int(row["repeat"]))
            if key in seen:
                raise IpwError(f"duplicate record: backend {key[0]}, query {key[1]}, repeat {key[2]} is in "
                               f"{seen[key]} and {p}")
            seen[key] = p
            rows.append({**row, "run_id": run_id})
    rows.sort(key=lambda r: (order.get(r["backend"], len(order)), int(r["repeat"])))  # stable: shard order within

    hardware_by_id: dict[str, Any] = {}
    for _, m in shards:
        hardware_by_id.update(m.hardware_by_id or {})
    backends = []
    for b in _present(m0.config)["backends"]:
        infos = [{**info.to_json(), "shard": _present(m.shard)["index"]} for _, m in shards
                 for info in m.entries() if info.name == b["name"]]
        if infos:
            backends.append(combine_backend_infos(infos))
    power = _merged_power(shards, node_of)  # read (and checked) before the merged folder exists
    folder = RunFolder.create(out_dir, run_id, RunManifest(
        run_id=run_id,
        ipw_version=__version__,
        command=list(command if command is not None else sys.argv),
        config=m0.config,
        dataset=full,
        hardware=m0.hardware or {},
        hardware_by_id=hardware_by_id,
        software=m0.software or {},
        started_at=min(m.started_at or "" for _, m in shards),
        backends=backends,
        merged_from=[{"shard": _present(m.shard)["index"], "of": count, "path": str(p), "run_id": m.run_id,
                      "dataset_fingerprint": _present(m.dataset)["fingerprint"], "n_records": n_records[p],
                      "hardware_ids": sorted(m.hardware_by_id or {}), "software": m.software,
                      "started_at": m.started_at, "finished_at": m.finished_at}
                     for p, m in shards],
        merged_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        carbon=merged_carbon([m.carbon for _, m in shards]),
    ))
    folder.append_many([QueryRecord.from_row(row) for row in rows])
    if power is not None:
        folder.write_power(power)
    folder.finish("complete")
    return folder


def _merged_power(shards: list[tuple[Path, RunManifest]], node_of: dict[Path, str]):
    """Each shard's power.parquet, with the node it was measured on (time is per node); None when none has one."""
    import pandas as pd

    frames = []
    for p, _ in shards:
        frame = read_power(p)
        if frame is not None:
            if "node" not in frame.columns:
                frame["node"] = node_of[p]
            frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else None


def merge_command(shards, options: MergeOptions) -> int:
    """``ipw merge``: the merged run folder's path goes to stdout."""
    from rich.console import Console

    folder = merge_runs(shards, options.out)
    info, merged_from, hardware = folder.manifest.dataset, folder.manifest.merged_from, folder.manifest.hardware_by_id
    assert info is not None and merged_from is not None and hardware is not None  # merge_runs wrote them
    Console(stderr=True).print(
        f"merged {len(merged_from)} shards: {info['n_queries']} queries "
        f"({info['fingerprint']}), {sum(s['n_records'] for s in merged_from)} records, "
        f"{len(hardware)} machine fingerprint(s)", highlight=False, markup=False)
    print(folder.path)
    return 0
