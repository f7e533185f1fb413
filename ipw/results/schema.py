"""The run folder's schema: a record (``QueryRecord``) and its Arrow schema, a judge entry, the sampler
overheads, the schema version and statuses, and the names of the folder's files."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ipw.errors import IpwError

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    import pyarrow as pa


SCHEMA_VERSION = 1
STATUSES = ("running", "complete", "interrupted", "failed")
KEY_FIELDS = ("backend", "query_id", "repeat")  # what identifies a record
NUMERIC_COLUMNS = ("correct", "energy_j")  # what every analysis reads: numbers (or null)


@dataclass(frozen=True)
class QueryRecord:
    run_id: str
    backend: str
    model: str
    role: str
    query_id: str
    category: str
    repeat: int
    scorer: str
    prompt: str
    answer: str
    output: str
    correct: float | None  # 0..1; an error counts 0; None: unscored (a ``judge`` item no judge has graded)
    error: str | None  # None when the query succeeded
    error_category: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float
    start_s: float  # monotonic seconds of the window
    end_s: float
    energy_j: float | None  # gross energy on the record's basis (see energy_quality)
    energy_quality: str  # measured | measured_interpolated | estimated | unavailable
    energy_source: str
    energy_scope: str
    best_effort_energy_j: float | None  # every available part, measured and estimated, summed
    net_energy_j: float | None  # energy_j minus idle power x duration
    energy_parts: str = "[]"  # JSON list of per-component readings
    # prefill (window start -> first token) and decode (first token -> end): the same readings as
    # energy_j cut at the first token, so they sum to it; None without a first token (ipw/telemetry/phases.py)
    prefill_energy_j: float | None = None
    decode_energy_j: float | None = None
    prefill_uncertainty_j: float | None = None  # ± energy that may belong to the other phase
    phase_quality: str = ""  # worst quality of the split: measured_interpolated | estimated
    prefill_unresolved: bool | None = None  # the prefill is shorter than the sensor resolves
    phase_note: str = ""
    # the machine that measured the record (ipw.telemetry.hardware.NodeIdentity): a hash of its host name,
    # and the key of its hardware fingerprint in the manifest's ``hardware_by_id``; "" in older runs
    node: str = ""
    hardware_id: str = ""
    choices: tuple[str, ...] = ()  # the query's options (mcq), kept for rescoring; () in older runs
    # coverage as the paper defines it (ipw/grading/judge.py, grading vs-backend:NAME): a judge compared this
    # output with backend ``vs_backend``'s output to the same query in both orders; win_tie is 1.0 when
    # both orders rate it a win or a tie, 0.0 otherwise, None when it was not judged (or is the reference)
    win_tie: float | None = None
    vs_backend: str = ""
    judge_verdicts: tuple[str, ...] = ()  # per order: response | reference | tie | unparsed | error
    # ipw serve: the provisional energy its answer carried (J) and that value's ±90% band around the settled
    # energy_j (docs/SERVING.md); None where the answer carried none
    provisional_energy_j: float | None = None
    provisional_uncertainty_j: float | None = None
    # the mean log-probability of the output tokens where the engine gave them (``logprobs = true``): the
    # answer's confidence, on which a cascade escalates to the cloud (ipw/analysis/cascade.py); None where
    # the engine gave none, and in runs written before the field.  Kept before ``concurrency``: the last
    # three fields are the frame ``record_keys`` reads (``_TAIL``)
    mean_logprob: float | None = None
    # serving under load (docs/SERVING.md): the requests in flight at the record's level of a concurrency
    # sweep (1 in older runs); how energy measured while requests overlapped was split among them
    # ("" when the window was the request's alone; ipw.metering.split.SPLIT_METHODS), and how far the
    # other split (priced or local) would move this record's share (J)
    concurrency: int = 1
    split_method: str = ""
    split_uncertainty_j: float | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "QueryRecord":
        """A record from a row of records.parquet or records.jsonl (the one way back from a row): NaN ->
        None, numpy -> Python; a field the run predates gets its empty value."""
        import math

        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value: Any = row.get(f.name)
            if f.name in ("choices", "judge_verdicts"):  # a list (JSONL), an array (Parquet), or missing in older runs
                out[f.name] = tuple(str(c) for c in value) if isinstance(value, (list, tuple)) or hasattr(
                    value, "tolist") else ()
                continue
            if hasattr(value, "item") and not isinstance(value, str):
                value = value.item()
            if isinstance(value, float) and math.isnan(value):
                value = None
            out[f.name] = value
        for key in ("repeat", "prompt_tokens", "completion_tokens"):
            out[key] = int(out[key] or 0)
        out["energy_parts"] = out["energy_parts"] or "[]"
        for key in ("node", "hardware_id", "vs_backend", "split_method"):  # absent in runs written before these fields
            out[key] = out[key] or ""
        out["concurrency"] = int(out["concurrency"] or 1)
        return cls(**out)

    def to_json(self) -> str:
        from ipw.sanitize import scrub  # an API key never reaches the run folder, whatever a server echoed

        return escape_surrogates(scrub(json.dumps(dataclasses.asdict(self), ensure_ascii=False)), in_json=True)


RECORD_COLUMNS = [f.name for f in dataclasses.fields(QueryRecord)]
_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str, in_json: bool = False) -> str:
    """``text`` with each lone surrogate (a prompt's ``"\\ud800"``, a non-UTF-8 byte of argv) written as the six
    characters of its escape (``\\ud800``), which UTF-8 can hold: a record that held one could not be written,
    and was lost.  ``in_json``: ``text`` is a JSON document (the surrogates are inside its strings), whose
    backslash is escaped too, so that it reads back as those six characters."""
    if _SURROGATE.search(text) is None:
        return text
    escape = "\\\\u%04x" if in_json else "\\u%04x"
    return _SURROGATE.sub(lambda m: escape % ord(m.group()), text)
# records.parquet's column types, by QueryRecord's field types (strings as pandas writes them: large_string)
_ARROW_TYPES = {"str": "large_string", "str | None": "large_string", "int": "int64", "float": "float64",
                "float | None": "float64", "bool | None": "bool", "tuple[str, ...]": "list<large_string>"}


def record_schema() -> pa.Schema:
    """records.parquet's Arrow schema: one column per :class:`QueryRecord` field, typed by ``_ARROW_TYPES``."""
    import pyarrow as pa

    types: dict[str, pa.DataType] = {"large_string": pa.large_string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_(),
             "list<large_string>": pa.list_(pa.large_string())}
    return pa.schema([(f.name, types[_ARROW_TYPES[str(f.type)]]) for f in dataclasses.fields(QueryRecord)])

@dataclass(frozen=True)
class SamplerOverhead:
    """A sensor thread's own cost, one entry of a manifest backend's ``sampler_overhead`` (by sensor name):
    CPU seconds of the thread, the seconds it was measured over, and their ratio, under the keys every sensor
    writes (``cpu_s``, ``wall_s``, ``cpu_fraction_of_one_core``).  ``OLD_KEYS``: what the RAPL/CPU-model
    snapshot thread wrote before (run folders of earlier versions), read here and nowhere else."""

    OLD_KEYS: ClassVar[dict[str, str]] = {"wall_s": "active_s", "cpu_fraction_of_one_core": "fraction_of_core"}

    cpu_s: float | None
    wall_s: float | None
    cpu_fraction_of_one_core: float | None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplerOverhead":
        def value(key: str) -> float | None:
            found = data.get(key, data.get(cls.OLD_KEYS.get(key, key)))
            return None if found is None else float(found)

        return cls(*(value(f.name) for f in dataclasses.fields(cls)))


def sampler_overheads(backend: dict[str, Any]) -> dict[str, SamplerOverhead]:
    """A manifest backend entry's ``sampler_overhead``, typed (sensors that reported nothing left out)."""
    table = backend.get("sampler_overhead") or {}
    return {name: SamplerOverhead.from_dict(o) for name, o in table.items() if isinstance(o, dict) and o}


JUDGE_SCHEMA_VERSION = 1  # judge.jsonl lines written before the field existed have this layout: read as 1


@dataclass(frozen=True)
class JudgeEntry:
    """One line of ``judge.jsonl``: what the judge did, and cost, for one record of a rescored run
    (``ipw.grading.rescore``); written by :meth:`RunFolder.append_judge`, read by :func:`read_judge`.  A record the
    judge did not grade has no calls and one string verdict saying why (error, empty, unscored)."""

    backend: str
    query_id: str
    repeat: int
    category: str
    judge: str  # the judge backend's name
    judge_model: str
    grading: str  # reference | pairwise | vs-backend
    vs_backend: str | None
    prompt_version: str
    correct: bool
    verdicts: tuple[str, ...]
    judge_outputs: tuple[str, ...]
    judge_errors: tuple[str, ...]
    judge_calls: int
    judge_prompt_tokens: int
    judge_completion_tokens: int
    judge_latency_s: float
    judge_energy_j: float | None  # None: no call, or a call's energy unavailable
    judge_energy_quality: str | None  # the calls' qualities, comma-joined
    judge_energy_source: str | None
    judge_cost_usd: float | None
    schema_version: int = JUDGE_SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "judge.jsonl") -> "JudgeEntry":
        """An entry from a parsed line (an unversioned line is version 1; a newer one is an IpwError)."""
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > JUDGE_SCHEMA_VERSION:
            raise IpwError(f"{where}: field 'schema_version': {version!r}, written by a newer ipw (this one reads "
                           f"up to {JUDGE_SCHEMA_VERSION}); upgrade ipw")
        tuples = ("verdicts", "judge_outputs", "judge_errors")
        out: dict[str, Any] = {f.name: data.get(f.name) for f in dataclasses.fields(cls)}
        missing = [k for k in ("backend", "query_id", "judge_calls", "verdicts") if out[k] is None]
        if missing:
            raise IpwError(f"{where}: field '{missing[0]}': missing")
        return cls(**{**out, **{k: tuple(out[k] or ()) for k in tuples}, "category": out["category"] or "",
                      "repeat": int(out["repeat"] or 0), "correct": bool(out["correct"]), "schema_version": version})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)


#: the other files of a run folder (docs/ARCHITECTURE.md)
POWER_FILE = "power.parquet"
JUDGE_FILE = "judge.jsonl"
