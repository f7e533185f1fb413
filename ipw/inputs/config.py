"""Run configs (TOML): load, validate with field-level errors, apply CLI overrides.

A config names the dataset, the backends (each with a name and a role), generation settings, repeats
and warm-up queries.  ``ipw run`` with no config uses the embedded default (``ipw/default.toml``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

from ipw.backends.base import BackendSpec, GenerationSettings, backend_kinds, backend_options
from ipw.errors import IpwError
from ipw.grading.spec import JudgeSpec, check_grading
from ipw.limits import MAX_PUE, check_name, check_range, name_skeleton
from ipw.options import RUN, RUN_OPTIONS
from ipw.inputs.resources import resource_path

EMBEDDED_DEFAULT = resource_path("default.toml")
ROLES = ("local", "cloud")
MODES = ("chat", "completion")


@dataclass(frozen=True)
class RunConfig:
    dataset: str
    backends: tuple[BackendSpec, ...]
    generation: GenerationSettings = GenerationSettings()
    limit: int = 0  # 0 = every query
    repeats: int = 1
    warmup: int = 2
    seed: int = 0
    idle_s: float = 0.0  # idle-baseline seconds measured before each backend's queries
    out_dir: str = "results"
    source: str = "<embedded default>"
    dataset_preset: str | None = None  # a schema preset (ipw.inputs.presets); None = detect from the columns
    split: str | None = None  # a split of a Hugging Face DatasetDict folder; None = test/validation/train
    categories: tuple[str, ...] = ()  # keep only these categories; () = all
    sample: int = 0  # a random sample of this many queries, seeded by `seed`; 0 = all
    energy_split: str = "priced"  # how overlapping requests' energy is split (ipw.metering.split.SPLITS)
    judge: JudgeSpec | None = None  # the [judge] table: grades the run when it ends; `ipw rescore`'s default judge
    carbon_intensity: float | None = None  # gCO2e/kWh given (ipw.carbon); None: none, or from grid_region
    grid_region: str | None = None  # the zone whose intensity the run carries (offline table, or live)
    grid_live: bool = False  # grid_region's intensity from Electricity Maps, not the offline table

    def to_dict(self) -> dict[str, Any]:
        """As stored in the manifest: a ``base_url``'s ``user:password@`` and secret query values redacted
        (ipw never sends them: keys go only in the Authorization header, from ``api_key_env``)."""
        from ipw.sanitize import redact_url

        data = dataclasses.asdict(self)
        for backend in list(data["backends"]) + ([data["judge"]["backend"]] if data.get("judge") else []):
            if isinstance(backend.get("options", {}).get("base_url"), str):
                backend["options"]["base_url"] = redact_url(backend["options"]["base_url"])
        return data

    def dataset_options(self) -> dict[str, Any]:
        """The keyword arguments of ``load_queries`` besides the dataset itself."""
        return {"preset": self.dataset_preset, "split": self.split, "categories": self.categories,
                "sample": self.sample, "seed": self.seed}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> "RunConfig":
        """Inverse of ``to_dict`` (used by ``--resume`` to rebuild the config from a manifest); an
        IpwError naming ``where`` when ``data`` is not a run config."""
        try:
            gen = dict(data.get("generation", {}))
            gen["stop"] = tuple(gen.get("stop", ()))
            config = cls(**{**data, "generation": GenerationSettings(**gen),
                            "backends": tuple(BackendSpec(**b) for b in data["backends"]),
                            "categories": tuple(data.get("categories") or ()),
                            "judge": JudgeSpec.from_dict(data["judge"]) if data.get("judge") else None})
            register_secret_envs(config.backends, config.judge)
            return config
        except (TypeError, KeyError, ValueError, AttributeError) as exc:
            raise IpwError(f"{where}: not a run config ({type(exc).__name__}: {exc})") from None


# the top-level fields: the run options that are config fields (ipw.options.RUN_OPTIONS, a repeatable one a
# list) and the tables
_OPTION_FIELDS = {o.key: o for o in RUN_OPTIONS if o.key}
_TOP = {**{key: o.field_type for key, o in _OPTION_FIELDS.items()},
        "generation": dict, "backends": list, "judge": dict}


def _table_types(cls) -> dict[str, type]:
    """A dataclass's fields as the types of a TOML table's keys (a tuple is a TOML list): the dataclass
    is the one declaration."""
    hints = typing.get_type_hints(cls)
    return {f.name: list if typing.get_origin(hints[f.name]) is tuple else hints[f.name]
            for f in dataclasses.fields(cls)}


_GENERATION = _table_types(GenerationSettings)  # [generation]: every field of GenerationSettings, seed included
_BACKEND = {"name": str, "kind": str, "model": str, "role": str, "mode": str}
# what a backend's Ray task asks for (ipw.running.ray_runner.task_resources); kept in the backend's options
_RAY_RESOURCES = {"ray_num_cpus": float, "ray_num_gpus": float}
# the datacenter's overhead on the backend's energy (ipw.analysis.basis, --energy-basis facility): its PUE
# (1.0 unless set) and where that figure comes from; kept in the backend's options
_FACILITY = {"pue": float, "pue_source": str}
_JUDGE = {"name": str, "kind": str, "model": str, "mode": str, "grading": str, "prompt": str, "max_tokens": int,
          "usd_per_mtok_in": float, "usd_per_mtok_out": float}


class _Where:
    """Finds the line of a key in the TOML text, so errors can name file, line and field. The lines of
    every key are indexed once (a config of 10,000 backends is checked in linear time)."""

    _PART = r"(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')"
    _DOTTED = rf"{_PART}(?:\s*\.\s*{_PART})*"
    _KEY = re.compile(rf"^\s*({_DOTTED})\s*=")  # key = ..., and dotted: generation.max_tokens = ...
    _INLINE_KEY = re.compile(rf"[{{,]\s*({_DOTTED})\s*=")  # keys of inline tables: {{ name = ..., kind = ... }}
    _PARTS = re.compile(_PART)
    _TABLE = re.compile(r"^\s*\[")
    _HEADER = re.compile(rf"^\s*\[\[?\s*({_DOTTED})\s*\]\]?\s*(?:#.*)?$")  # [table] or [[array]]: its name

    def __init__(self, path: str, text: str) -> None:
        self.path, self.lines = path, text.splitlines()
        self._keys: dict[str, list[int]] = {}
        self._headers: dict[str, list[int]] = {}  # the lines of every [table] and [[array]] header
        for i, line in enumerate(self.lines, start=1):
            m = self._KEY.match(line)
            if m:
                self._index(m.group(1), i)
            elif self._TABLE.match(line):
                self._headers.setdefault(line.split("#")[0].strip(), []).append(i)
                header = self._HEADER.match(line)
                if header:  # an unknown [table] is found by its name, as an unknown key is
                    self._index(header.group(1), i)
            if "{" in line:  # an inline table (perhaps in an array of them): each of its keys on this line
                for key in self._INLINE_KEY.findall(line[m.end():] if m else line):
                    self._index(key, i)

    def _index(self, dotted: str, line: int) -> None:
        """Every part of a dotted key names this line (an unknown ``generation.max_tokn`` is found by
        ``max_tokn``, an unknown top-level ``foo.bar`` by ``foo``)."""
        for part in dict.fromkeys(p.strip("\"'") for p in self._PARTS.findall(dotted)):
            found = self._keys.setdefault(part, [])
            if not found or found[-1] != line:
                found.append(line)

    def header_line(self, header: str, index: int = 0) -> int:
        """The line of the ``index``-th header ``header`` (e.g. ``[[backends]]``), else 0."""
        found = self._headers.get(header, [])
        return found[index] if index < len(found) else 0

    def __call__(self, field: str, key: str | None = None, after: int = 0) -> str:
        import bisect

        key = key or field.rsplit(".", 1)[-1]
        lines = self._keys.get(key, [])
        i = bisect.bisect_right(lines, after)
        if i < len(lines):
            return f"{self.path}:{lines[i]}: field '{field}'"
        return f"{self.path}{f':{after}' if after else ''}: field '{field}'"


def _check_type(value: Any, expected: type | tuple[type, ...], loc: str) -> Any:
    """``expected``: a type, or a tuple of types any of which will do (e.g. ``(int, list)``)."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) and expected is not bool or not isinstance(value, expected):
        name = " or ".join(t.__name__ for t in expected) if isinstance(expected, tuple) else expected.__name__
        raise IpwError(f"{loc}: expected {name}, got {type(value).__name__} {value!r}")
    if expected is float and not math.isfinite(cast(float, value)):  # TOML has nan and inf; 1e309 is inf too
        raise IpwError(f"{loc}: must be a finite number, got {value!r}")
    return value


