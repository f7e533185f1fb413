"""The router file (``ipw.analysis.router``): a trained router, written as JSON (never pickle: ``FORMAT``, the ipw
version, the date, the hashing parameters, each classifier's intercept and non-zero coefficients, the default
threshold, what it was trained on), and read back checked whole against what this ipw writes (issue 55)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ipw.analysis.stats import Estimate
from ipw.errors import IpwError, ParameterError
from ipw.analysis.router.data import GRADINGS, RouteData, check_threshold
from ipw.analysis.router.evaluate import DEFAULT_THRESHOLD, MIN_QUERIES, CurvePoint, PolicyScore, check_trainable
from ipw.analysis.router.model import C, FEATURES, N_FEATURES, NGRAM_RANGE, Featurizer, Linear, fit

FORMAT = "ipw-router"
FORMAT_VERSION = 1



@dataclass(frozen=True)
class Router:
    featurizer: Featurizer
    local: tuple[str, ...]  # cheapest first
    cloud: str
    models: tuple[Linear, ...]
    threshold: float = DEFAULT_THRESHOLD
    meta: dict[str, Any] = field(default_factory=dict)
    _vectorizer: Any = field(default=None, compare=False, repr=False)
    _analyzer: Any = field(default=None, compare=False, repr=False)

    def probabilities(self, prompt: str, category: str | None = None) -> dict[str, float]:
        """Each local backend's probability of answering as well as the cloud (the same numbers as
        ``Featurizer.transform`` and ``Linear.proba``, without building the stacked matrix: ~0.1 ms)."""
        f = self.featurizer
        idx, val = self._hashed(prompt)
        length = math.log1p(len(prompt)) / 10.0
        cat = f.categories.index(category) if category in f.categories else -1
        out = {}
        for name, m in zip(self.local, self.models):
            z = m.intercept + float(np.dot(m.coef[idx], val)) + m.coef[f.n_features] * length
            if cat >= 0:
                z += m.coef[f.n_features + 1 + cat]
            out[name] = 1.0 / (1.0 + math.exp(-min(max(z, -500.0), 500.0)))
        return out

    def _hashed(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's hashed n-gram columns and values, as ``HashingVectorizer.transform`` makes them (its
        analyzer, murmurhash3_32 with seed 0, counts, L2 norm), without its per-call validation (~10x faster)."""
        if self._vectorizer is None:
            object.__setattr__(self, "_vectorizer", self.featurizer.vectorizer())
        if self._analyzer is None:
            from sklearn.utils import murmurhash3_32

            object.__setattr__(self, "_analyzer", (self._vectorizer.build_analyzer(), murmurhash3_32))
        analyze, murmur = self._analyzer
        n = self.featurizer.n_features
        counts: dict[int, float] = {}
        for token in analyze(prompt):
            h = murmur(token, seed=0)
            j = (2147483647 if h == -2147483648 else abs(h)) % n
            counts[j] = counts.get(j, 0.0) + 1.0
        idx = np.fromiter(counts.keys(), np.int64, len(counts))
        val = np.fromiter(counts.values(), float, len(counts))
        norm = math.sqrt(float(val @ val))
        return idx, (val / norm if norm else val)

    def route(self, prompt: str, category: str | None = None, threshold: float | None = None) -> str:
        """The backend a prompt goes to: the cheapest local one predicted to answer as well, else the cloud."""
        t = self.threshold if threshold is None else threshold
        for name, p in self.probabilities(prompt, category).items():
            if p >= t:
                return name
        return self.cloud

    def to_json(self) -> dict[str, Any]:
        from ipw import __version__

        def sparse(m: Linear) -> dict[str, Any]:
            nz = np.flatnonzero(m.coef)
            return {"intercept": m.intercept, "index": nz.tolist(), "value": m.coef[nz].tolist()}

        return {"format": FORMAT, "format_version": FORMAT_VERSION, "ipw_version": __version__,
                "created": self.meta.get("created") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "features": self.featurizer.to_json(), "threshold": self.threshold, "local": list(self.local),
                "cloud": self.cloud, "classifiers": {n: sparse(m) for n, m in zip(self.local, self.models)},
                "trained_on": self.meta.get("trained_on", {}), "training": self.meta.get("training", {}),
                "scores": self.meta.get("scores", {})}


