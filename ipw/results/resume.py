"""What ``--resume`` reads: the queries a large run kept (``KeptQueries``) and the keys of the records already
in the log (``DoneKeys``), read fast from the log's framed lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, cast

from ipw.errors import IpwError
from ipw.results.schema import KEY_FIELDS
from ipw.results.files import atomic_write, complete_length, own_file
from ipw.results.manifest import RunManifest

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    import numpy as np
    import pyarrow as pa


QUERIES_FILE = "queries.parquet"  # a large run's query set as loaded, so that --resume need not parse it again


#: What builds a query from a row of queries.parquet (id, prompt, answer, choices, category, scorer): the inputs'
#: ``ipw.inputs.datasets.Query``, given by the caller, as the run folder never imports the inputs layer (issue 57).
MakeQuery = Callable[[str, str, str, "tuple[str, ...] | None", str, str], Any]


def read_kept_queries(run_dir: str | Path, manifest: RunManifest, source: Path | None,
                      make_query: MakeQuery) -> KeptQueries | None:
    """A large run's queries as it loaded them (``RunFolder.keep_queries``), when neither the dataset file
    (``source``: the file the run's config names, resolved by the caller; None when it names none), nor that
    copy, nor ipw's version changed since; else None (the dataset is loaded again)."""
    from ipw import __version__

    entry = manifest.dataset or {}
    copy = Path(run_dir) / QUERIES_FILE
    if not entry.get("queries_file") or manifest.ipw_version != __version__ or not copy.is_file():
        return None
    try:
        if source is None or not source.is_file() or file_sha256(source) != entry.get("file_sha256") \
                or file_sha256(copy) != entry.get("queries_sha256"):
            return None
    except (IpwError, OSError):
        return None
    return KeptQueries.read(copy, entry.get("name", ""), entry["fingerprint"], make_query)


def file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(own_file(path), "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def write_queries(path: Path, queries: list[Any]) -> str:
    """The run's queries (``ipw.inputs.datasets.Query``) as Parquet; returns the file's sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": [q.id for q in queries], "prompt": [q.prompt for q in queries], "answer": [q.answer for q in queries],
        "choices": pa.array([list(q.choices) if q.choices else None for q in queries], type=pa.list_(pa.string())),
        "category": [q.category for q in queries], "scorer": [q.scorer for q in queries],
    })
    atomic_write(path, path.with_suffix(".parquet.tmp"), lambda tmp: pq.write_table(table, tmp))
    return file_sha256(path)


@dataclass(frozen=True)
class KeptQueries:
    """A run's copy of its queries (queries.parquet, ``write_queries``) as an Arrow table: ``--resume``
    builds ``Query`` objects only for the rows it runs (``take``), found by their ``ids`` (``DoneKeys.left``).
    ``name`` and ``fingerprint``: the manifest's ``dataset`` entry, which the copy was checked against;
    ``make_query``: what builds each ``Query`` (``MakeQuery``)."""

    table: pa.Table
    name: str
    fingerprint: str
    make_query: MakeQuery

    @classmethod
    def read(cls, path: Path, name: str, fingerprint: str, make_query: MakeQuery) -> "KeptQueries":
        import pyarrow.parquet as pq

        # (read_table would import pandas)
        return cls(pq.ParquetFile(own_file(path)).read(), name, fingerprint, make_query)

    def __len__(self) -> int:
        return self.table.num_rows

    def ids(self) -> pa.Array[Any]:
        return self.table.column("id").combine_chunks()

    def take(self, rows: np.ndarray) -> list[Any]:
        """The query (``make_query``) of each row (numpy integers), in the order given."""
        import gc

        import numpy as np
        import pyarrow as pa

        index = pa.py_buffer(np.asarray(rows, np.int64).tobytes())  # as Arrow's (pa.array would import pandas)
        cols = self.table.take(pa.Array.from_buffers(pa.int64(), len(rows), [None, index])).to_pydict()
        enabled = gc.isenabled()
        gc.disable()  # a million new objects: the collector would walk them again and again (a third of the time)
        try:
            make = self.make_query
            return [make(i, p, a, tuple(c) if c else None, cat, sc) for i, p, a, c, cat, sc in
                    zip(cols["id"], cols["prompt"], cols["answer"], cols["choices"], cols["category"], cols["scorer"])]
        finally:
            if enabled:
                gc.enable()


Group = tuple[str, int, int]  # (backend, repeat, concurrency): the records of one pass over the queries


@dataclass(frozen=True)
class DoneKeys:
    """What a run's log holds (``record_keys``): the distinct ids of the queries done in each (backend,
    repeat, concurrency), as Arrow string arrays (a million of them: no Python tuple per record).  As a
    collection: its (backend, query_id, repeat, concurrency) keys."""

    ids: dict[Group, pa.Array[Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, keys: Iterable[tuple[str, str, int, int]]) -> "DoneKeys":
        """From (backend, query_id, repeat, concurrency) keys."""
        import pyarrow as pa

        groups: dict[Group, set[str]] = {}
        for backend, query_id, repeat, level in keys:
            groups.setdefault((backend, int(repeat), int(level)), set()).add(query_id)
        return cls({g: pa.array(sorted(ids), pa.string()) for g, ids in groups.items()})

    @classmethod
    def from_columns(cls, backend: pa.Array[Any], query_id: pa.Array[Any], repeat: pa.Array[Any],
                     level: pa.Array[Any]) -> "DoneKeys":
        """From a log's key columns (no nulls): Arrow's kernels once per (backend, repeat, level) there is
        (a few).  Only Arrow values go in: Arrow's group_by, or a Python value given to a kernel, would
        import pandas (half a second of a resume)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        repeat, level = pc.cast(repeat, pa.int64()), pc.cast(level, pa.int64())
        ids: dict[Group, pa.Array[Any]] = {}
        for b in pc.unique(backend):
            of_b = pc.equal(backend, b)
            for r in pc.unique(repeat.filter(of_b)):
                of_br = pc.and_(of_b, pc.equal(repeat, r))
                for c in pc.unique(level.filter(of_br)):
                    group = (cast(str, b.as_py()), cast(int, r.as_py()), cast(int, c.as_py()))
                    ids[group] = pc.unique(query_id.filter(pc.and_(of_br, pc.equal(level, c))))
        return cls(ids)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self.ids.values())

    def __iter__(self) -> Iterator[tuple[str, str, int, int]]:
        for (backend, repeat, level), ids in self.ids.items():
            for query_id in cast("list[str]", ids.to_pylist()):
                yield backend, query_id, repeat, level

    def __contains__(self, key: object) -> bool:
        backend, query_id, repeat, level = cast("tuple[str, str, int, int]", key)
        return query_id in self.done_ids(backend, repeat, level)

    def done_ids(self, backend: str, repeat: int, level: int) -> frozenset[str]:
        """The ids done in one (backend, repeat, concurrency), as a Python set."""
        ids = self.ids.get((backend, repeat, level))
        return frozenset() if ids is None else frozenset(cast("list[str]", ids.to_pylist()))

    def left(self, ids: pa.Array[Any], groups: Iterable[Group]) -> np.ndarray:
        """Which of the queries ``ids`` (a run's, in order) still have a record to make in any of ``groups``
        (each backend's repeats and concurrency levels): a boolean mask, Arrow's ``is_in`` per group."""
        import numpy as np
        import pyarrow.compute as pc

        import pyarrow as pa

        left = np.zeros(len(ids), dtype=bool)
        for group in groups:
            done = self.ids.get(group)
            if done is None:
                return np.ones(len(ids), dtype=bool)
            found = pc.cast(pc.is_in(ids, value_set=done), pa.uint8())  # (to_numpy would import pandas)
            left |= np.frombuffer(memoryview(cast("pa.Buffer", found.buffers()[1])), np.uint8, len(found), found.offset) == 0
        return left


