import importlib
import inspect
import json
import platform
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from ipw.cli import main

# The suite mirrors the package (tests/<layer>/test_*.py, tests/e2e/, tests/project/); its shared helpers stay in
# tests/ (on the path, as this file's folder), and a test module may import another's fixtures and helpers by
# its name (``from test_router import trained``), as when the suite was one folder: each folder is on the path.
for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir()
                      if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture
def run_cli(capsys):
    """Run ``ipw`` in-process; returns (exit code, stdout, stderr)."""

    def _run(*args: str):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return _run


@pytest.fixture
def small_jsonl(tmp_path: Path) -> Path:
    rows = [
        {"id": "a1", "prompt": "What is 2 + 3? Answer with just the number.", "answer": "5",
         "category": "arithmetic", "scorer": "numeric"},
        {"id": "a2", "prompt": "What is 10 - 4? Answer with just the number.", "answer": "6",
         "category": "arithmetic", "scorer": "numeric"},
        {"id": "m1", "prompt": "Which planet is known as the Red Planet?", "answer": "B",
         "choices": ["Venus", "Mars", "Jupiter", "Saturn"], "category": "science"},
        {"id": "s1", "prompt": "Write the word 'dog' in uppercase. Answer with just the word.", "answer": "DOG",
         "category": "strings", "scorer": "exact"},
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


WORDS = ["apple", "river", "house", "green", "table", "music", "light", "stone", "cloud", "bread", "chair", "water"]


def mixed_accuracy_jsonl(tmp_path: Path) -> Path:
    """Queries SmolLM2-135M answers right often (copying a word) and some it gets wrong (arithmetic), so
    that an accuracy compared across runs is neither 0 nor 1; categories interleaved."""
    rows = [{"id": f"copy-{i}", "prompt": f"Repeat this word exactly: {w}", "answer": w, "scorer": "contains",
             "category": "copy"} for i, w in enumerate(WORDS)]
    rows += [{"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}? Answer with just the number.", "answer": str(a + b),
              "scorer": "numeric", "category": "arithmetic"} for a, b in ((17, 25), (38, 46), (123, 389), (7, 8))]
    rows = [rows[i] for i in (0, 12, 1, 2, 13, 3, 4, 14, 5, 6, 15, 7, 8, 9, 10, 11)]  # mixed order
    path = tmp_path / "easy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def smol_config(path: Path, dataset: Path, *, limit: int, max_tokens: int, out_dir: Path, top: str = "") -> Path:
    """A run config of SmolLM2-135M in-process (one thread, no warm-up, no idle baseline)."""
    path.write_text(f'''dataset = "{dataset}"
limit = {limit}
warmup = 0
idle_s = 0
out_dir = "{out_dir}"
{top}
[generation]
max_tokens = {max_tokens}
[[backends]]
name = "smol"
kind = "llama-cpp"
model = "smollm2-135m"
n_threads = 1
''')
    return path


def only_run(folder: Path) -> Path:
    """The one run folder written under ``folder``."""
    (run_dir,) = [p for p in folder.iterdir() if p.is_dir()]
    return run_dir


@pytest.fixture
def scripted(request):
    """The test module's ``ScriptedJudge`` (a ``scripted.ScriptedBackend``) as backend kind "scripted"."""
    from ipw.backends.base import register_backend, unregister_backend

    register_backend("scripted", request.module.ScriptedJudge, replace=True)
    yield
    unregister_backend("scripted")


@contextmanager
def bench_module(name: str):
    """A bench/ script imported as a module, ``name`` its path under bench/ without ``.py``: ``"index"``,
    ``"scale/compare_scale"``.  While it is used, bench/ (its ``_shared``) and the script's own folder (its
    siblings) are on sys.path, as they are when the script runs."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    folder, _, module = name.rpartition("/")
    paths = list(dict.fromkeys([str(bench), str(bench / folder)]))
    sys.path[:0] = paths
    try:
        yield importlib.import_module(module)
    finally:
        for path in paths:
            sys.path.remove(path)


# The two test tiers (issue 57): `pytest -m "not slow"` is the inner loop; CI (.ci/run) runs everything.
# A test is slow when it starts a process (an engine, llama-server, vLLM, Ray, the Redfish emulator, `ipw` as a
# process of its own...), in its body, in a function of tests/ it calls, or in a fixture it uses, or when it takes
# seconds (SLOW_TESTS). Marked at collection from the names its code uses (SPAWNS), and held when it runs: a test
# outside the slow tier that starts a process fails (pytest_runtest_makereport), so none slips in unmarked.
TESTS = Path(__file__).resolve().parent
SLOW_MARKERS = ("llama", "vllm", "ray", "package")  # the engines', Ray's and the wheel's own markers
# names whose use means a process: the modules and calls that start one, the classes of ipw that start a server,
# bench/_shared.py's Child (a command in a process or a pty), sys.executable (a Python command line to run)
SPAWNS = frozenset({"subprocess", "Popen", "fork", "forkpty", "posix_spawn", "multiprocessing", "ray",
                    "ManagedServer", "start_server", "Child", "executable"})
# the other slow tests, by why: "module.py", "module.py::test_name" or "module.py::test_name[case]" (one case of a
# parametrized test). The run-time check below finds a process start the collection cannot see; the session's
# summary lists the fast tests that took over FAST_S (SLOW_TESTS holds those of over 1 s on a loaded 2-core VM).
SLOW_TESTS = {
    "runs every documented command (issue 46), engines included": ("test_docs_commands.py::test_documented_command",),
    # (the check runs once a process, llama_cpp._PROBED: whichever test asks first starts it; alone, each of these)
    "ipw run checks the llama.cpp build in a worker process (llama_cpp.probe_engine) before it refuses the input": (
        "test_bad_input.py::test_bad_input_round2[empty shard]",
        "test_hostile_outside.py::test_a_bad_chassis_link_is_one_line_exit_2",
        "test_llama_server.py::test_missing_binary_fails_before_the_run_folder"),
    "ipw doctor checks llama.cpp in a worker process; its GPU checks run on the clock": (
        "test_doctor.py::test_doctor_without_gpu", "test_doctor.py::test_doctor_rows_with_a_gpu_and_with_a_broken_one",
        "test_doctor.py::test_gpu_self_test_with_a_fake_gpu_and_no_torch",
        "test_platforms.py::test_doctor_lists_every_platform_with_why", "test_platforms.py::test_record_trace_on_this_machine",
        "test_platforms.py::test_doctor_checks_the_nvml_counter", "test_platforms.py::test_doctor_reports_a_distrusted_counter",
        "test_platforms.py::test_nvml_trace_round_trip"),
    "node power runs a scripted ipmitool": ("test_node_power.py::test_ipmi_dcmi_reads_a_scripted_responder",),
    "its fake engine (bench/overhead/fake_engine.py) runs in a worker process": ("test_worker_protocol.py",),
    "ipw serve sessions: a real llama-server, wrapped commands, deadlines, settling energy (1-7 s each)": (
        "test_serve.py", "test_hostile_serve.py",
        "test_prometheus.py::test_serve_metrics_count_each_settled_record_once_by_the_model_asked_for",
        "test_router.py::test_serve_routes_between_two_upstreams"),
    "waits out a deadline, a timeout, a redirect or a sampler's period on the real clock": (
        "test_hostile_outside.py::test_a_trickling_bmc_is_cut_at_the_total_deadline",
        "test_hostile_outside.py::test_a_trickling_feed_is_cut_at_the_total_deadline",
        "test_hostile_outside.py::test_a_bmc_discovery_has_a_total_deadline",
        "test_hostile_outside.py::test_a_bmc_redirect_to_another_origin_gets_no_credentials",
        "test_hostile_outside.py::test_a_feed_redirect_to_another_origin_gets_no_key",
        "test_openai_http.py::test_a_trickling_server_is_cut_at_the_total_deadline",
        "test_openai_http.py::test_failures_have_categories[script4-timeout]",
        "test_openai_http.py::test_failed_queries_become_error_records",
        "test_mlflow.py::test_a_server_that_answers_junk_is_one_line[junk]",
        "test_nvml_sampler.py::test_thread_never_busy_waits_and_settles_soon",
        "test_api.py::test_gpu_is_measured_and_the_estimate_kept_apart",
        "test_energy_audit.py::test_the_runner_records_the_audit_in_the_manifest"),
    "renders HTML reports (their plots)": (
        "test_report.py::test_caps_and_downsampling", "test_report.py::test_cli",
        "test_report.py::test_energy_tokens_fit_is_compares", "test_report.py::test_every_plot_is_made_and_inlined",
        "test_report_layout.py::test_banner_for_runs_from_different_hardware",
        "test_report_layout.py::test_coverage_within_an_envelope_or_budget_is_marked_estimated",
        "test_report_layout.py::test_the_answer_comes_first_and_provenance_last",
        "test_router.py::test_report_shows_the_router", "test_router.py::test_compare_shows_the_router_beside_the_oracle",
        "test_router.py::test_bad_input", "test_router.py::test_several_local_backends_cheapest_first",
        "test_cascade.py::test_the_report_shows_the_cascade",
        "test_serving_analysis.py::test_report_shows_serving_table_plot_and_deadline",
        "test_carbon.py::test_report_shows_carbon_and_the_bases_on_the_basis_it_names",
        "test_bad_input.py::test_hostile_names_in_the_html_report_are_shown_escaped",
        "test_metric_parity.py::test_run_table_compare_check_and_report_agree",
        "test_metric_parity.py::test_failed_and_unmeasured_queries_count_the_same_everywhere",
        "test_metric_table.py::test_a_new_metric_shows_in_compare_check_and_the_report",
        "test_metric_table.py::test_ipw_run_full_table_has_every_metric_the_summary_the_marked_ones"),
    "seconds of computing: a long run, a replay, a scan, every offset": (
        "test_uncertainty.py::test_every_load_shape_is_replayed_at_every_window_length",
        "test_uncertainty.py::test_held_out_loads_as_measured",  # the three use `loads`: every load shape replayed
        "test_uncertainty.py::test_target_holds_on_every_held_out_load_and_length",
        "test_uncertainty.py::test_the_counter_resolved_reference_covers_every_steady_load_from_half_a_second",
        "test_openai_http.py::test_long_concurrent_run_keeps_memory_flat",
        "test_openai_http.py::test_concurrency_overlaps_windows_keeps_order_and_splits_energy",
        "test_compare.py::test_compare_matches_independent_recomputation_at_larger_n",
        "test_run_folder_integrity.py::test_a_large_run_resumes_from_its_copy_of_the_queries",
        "test_bad_input.py::test_damaged_power_trace_is_one_line",
        "test_bench_index.py::test_bench_scripts_use_no_private_ipw_name",
        "test_mlflow.py::test_metric_keys_keep_to_mlflow_characters",
        "test_secrets.py::test_a_500_that_puts_the_key_at_the_64_kib_boundary",
        "test_secrets.py::test_500_echoing_the_key_at_every_offset"),
}
SLOW_KEYS = {key: why for why, keys in SLOW_TESTS.items() for key in keys}
FAST_S = 1.0  # a fast test over this long is named at the end of the session
# the audit events of a process start (https://docs.python.org/3/library/audit_events.html)
START_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system",
                          "os.spawn"})


def _code_names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object uses, its nested functions' (closures, lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _in_tests(obj: object) -> bool:
    code = getattr(obj, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(TESTS)


def starts_process(func: object, seen: set[types.CodeType] | None = None) -> bool:
    """Whether ``func``'s code names a process start (SPAWNS), itself or through the functions and classes of
    tests/ it uses (a module's helper, openai_stub, a class's methods)."""
    seen = set() if seen is None else seen
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _code_names(code)
    if names & SPAWNS:
        return True
    scope = getattr(func, "__globals__", {})
    for name in names:
        obj = scope.get(name)
        members = vars(obj).values() if isinstance(obj, type) else (obj,)
        for member in members:
            member = getattr(member, "__func__", getattr(member, "fget", member))  # static/classmethod, property
            if _in_tests(member) and starts_process(member, seen):
                return True
    return False


def _slow_reason(item: pytest.Item) -> str | None:
    """Why ``item`` is in the slow tier, or None."""
    for marker in SLOW_MARKERS:
        if item.get_closest_marker(marker):
            return f"marked {marker}"
    module = Path(item.path).name
    name = getattr(item, "originalname", item.name)
    for key in (module, f"{module}::{name}", f"{module}::{item.name}"):
        if key in SLOW_KEYS:
            return SLOW_KEYS[key]
    fixtures = item._fixtureinfo.name2fixturedefs if isinstance(item, pytest.Function) else {}
    funcs = [getattr(item, "function", None)] + [defs[-1].func for defs in fixtures.values()]
    if any(func is not None and starts_process(func) for func in funcs):
        return "starts a process"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _slow_reason(item):
            item.add_marker(pytest.mark.slow)


_started: list[str] = []  # the processes started since the running test's setup began


def _audit(event: str, args: tuple) -> None:
    if event in START_EVENTS:
        _started.append(f"{event} {args[1] if event == 'subprocess.Popen' else args[0]!r}"[:200])


platform.processor()  # runs `uname -p` once per process (cached): here, not in whichever test asks first
sys.addaudithook(_audit)  # for the life of the process: an audit hook cannot be removed


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started.clear()


_fast_s: dict[str, float] = {}  # the fast tests' times (setup, call and teardown)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if item.get_closest_marker("slow"):
        return
    report = outcome.get_result()
    _fast_s[item.nodeid] = _fast_s.get(item.nodeid, 0.0) + report.duration
    if call.when == "teardown" and _started and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started a process ({_started[0]}) but is not in the slow tier: name what "
                           "starts it in tests/conftest.py's SPAWNS or SLOW_TESTS, or mark the test @pytest.mark.slow")


def pytest_terminal_summary(terminalreporter):
    """The fast tests that took over FAST_S: candidates for SLOW_TESTS (a test is never failed for its time)."""
    over = sorted(((s, nodeid) for nodeid, s in _fast_s.items() if s > FAST_S), reverse=True)
    if over:
        terminalreporter.write_sep("-", f"fast tests over {FAST_S:g} s (tests/conftest.py, SLOW_TESTS)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:6.2f}s {nodeid}")