def check_generation(gen: dict[str, Any], loc: Callable[[str], str]) -> None:
    """Generation settings in range: what a backend would otherwise reject mid-run, or accept silently."""
    if "max_tokens" in gen and gen["max_tokens"] < 1:
        raise IpwError(f"{loc('max_tokens')}: must be >= 1")
    if "temperature" in gen:
        check_range(gen["temperature"], loc("temperature"), low=0.0)
    if "top_p" in gen:
        check_range(gen["top_p"], loc("top_p"), low=0.0, high=1.0, low_open=True)
    if "top_k" in gen:
        check_range(gen["top_k"], loc("top_k"), low=0)
    if "repeat_penalty" in gen:
        check_range(gen["repeat_penalty"], loc("repeat_penalty"), low=0.0, low_open=True)
    for i, stop in enumerate(gen.get("stop", ())):
        if not isinstance(stop, str) or not stop:
            raise IpwError(f"{loc('stop')}: item {i} must be a non-empty string, got {stop!r}")


def check_idle_s(value: float, loc: str) -> None:
    RUN["idle_s"].check(value, loc)


MAX_SOURCE_CHARS = 200  # a pue_source: where a figure comes from, in a line


# engine options that are counts (the same meaning for every kind that has them)
_AT_LEAST_ONE = ("n_threads", "n_ctx")