def train(data: RouteData, *, threshold: float = DEFAULT_THRESHOLD, c: float = C, min_queries: int = MIN_QUERIES,
          where: str = "the runs") -> Router:
    """The router trained on every query of ``data`` (score it with ``score_router``, never on these)."""
    check_threshold(threshold)
    check_trainable(data, min_queries, where)
    if len(data.local) > MAX_LOCAL:  # a file its loader would refuse
        raise IpwError(f"{where}: {len(data.local)} local backends; a router chooses among at most {MAX_LOCAL} (name "
                       "them with --local)")
    featurizer = Featurizer(tuple(sorted({x for x in data.category if x})) if data.has_categories else ())
    x = featurizer.transform(data.prompts, data.category)
    models = tuple(fit(x, data.label[:, b], featurizer.width, c) for b in range(len(data.local)))
    meta = {"trained_on": data.trained_on, "training": {"C": c, "class_weight": "balanced", "solver": "liblinear",
                                                       "label": data.grading, "min_queries": min_queries}}
    return Router(featurizer, data.local, data.cloud, models, threshold, meta)


def _temporary(path: Path) -> Path:
    """The temporary file a router is written to before it is renamed over ``path`` (the same folder: the rename
    stays on one file system, atomic)."""
    return path.with_name(f".{path.name}.tmp")


def check_out(path: Path, option: str = "out") -> None:
    """``path`` can be replaced by a router file (before any training): not a folder, a symbolic link (the
    rename would replace the link, not its target), a FIFO or a device (/dev/full), and a file can be made
    beside it (not /proc, a read-only file system)."""
    if path.is_symlink():
        raise ParameterError((option,), f" {path}: is a symbolic link; give the file itself")
    if path.is_dir():
        raise ParameterError((option,), f" {path}: is a folder; give the router file to write (router.json)")
    if path.exists() and not path.is_file():
        raise ParameterError((option,), f" {path}: not a regular file (a FIFO, a device); give the router file to write")
    if not path.parent.is_dir():
        raise ParameterError((option,), f" {path}: its folder {path.parent} does not exist")
    tmp = _temporary(path)
    try:
        tmp.open("w").close()
        tmp.unlink()
    except OSError as exc:
        raise ParameterError((option,), f" {path}: cannot make a file in {path.parent} "
                             f"({exc.strerror or type(exc).__name__})") from None