def record_keys(path: Path) -> DoneKeys | None:
    """(backend, query_id, repeat, concurrency) of every record of a ``records.jsonl`` (``--resume``: what is
    done); None when any line is not a complete record (then ``read_records`` names it).  A torn last line
    is left out, as by ``read_records``.

    Fast path (``_framed_keys``): the lines ``QueryRecord.to_json`` writes are read by their frame only, the
    fields before ``repeat`` and after ``concurrency``, without parsing the JSON between (for 500,000
    records of the fake engine, 2.7 CPU seconds instead of 5.5 on a loaded 2-core VM).  A line whose frame
    is not that (an older record, an escaped key, damage) sends the whole log through Arrow's JSON reader,
    which parses every line.  The JSON between the frames is
    parsed when records.parquet is written (``RunFolder.finish``), where a damaged line is named."""
    import pyarrow as pa

    try:
        whole = complete_length(own_file(path))  # a torn last line is left out, as by read_records
        if whole == 0:
            return DoneKeys()
        with pa.memory_map(str(path)) as mm:
            data = mm.read_buffer(whole)
            keys = _framed_keys(data)
            return keys if keys is not None else _json_keys(data)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
        return None


_STR = r'"(?:[^"\\]|\\.)*"'  # a JSON string
_HEAD = (r'^\{"run_id": ' + _STR + r', "backend": "(?P<backend>[^"\\]*)", "model": ' + _STR + r', "role": ' + _STR
         + r', "query_id": "(?P<query_id>[^"\\]*)", "category": ' + _STR + r', "repeat": (?P<repeat>\d+), ')