def _check_table(table: dict, allowed: dict[str, type], prefix: str, where: _Where, after: int = 0) -> dict:
    out = {}
    for key, value in table.items():
        field = f"{prefix}{key}"
        if key not in allowed:
            what = "table" if isinstance(value, dict) else "key"
            raise IpwError(f"{where(field, key, after)}: unknown {what} (allowed: {', '.join(sorted(allowed))})")
        try:
            out[key] = _check_type(value, allowed[key], "")
        except IpwError as exc:  # the location is found only for an error
            raise IpwError(f"{where(field, key, after)}{exc.message}") from None
    return out


def parse_config(text: str, path: str) -> RunConfig:
    text = text.removeprefix("\ufeff")  # a byte-order mark (Notepad writes one) is not TOML
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise IpwError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise IpwError(f"{path}: invalid TOML: nested too deeply") from None
    where = _Where(path, text)
    top = _check_table(raw, _TOP, "", where)
    if "dataset" not in top:
        raise IpwError(f"{path}: field 'dataset': required")
    for key, option in _OPTION_FIELDS.items():  # the command line's bounds (ipw.options)
        if key in top:
            option.check(top[key], where(key))
    if "dataset_preset" in top:
        from ipw.inputs.presets import PRESETS

        if top["dataset_preset"] not in PRESETS:
            raise IpwError(f"{where('dataset_preset')}: unknown preset (known: {', '.join(PRESETS)})")
    if "categories" in top:
        top["categories"] = tuple(str(c) for c in top["categories"])
    if "judge" in top:
        top["judge"] = parse_judge_table(top["judge"], path, text)
    gen = _check_table(top.pop("generation", {}), _GENERATION, "generation.", where)
    if "seed" in top:  # one seed: the query sample's and the decoder's ([generation] seed wins for decoding)
        gen.setdefault("seed", top["seed"])
    check_generation(gen, lambda key: where(f"generation.{key}", key))
    if "stop" in gen:
        gen["stop"] = tuple(gen["stop"])
    backends = []
    names: set[str] = set()
    skeletons: dict[str, str] = {}
    raw_backends = top.pop("backends", [])
    if not raw_backends:
        raise IpwError(f"{path}: field 'backends': at least one [[backends]] table is required")
    for i, entry in enumerate(raw_backends):
        prefix = f"backends[{i}]."
        header = where.header_line("[[backends]]", i)  # keys of this backend are found after its header

        def loc(key: str) -> str:
            return where(prefix + key, key, header)

        if not isinstance(entry, dict):
            raise IpwError(f"{path}: field 'backends[{i}]': expected a table")
        kind = entry.get("kind")
        if kind is None:
            raise IpwError(f"{loc('kind')}: required (known kinds: {', '.join(backend_kinds())})")
        if kind not in backend_kinds():
            raise IpwError(f"{loc('kind')}: unknown backend kind {kind!r} (known: {', '.join(backend_kinds())})")
        allowed = {**_BACKEND, **backend_options(kind), **_RAY_RESOURCES, **_FACILITY}
        fields = _check_table(entry, allowed, prefix, where, header)
        for key in _RAY_RESOURCES:
            if fields.get(key, 0) < 0:
                raise IpwError(f"{loc(key)}: must be >= 0")
        if "pue" in fields:  # PUE = facility energy / IT energy: never below 1
            check_range(fields["pue"], loc("pue"), low=1.0, high=MAX_PUE)
        if len(fields.get("pue_source", "")) > MAX_SOURCE_CHARS:  # kept in every manifest, shown in notes
            raise IpwError(f"{loc('pue_source')}: {len(fields['pue_source'])} characters; at most {MAX_SOURCE_CHARS}")
        for key in _AT_LEAST_ONE:
            if key in fields and fields[key] < 1:
                raise IpwError(f"{loc(key)}: must be >= 1, got {fields[key]}")
        for key in ("name", "model"):
            if key not in fields:
                raise IpwError(f"{path}{f':{header}' if header else ''}: field '{prefix}{key}': required")
        fields["name"] = check_name(fields["name"], loc("name"))
        if fields["name"] in names:
            raise IpwError(f"{loc('name')}: duplicate backend name {fields['name']!r}")
        alike = skeletons.setdefault(name_skeleton(fields["name"]), fields["name"])
        if alike != fields["name"]:
            raise IpwError(f"{loc('name')}: {ascii(fields['name'])} prints like the backend name {ascii(alike)}; "
                           "give names that can be told apart")
        names.add(fields["name"])
        role = fields.get("role", "local")
        if role not in ROLES:
            raise IpwError(f"{loc('role')}: must be one of {', '.join(ROLES)}")
        mode = fields.get("mode")
        if mode is not None and mode not in MODES:
            raise IpwError(f"{loc('mode')}: must be one of {', '.join(MODES)}")
        options = {k: v for k, v in fields.items() if k not in _BACKEND}
        backends.append(BackendSpec(fields["name"], kind, fields["model"], role, mode, options))
    register_secret_envs(backends, top.get("judge"))
    vs = top["judge"].vs_backend if top.get("judge") else None
    if vs is not None and vs not in names:
        raise IpwError(f"{where('judge.grading', 'grading')}: vs-backend:{vs} names no backend of this config "
                       f"(backends: {', '.join(sorted(names))})")
    return RunConfig(backends=tuple(backends), generation=GenerationSettings(**gen), source=path, **top)