def save(router: Router, path: str | Path) -> None:
    """Write the router file atomically (``ipw.results``' temporary-file-and-rename, the file fsynced before
    the rename): a full disk or a file size limit leaves the old file as it was, and one line."""
    from ipw.results import atomic_write

    path = Path(path)
    text = json.dumps(router.to_json(), indent=1) + "\n"

    def write(tmp: Path) -> None:
        try:
            with tmp.open("w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:  # the run folders' message would say ipw run --resume: this one says what is left
            raise IpwError(f"{path}: cannot write the router file ({exc.strerror or type(exc).__name__}); the "
                           "file is as it was") from None

    atomic_write(path, _temporary(path), write)


# --- reading a router file: the whole file checked against what this ipw writes (issue 55) ----------------------
# a router file comes from outside: every field is checked before one is used, so that a damaged or hostile file
# is one line naming its field (exit 2), never a crash, a hang, a memory blow-up or a silent one-sided router
MAX_LOCAL = 16  # local backends: each one's dense coefficients take 2 MB (2^18 floats)
# a router of MAX_LOCAL backends, each with all its 2^18 coefficients (~10 MB as written), fits
MAX_ROUTER_BYTES = 256 * 2 ** 20
MAX_DEPTH = 32  # the file's own nesting is under 10 (scores.kfold.curve[i].accuracy.value)
MAX_CATEGORIES = 4096
MAX_COEF = 1e6  # |coefficient|, |intercept|: a logistic regression at C=1 gives ~10; any sum of these stays finite
TOP_FIELDS = ("format", "format_version", "ipw_version", "created", "features", "threshold", "local", "cloud",
              "classifiers", "trained_on", "training", "scores")


class _Doc:
    """Typed reads of a router document, each failure one line: ``PATH: field 'a.b': problem``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def bad(self, name: str, problem: str) -> IpwError:
        return IpwError(f"{self.path}: field '{name}': {problem}")

    def get(self, obj: dict[str, Any], key: str, name: str) -> Any:
        if key not in obj:
            raise self.bad(name, "required")
        return obj[key]

    def object(self, obj: dict[str, Any], key: str, name: str) -> dict[str, Any]:
        value = self.get(obj, key, name)
        if not isinstance(value, dict):
            raise self.bad(name, "must be an object")
        return value

    def strings(self, obj: dict[str, Any], key: str, name: str, most: int) -> list[str]:
        value = self.get(obj, key, name)
        if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
            raise self.bad(name, "must be a list of strings")
        if len(value) > most or len(set(value)) < len(value):
            raise self.bad(name, f"must hold at most {most} names, each once")
        return value

    def integers(self, value: Any, name: str, low: int, high: int) -> list[int]:
        """A list of whole numbers from ``low`` to ``high`` (a JSON true is not 1)."""
        if not (isinstance(value, list) and all(type(x) is int for x in value)):
            raise self.bad(name, "must be a list of whole numbers")
        if not all(low <= x <= high for x in value):  # Python ints: 10**30 compares, nothing overflows
            raise self.bad(name, f"must be from {low} to {high}")
        return value

    def numbers(self, value: Any, name: str, low: float, high: float) -> np.ndarray:
        """A list of finite numbers from ``low`` to ``high`` (NaN and infinities fail the comparison)."""
        if not (isinstance(value, list) and all(type(x) in (int, float) for x in value)):
            raise self.bad(name, "must be a list of numbers")
        if not all(low <= x <= high for x in value):
            raise self.bad(name, f"must be finite, from {low:g} to {high:g}")
        return np.asarray(value, float)

    def integer(self, obj: dict[str, Any], key: str, name: str, low: int, high: int) -> int:
        return self.integers([self.get(obj, key, name)], name, low, high)[0]

    def number(self, obj: dict[str, Any], key: str, name: str, low: float, high: float) -> float:
        return float(self.numbers([self.get(obj, key, name)], name, low, high)[0])

    def name(self, value: Any, name: str) -> str:
        """A backend name, checked as ``--name`` and a config's backend names are (no CR LF for a header, no
        ``::error`` line, no bidi override)."""
        from ipw.limits import check_name

        if not isinstance(value, str):
            raise self.bad(name, "must be a string")
        if check_name(value, f"{self.path}: field '{name}'") != value:
            raise self.bad(name, f"{ascii(value)} is not NFC-normalised, as ipw writes backend names")
        return value


def _depth(doc: Any) -> int:
    """The nesting depth of a parsed JSON value, counted up to MAX_DEPTH + 1 (iteratively: no recursion)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        x, d = todo.pop()
        deepest = max(deepest, d)
        if d <= MAX_DEPTH:
            todo += [(v, d + 1) for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())]
    return deepest