_TAIL = r', "concurrency": (?P<concurrency>\d+), "split_method": ' + _STR + r', "split_uncertainty_j": [^,"]+\}\n$'
_TAIL_BYTES = 160  # the end of a line, which holds concurrency and the fields after it


def _framed_keys(data: pa.Buffer) -> DoneKeys | None:
    """The keys of the log ``data`` (complete lines) from each line's head and tail (``record_keys``), or
    None when a line does not have the frame ``QueryRecord.to_json`` writes.  Lines are found with numpy and
    matched by Arrow's regular expressions (RE2, anchored: only each line's first and last bytes are read)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    step, view = 1 << 26, memoryview(data)
    ends = [np.flatnonzero(np.frombuffer(view, np.uint8, min(step, data.size - at), at) == 10) + (at + 1)
            for at in range(0, data.size, step)]
    offsets = np.concatenate([np.zeros(1, np.int64), *ends]).astype(np.int64)
    lines = pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(offsets) - 1,
                                             [None, pa.py_buffer(offsets.tobytes()), data])
    head = pc.extract_regex(lines.cast(pa.large_string()), _HEAD)  # the cast checks UTF-8
    tail = pc.extract_regex(pc.binary_slice(lines, -_TAIL_BYTES), _TAIL)
    if head.null_count or tail.null_count:
        return None
    return DoneKeys.from_columns(head.field("backend"), head.field("query_id"), head.field("repeat"),
                                 tail.field("concurrency"))  # no nulls (above)


def _json_keys(data: pa.Buffer) -> DoneKeys | None:
    """The keys of the log ``data`` with every line parsed by Arrow's JSON reader (C++, 10-20x faster
    than Python's json for a large log)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    fields: list[tuple[str, pa.DataType]] = [("backend", pa.string()), ("query_id", pa.string()),
                                             ("repeat", pa.int64()), ("concurrency", pa.int64())]
    schema = pa.schema(fields)
    table = pj.read_json(pa.BufferReader(data),  # type: ignore[arg-type]  # pyarrow-stubs 20: any NativeFile works
                         read_options=pj.ReadOptions(block_size=1 << 24),
                         parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"))
    if any(table.column(k).null_count for k in KEY_FIELDS):
        return None
    backend, query_id, repeat, given = (table.column(k).combine_chunks() for k in (*KEY_FIELDS, "concurrency"))
    level = pc.fill_null(pc.if_else(pc.equal(given, pa.scalar(0)), 1, given), 1)  # absent (older runs) or 0: 1
    return DoneKeys.from_columns(backend, query_id, repeat, level)