def register_secret_envs(backends, judge) -> None:
    """Every variable a config names as ``api_key_env`` holds a secret: no worker or server inherits it."""
    from ipw.sanitize import register_env

    for spec in list(backends) + ([judge.backend] if judge is not None else []):
        env = spec.options.get("api_key_env")
        if isinstance(env, str):
            register_env(env)


def parse_judge_table(table: dict, path: str, text: str) -> JudgeSpec:
    """The ``[judge]`` table: a backend (``kind``, ``model``, ``name``, ``mode`` and the kind's engine
    options) plus ``grading`` (reference | pairwise | vs-backend:NAME), ``prompt`` (a version in ipw/judge_prompts or a
    .txt path), ``max_tokens`` and ``usd_per_mtok_in``/``usd_per_mtok_out`` (the judge's prices)."""
    where = _Where(path, text)
    after = next((i for i, ln in enumerate(where.lines) if ln.strip().startswith("[judge]")), 0)

    def loc(key: str) -> str:
        return where(f"judge.{key}", key, after)

    kind = table.get("kind")
    if kind not in backend_kinds():
        raise IpwError(f"{loc('kind')}: unknown backend kind {kind!r} (known: {', '.join(backend_kinds())})")
    allowed = {**_JUDGE, **backend_options(kind)}
    fields = {}
    for key, value in table.items():
        if key not in allowed:
            raise IpwError(f"{loc(key)}: unknown key (allowed: {', '.join(sorted(allowed))})")
        fields[key] = _check_type(value, allowed[key], loc(key))
    if "model" not in fields:
        raise IpwError(f"{path}: field 'judge.model': required")
    if fields.get("mode", "chat") not in MODES:
        raise IpwError(f"{loc('mode')}: must be one of {', '.join(MODES)}")
    if "grading" in fields:
        fields["grading"] = check_grading(fields["grading"], loc("grading"))
    if fields.get("max_tokens", 1) < 1:
        raise IpwError(f"{loc('max_tokens')}: must be >= 1")
    for key in _AT_LEAST_ONE:
        if key in fields and fields[key] < 1:
            raise IpwError(f"{loc(key)}: must be >= 1, got {fields[key]}")
    backend = BackendSpec(fields.get("name", f"judge:{kind}:{Path(fields['model']).stem}"), kind, fields["model"],
                          "local", fields.get("mode"), {k: v for k, v in fields.items() if k not in _JUDGE})
    return JudgeSpec(backend, **{k: v for k, v in fields.items() if k in _JUDGE and k not in _BACKEND})