def _read_document(path: Path) -> dict[str, Any]:
    """The file's JSON object: read up to MAX_ROUTER_BYTES (/dev/zero ends), parsed, its depth bounded."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_ROUTER_BYTES + 1)
    except FileNotFoundError:
        raise IpwError(f"{path}: no such router file") from None
    except OSError as exc:
        raise IpwError(f"{path}: cannot read the router file ({exc.__class__.__name__})") from None
    if len(raw) > MAX_ROUTER_BYTES:
        raise IpwError(f"{path}: larger than {MAX_ROUTER_BYTES // 2 ** 20} MiB, the most a router file holds: not "
                       "a router file")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise IpwError(f"{path}: cannot read the router file (not UTF-8)") from None
    except json.JSONDecodeError as exc:
        raise IpwError(f"{path}: not a router file (invalid JSON at line {exc.lineno}: {exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # an integer of 5,000 digits; nesting past the parser's stack
        raise IpwError(f"{path}: not a router file (invalid JSON: {str(exc).splitlines()[0][:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise IpwError(f"{path}: not an ipw router file (no \"format\": \"{FORMAT}\")")
    return doc


def load_router(path: str | Path) -> Router:
    """A router file, validated whole against what this ipw writes (``Router.to_json``): an IpwError naming the
    file and the field. ``ipw route score``, ``ipw compare --router`` and ``ipw serve --route`` all read it here."""
    from ipw.limits import name_skeleton
    from ipw.sanitize import one_line

    path = Path(path)
    doc = _read_document(path)
    if doc.get("format_version") != FORMAT_VERSION or type(doc.get("format_version")) is not int:
        version = doc.get("format_version")
        made = doc.get("ipw_version")
        raise IpwError(f"{path}: router format version {version if type(version) is int else '?'} (made by ipw "
                       f"{one_line(made)[:40] if isinstance(made, str) else '?'}); this ipw reads version "
                       f"{FORMAT_VERSION}: retrain it with ipw route train")
    d = _Doc(path)
    for key, value in doc.items():
        if key not in TOP_FIELDS:
            raise d.bad(one_line(key)[:40], "unknown field")
        if _depth(value) > MAX_DEPTH:  # a value nested this deep could not be written (or shown) without recursion
            raise d.bad(key, f"nested deeper than {MAX_DEPTH} levels")
    for key in ("ipw_version", "created"):
        if not isinstance(d.get(doc, key, key), str):
            raise d.bad(key, "must be a string")
    meta = {k: d.object(doc, k, k) for k in ("trained_on", "training", "scores")}

    feats = d.object(doc, "features", "features")
    kinds = d.strings(feats, "features", "features.features", len(FEATURES))
    unknown = [f for f in kinds if f not in FEATURES]
    if unknown:
        raise IpwError(f"{path}: the router uses features this ipw cannot supply: {one_line(', '.join(unknown))[:80]}")
    if feats.get("kind") != "sklearn.HashingVectorizer":
        raise IpwError(f"{path}: the router's features are {one_line(repr(feats.get('kind')))[:40]}, this ipw "
                       "supplies sklearn.HashingVectorizer")
    categories = tuple(d.strings(feats, "categories", "features.categories", MAX_CATEGORIES))
    n_features = d.integer(feats, "n_features", "features.n_features", 1, N_FEATURES)
    ngrams = d.integers(d.get(feats, "ngram_range", "features.ngram_range"), "features.ngram_range", 1, NGRAM_RANGE[1])
    if len(ngrams) != 2 or ngrams[0] > ngrams[1]:
        raise d.bad("features.ngram_range", f"must be [low, high], 1 <= low <= high <= {NGRAM_RANGE[1]}")
    featurizer = Featurizer(categories, n_features, (ngrams[0], ngrams[1]))
    # the rest of the features' description is what this ipw computes: a file that says otherwise asks for
    # features it would not get
    for key, value in featurizer.to_json().items():
        if key not in ("n_features", "ngram_range", "categories") and \
                (d.get(feats, key, f"features.{key}") != value or type(feats[key]) is not type(value)):
            raise d.bad(f"features.{key}", f"must be {json.dumps(value)}, what this ipw computes")
    unknown = [k for k in feats if k not in featurizer.to_json()]
    if unknown:
        raise d.bad(f"features.{one_line(unknown[0])[:40]}", "unknown field")

    threshold = d.number(doc, "threshold", "threshold", 0.0, 1.0)
    local = d.get(doc, "local", "local")
    if not (isinstance(local, list) and 1 <= len(local) <= MAX_LOCAL):
        raise d.bad("local", f"must be a list of 1 to {MAX_LOCAL} backend names")
    local = [d.name(x, "local") for x in local]
    cloud = d.name(d.get(doc, "cloud", "cloud"), "cloud")
    names: set[str] = set()
    skeletons: dict[str, str] = {}
    for field_, name in [("local", x) for x in local] + [("cloud", cloud)]:  # as a config's names are
        if name in names:
            raise d.bad(field_, f"duplicate backend name {name!r}")
        alike = skeletons.setdefault(name_skeleton(name), name)
        if alike != name:
            raise d.bad(field_, f"{ascii(name)} prints like the backend name {ascii(alike)}; give names that can be "
                                "told apart")
        names.add(name)
    classifiers = d.object(doc, "classifiers", "classifiers")
    extra = [k for k in classifiers if k not in local]
    if extra:
        raise d.bad(f"classifiers.{one_line(extra[0])[:40]}", "no such local backend")
    models = []
    for name in local:
        where = f"classifiers.{name}"
        m = d.object(classifiers, name, where)
        unknown = [k for k in m if k not in ("intercept", "index", "value")]
        if unknown:
            raise d.bad(f"{where}.{one_line(unknown[0])[:40]}", "unknown field")
        index = d.integers(d.get(m, "index", f"{where}.index"), f"{where}.index", 0, featurizer.width - 1)
        value = d.numbers(d.get(m, "value", f"{where}.value"), f"{where}.value", -MAX_COEF, MAX_COEF)
        if any(b <= a for a, b in zip(index, index[1:])):
            raise d.bad(f"{where}.index", "must be increasing (each feature once)")
        if len(value) != len(index):
            raise d.bad(f"{where}.value", f"{len(value)} values for {len(index)} indices")
        coef = np.zeros(featurizer.width)
        coef[np.asarray(index, np.int64)] = value
        models.append(Linear(d.number(m, "intercept", f"{where}.intercept", -MAX_COEF, MAX_COEF), coef))

    training = meta["training"]  # what ``router_scores`` retrains with
    if "label" in training and training["label"] not in GRADINGS:
        raise d.bad("training.label", f"must be one of {', '.join(GRADINGS)}")
    if "C" in training:
        d.number(training, "C", "training.C", 1e-6, MAX_COEF)
    if "min_queries" in training:
        d.integer(training, "min_queries", "training.min_queries", 0, 10 ** 300)  # any count: it only refuses
    return Router(featurizer, tuple(local), cloud, tuple(models), threshold,
                  {**meta, "created": doc["created"], "ipw_version": doc["ipw_version"]}, featurizer.vectorizer())


def check_runs_supply(router: Router, data: RouteData, path: str | Path) -> None:
    """The runs can supply the router's features (its categories need runs with categories)."""
    if router.featurizer.categories and not data.has_categories:
        raise IpwError(f"{path}: the router uses the query category as a feature, and these runs' queries have "
                       "no category")


