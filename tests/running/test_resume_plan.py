"""``--resume``'s plan (``runner.plan_resume``): the queries left are found by id in Arrow (``DoneKeys.left``)
before any ``Query`` is built; each backend's to-do list (``runner.work_left``) is the one the old way
gave: every (backend, query, repeat, concurrency) key without a record, from a set of all the keys."""

import json
import random

import pytest
from runfolders import create, record

from ipw.backends.base import BackendSpec
from ipw.inputs.config import RunConfig
from ipw.inputs.datasets import Query, QuerySet
from ipw.errors import IpwError
from ipw.results import DoneKeys, KeptQueries, write_queries
from ipw.running.runner import plan_resume, work_left
from ipw.running.shard import Shard, shard_items

LEVELS = {"a": (1,), "b": (1, 4)}  # b: a concurrency sweep
REPEATS = 2


def _queries(n: int) -> list[Query]:
    return [Query(f"q{i:03d}", f"What is {i}?", str(i), ("x", "y") if i % 5 == 0 else None, f"c{i % 3}", "exact")
            for i in range(n)]


def _killed_run(tmp_path, queries, config, written, *, older_line=False, torn=True):
    """A run folder killed after ``written`` records (backend, query_id, repeat, concurrency), with a torn last
    line; ``older_line``: one record written before the concurrency field (the whole log then goes through
    Arrow's JSON reader)."""
    folder = create(tmp_path / "res", "r1", {"command": ["test"], "config": config.to_dict(),
                                             "dataset": QuerySet("fixture", queries).entry()})
    for backend, qid, repeat, level in written:
        folder.append(record(run_id="r1", backend=backend, query_id=qid, repeat=repeat, concurrency=level))
    log = folder.path / "records.jsonl"
    if older_line:
        line = json.loads(log.read_text().splitlines()[0])
        del line["concurrency"]
        with open(log, "a") as fh:  # a duplicate of the first key, as an older ipw wrote it
            fh.write(json.dumps(line) + "\n")
    if torn:
        with open(log, "a") as fh:
            fh.write('{"run_id": "r1", "backend": "a", "query_id": "q0')
    assert folder.lock is not None
    folder.lock.release()  # as if killed
    return folder.path


def _old_todo(queries, config, written):
    """The to-do lists as ``run_backend`` made them before: a set lookup of each 4-tuple."""
    keys = set(written)
    return {(name, c): [(r, q) for r in range(config.repeats) for q in queries if (name, q.id, r, c) not in keys]
            for name, levels in LEVELS.items() for c in levels}


