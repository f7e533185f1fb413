"""The metric contract (DESIGN.md §2): accuracy, J/query, IPJ, mean power, IPW, J per output token.

Repeats of a query are averaged first; confidence intervals resample queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipw.stats import NAN, Estimate, bootstrap


@dataclass(frozen=True)
class BackendMetrics:
    backend: str
    model: str
    role: str
    n_queries: int
    n_records: int
    n_errors: int
    n_with_energy: int
    energy_quality: str  # the worst quality among the records used
    accuracy: Estimate
    energy_per_query_j: Estimate
    ipj: Estimate  # correct answers per joule
    mean_power_w: Estimate
    ipw: Estimate  # accuracy per watt
    j_per_output_token: Estimate
    ttft_p50_s: float
    latency_p50_s: float
    # over the queries whose records have phases (ipw/phases.py): prefill J / prompt tokens, decode J /
    # completion tokens
    j_per_prefill_token: Estimate = NAN
    j_per_decode_token: Estimate = NAN


def _mean(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=-1)


def per_query(frame):
    """One row per query: the means over repeats of correctness, energy, duration and tokens."""
    frame = frame.assign(duration_s=frame["end_s"] - frame["start_s"])
    for column in ("prefill_energy_j", "decode_energy_j"):  # absent from runs made before phases
        if column not in frame:
            frame = frame.assign(**{column: float("nan")})
    return frame.groupby("query_id", sort=True).agg(
        correct=("correct", "mean"),
        energy_j=("energy_j", "mean"),
        duration_s=("duration_s", "mean"),
        completion_tokens=("completion_tokens", "mean"),
        prompt_tokens=("prompt_tokens", "mean"),
        prefill_energy_j=("prefill_energy_j", "mean"),
        decode_energy_j=("decode_energy_j", "mean"),
        category=("category", "first"),
    )


def backend_metrics(frame, *, seed: int = 0) -> BackendMetrics:
    """Metrics of one backend's records (a pandas frame with the QueryRecord columns)."""
    from ipw.telemetry.base import worst_quality

    q = per_query(frame)
    correct = q["correct"].to_numpy(float)
    accuracy = bootstrap(_mean, correct, seed=seed)
    has_e = q["energy_j"].notna().to_numpy()
    e, t, tok, c = (q[k].to_numpy(float)[has_e] for k in ("energy_j", "duration_s", "completion_tokens", "correct"))
    if has_e.any():
        epq = bootstrap(_mean, e, seed=seed)
        ipj = bootstrap(lambda c, e: c.mean(-1) / e.mean(-1), c, e, seed=seed)
        power = bootstrap(lambda e, t: e.sum(-1) / t.sum(-1), e, t, seed=seed)
        ipw = bootstrap(lambda c, e, t: c.mean(-1) / (e.sum(-1) / t.sum(-1)), c, e, t, seed=seed)
        jpt = bootstrap(lambda e, k: e.sum(-1) / k.sum(-1), e, tok, seed=seed)
    else:
        epq = ipj = power = ipw = jpt = NAN
    has_p = (q["prefill_energy_j"].notna() & q["decode_energy_j"].notna()).to_numpy()
    pre, dec, ptok, ctok = (q[k].to_numpy(float)[has_p] for k in
                            ("prefill_energy_j", "decode_energy_j", "prompt_tokens", "completion_tokens"))
    per_token = lambda e, k: e.sum(-1) / k.sum(-1)  # noqa: E731
    jpp = bootstrap(per_token, pre, ptok, seed=seed) if has_p.any() else NAN
    jpd = bootstrap(per_token, dec, ctok, seed=seed) if has_p.any() else NAN
    quality = worst_quality(frame.loc[frame["energy_j"].notna(), "energy_quality"].unique().tolist())
    ttft = frame["ttft_s"].dropna()
    return BackendMetrics(
        backend=str(frame["backend"].iloc[0]),
        model=str(frame["model"].iloc[0]),
        role=str(frame["role"].iloc[0]),
        n_queries=len(q),
        n_records=len(frame),
        n_errors=int(frame["error"].notna().sum()),
        n_with_energy=int(has_e.sum()),
        energy_quality=quality,
        accuracy=accuracy,
        energy_per_query_j=epq,
        ipj=ipj,
        mean_power_w=power,
        ipw=ipw,
        j_per_output_token=jpt,
        ttft_p50_s=float(ttft.median()) if len(ttft) else float("nan"),
        latency_p50_s=float(frame["latency_s"].median()),
        j_per_prefill_token=jpp,
        j_per_decode_token=jpd,
    )


def run_metrics(frame, *, seed: int = 0) -> list[BackendMetrics]:
    return [backend_metrics(group, seed=seed) for _, group in frame.groupby("backend", sort=False)]