def load_judge_config(path: str) -> JudgeSpec:
    """The ``[judge]`` table of a TOML file (a run config or a file with only that table)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        raw = tomllib.loads(text)
    except (OSError, UnicodeDecodeError) as exc:
        raise IpwError(f"{path}: cannot read config ({exc.__class__.__name__})") from None
    except tomllib.TOMLDecodeError as exc:
        raise IpwError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise IpwError(f"{path}: invalid TOML: nested too deeply") from None
    if not isinstance(raw.get("judge"), dict):
        raise IpwError(f"{path}: field 'judge': no [judge] table")
    return parse_judge_table(raw["judge"], path, text)


def load_config(path: str | None) -> RunConfig:
    target = Path(path) if path else EMBEDDED_DEFAULT
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise IpwError(f"{target}: config file not found") from None
    except (PermissionError, IsADirectoryError, UnicodeDecodeError) as exc:
        raise IpwError(f"{target}: cannot read config ({exc.__class__.__name__})") from None
    return parse_config(text, str(path) if path else "<embedded default>")


def apply_overrides(config: RunConfig, given: dict[str, Any]) -> RunConfig:
    """The run options given on the command line (``ipw.options.RUN_OPTIONS``, by name; None or empty: not
    given) win over the config.  ``backend`` picks configured backends by name, or adds one given as
    ``KIND:MODEL`` (e.g. ``llama-cpp:smollm2-135m``).  ``concurrency`` (``1,4,16``) sweeps those levels on
    every backend that serves concurrent requests (an OpenAI-compatible server); in-process engines stay
    at their own."""
    given = {name: value for name, value in given.items() if value is not None and value != []}
    changes: dict[str, Any] = {}
    for name, value in given.items():
        option = RUN[name]  # a KeyError: a caller's typo, not the user's
        option.check(value, option.flags[0])  # the CLI checked it as it parsed; an API caller too
        if option.key:
            changes[option.key] = option.field_value(value)
    if "dataset_preset" in given:
        from ipw.inputs.presets import get_preset

        get_preset(given["dataset_preset"])
    backends, seed, concurrency = given.get("backend"), given.get("seed"), given.get("concurrency")
    if backends:
        by_name = {b.name: b for b in config.backends}
        chosen = []
        for item in backends:
            if item in by_name:
                chosen.append(by_name[item])
            elif ":" in item:
                kind, model = item.split(":", 1)
                if kind not in backend_kinds():
                    raise IpwError(f"--backend {item}: unknown backend kind {kind!r} (known: {', '.join(backend_kinds())})")
                chosen.append(BackendSpec(name=f"{kind}:{Path(model).stem}", kind=kind, model=model))
            else:
                raise IpwError(f"--backend {item}: no backend of that name in {config.source} "
                               f"(configured: {', '.join(by_name)}; or give KIND:MODEL)")
        changes["backends"] = tuple(chosen)
    if seed is not None:
        changes["generation"] = dataclasses.replace(config.generation, seed=seed)
    if concurrency is not None:
        levels = parse_levels(concurrency, "--concurrency")
        chosen = changes.get("backends", config.backends)
        serving = [b for b in chosen if "concurrency" in backend_options(b.kind)]
        if not serving:
            raise IpwError(f"--concurrency {concurrency}: no backend of this run serves concurrent requests "
                           f"({', '.join(f'{b.name} ({b.kind})' for b in chosen)}); a sweep needs kind = \"openai\"")
        changes["backends"] = tuple(
            dataclasses.replace(b, options={**b.options, "concurrency": list(levels)}) if b in serving else b
            for b in chosen)
    return dataclasses.replace(config, **changes)


def parse_levels(text: str, where: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16): concurrency levels, checked as a config's ``concurrency`` is."""
    from ipw.backends.openai_http import concurrency_levels

    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise IpwError(f"{where} {text!r}: expected requests in flight as whole numbers, e.g. 1,4,16,64") from None
    return concurrency_levels(levels, where=f"{where} {text!r}")