@pytest.mark.parametrize("source", ["query_set", "kept"])
@pytest.mark.parametrize("shard", [None, (2, 3)])
@pytest.mark.parametrize("older_line", [False, True])
def test_the_plan_gives_the_old_to_do_lists(tmp_path, source, shard, older_line):
    rng = random.Random(f"{source}{shard}{older_line}")
    queries = _queries(60)
    if shard is not None:  # a --shard run's queries are its shard's
        queries = shard_items(queries, Shard(*shard))
    config = RunConfig(dataset="fixture", backends=tuple(BackendSpec(n, "openai-http", "m") for n in LEVELS),
                       repeats=REPEATS, warmup=0)
    every = [(name, q.id, r, c) for name, levels in LEVELS.items() for c in levels for r in range(REPEATS)
             for q in queries]
    written = rng.sample(every, len(every) * 2 // 3)
    written += [k for k in every if k[1] == queries[-1].id]  # one query done everywhere: not built
    run_dir = _killed_run(tmp_path, queries, config, written, older_line=older_line)
    if source == "kept":
        write_queries(tmp_path / "queries.parquet", queries)
        query_set = KeptQueries.read(tmp_path / "queries.parquet", "fixture", QuerySet("fixture", queries).fingerprint,
                                     Query)
    else:
        query_set = QuerySet("fixture", queries)

    plan = plan_resume(run_dir, query_set, config, LEVELS)
    try:
        assert plan.n_queries == len(queries)
        assert len(plan.done) == len(set(written)) and set(plan.done) == set(written)
        old = _old_todo(queries, config, written)
        new = {(name, c): todo for name, levels in LEVELS.items()
               for c, todo in work_left(name, levels, REPEATS, plan.queries, plan.done).items()}
        assert new == old
        left = {q.id for todo in old.values() for _, q in todo}
        assert [q.id for q in plan.queries] == [q.id for q in queries if q.id in left]  # built: only those
        assert queries[-1] not in plan.queries
        assert plan.queries == [q for q in queries if q.id in left]  # the same Query objects' content
        assert not (run_dir / "records.jsonl").read_bytes().endswith(b"q0")  # the torn line is cut
    finally:
        assert plan.folder.lock is not None
        plan.folder.lock.release()


def test_the_warm_up_queries_are_built_even_when_done(tmp_path):
    """The warm-up sends the set's first ``max(warmup, concurrency)`` queries, done or not, as in the run
    that started: the plan builds them too (``run_backend`` skips them by key)."""
    queries = _queries(20)
    config = RunConfig(dataset="fixture", backends=tuple(BackendSpec(n, "openai-http", "m") for n in LEVELS),
                       repeats=1, warmup=2)
    written = [(name, q.id, 0, c) for name, levels in LEVELS.items() for c in levels for q in queries[:10]]
    plan = plan_resume(_killed_run(tmp_path, queries, config, written), QuerySet("fixture", queries), config, LEVELS)
    assert plan.folder.lock is not None
    plan.folder.lock.release()
    assert [q.id for q in plan.queries] == [q.id for q in queries[:4] + queries[10:]]  # 4: b's level 4
    for name, levels in LEVELS.items():
        for todo in work_left(name, levels, 1, plan.queries, plan.done).values():
            assert [q for _, q in todo] == queries[10:]


def test_every_query_for_ray_and_a_changed_dataset_refused(tmp_path):
    queries = _queries(10)
    config = RunConfig(dataset="fixture", backends=(BackendSpec("a", "openai-http", "m"),), repeats=1, warmup=0)
    run_dir = _killed_run(tmp_path, queries, config, [("a", q.id, 0, 1) for q in queries[:5]])
    plan = plan_resume(run_dir, QuerySet("fixture", queries), config, {"a": (1,)}, every_query=True)
    assert plan.queries == queries and len(plan.done) == 5  # Ray's shards split the whole list
    assert plan.folder.lock is not None
    plan.folder.lock.release()
    with pytest.raises(IpwError, match="fingerprints differ"):
        plan_resume(run_dir, QuerySet("fixture", queries[:9]), config, {"a": (1,)})


def test_done_keys_from_keys_and_columns_agree():
    import pyarrow as pa

    keys = [("a", "q1", 0, 1), ("a", "q2", 0, 1), ("b", "q1", 1, 4), ("a", "q1", 0, 1)]
    columns = [pa.array([k[i] for k in keys]) for i in range(4)]
    for done in (DoneKeys.of(keys), DoneKeys.from_columns(*columns)):
        assert len(done) == 3 and set(done) == set(keys) and ("b", "q1", 1, 4) in done and ("b", "q1", 0, 4) not in done
        assert done.done_ids("a", 0, 1) == {"q1", "q2"} and done.done_ids("c", 0, 1) == frozenset()
        ids = pa.array(["q1", "q2", "q3"])
        assert done.left(ids, [("a", 0, 1)]).tolist() == [False, False, True]
        assert done.left(ids, [("a", 0, 1), ("b", 1, 4)]).tolist() == [False, True, True]
        assert done.left(ids, [("a", 0, 1), ("c", 0, 1)]).tolist() == [True, True, True]  # c: nothing done
    assert len(DoneKeys()) == 0 and not DoneKeys()