def scores_json(s: PolicyScore) -> dict[str, Any]:
    def ci(x: Estimate | None) -> dict[str, float] | None:
        return None if x is None else {"value": x.value, "lo": x.lo, "hi": x.hi}

    def pt(p: CurvePoint) -> dict[str, Any]:
        return {"threshold": p.threshold, "local_share": ci(p.local_share), "accuracy": ci(p.accuracy),
                "accuracy_loss": ci(p.accuracy_loss), "energy_saved_fraction": ci(p.energy_saved_fraction),
                "latency_saved_fraction": ci(p.latency_saved_fraction),
                "cost_saved_fraction": ci(p.cost_saved_fraction), "pgr": None if not np.isfinite(p.pgr) else p.pgr}

    def num(x: float | None) -> float | None:
        return None if x is None or not np.isfinite(x) else x

    return {"name": s.name, "protocol": s.protocol, "n_queries": s.n_queries, "local": list(s.local),
            "cloud": s.cloud, "cloud_accuracy": num(s.cloud_accuracy), "local_only_accuracy": num(s.local_only_accuracy),
            "auc": {k: num(v) for k, v in s.auc.items()}, "apgr": num(s.apgr),
            "local_share_at_50pct_gap": s.local_share_at_50, "local_share_at_80pct_gap": s.local_share_at_80,
            "operating_point": pt(s.operating_point), "operating_reason": s.operating_reason,
            "curve": [pt(p) for p in s.curve], "by_category": list(s.by_category), "notes": list(s.notes)}
