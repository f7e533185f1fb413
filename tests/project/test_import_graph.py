"""No import cycles in the ipw package (issue 20), and the layers of docs/ARCHITECTURE.md hold (issue 31):
every ``import``/``from ... import`` of an ipw module, at the top of a module or inside a function, is an
edge; the graph must have no cycle, and no edge may go from a lower layer up to a higher one."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ipw"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # ipw.x.y (a name in ipw.x) -> ipw.x
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "ipw.metering.window" in graph["ipw.running.runner"]
    assert "ipw.analysis.metrics" in graph["ipw.analysis.check"]


def test_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


#: The layers docs/ARCHITECTURE.md draws, as the modules a package must never import (directly, or
#: through any chain of imports).  Measurement (telemetry) and engines (backends) sit below analysis,
#: the commands, the CLI and the running layer; analysis reads run folders and never runs anything.
RUNNING = {"ipw.running", "ipw.grading.judge", "ipw.grading.rescore", "ipw.serve"}
FORBIDDEN = {
    # an engine's build helper (ipw.backends.llama_build) reads the CPU's instruction sets from telemetry, not the reverse
    "ipw.telemetry": {"ipw.analysis", "ipw.commands", "ipw.cli", "ipw.metering", "ipw.backends.llama_build", *RUNNING},
    # the measuring core (windows, splits, the meter) sits on the sensors and engines, below the running layer
    "ipw.metering": {"ipw.analysis", "ipw.commands", "ipw.cli", *RUNNING},
    "ipw.backends": {"ipw.analysis", "ipw.commands", "ipw.cli", *RUNNING},
    # compare's judge columns read ipw.grading.spec (orders_agree), as the config does (JudgeSpec): neither
    # imports the judge that runs (issue 57)
    "ipw.analysis": {"ipw.commands", "ipw.cli", "ipw.options", *RUNNING},
    # the inputs (config, query sets, models) are read before anything runs: they import no running, grading
    # (but a judge's spec, as data), measuring or analysis module (issue 57: folders that show the flow)
    "ipw.inputs": {"ipw.analysis", "ipw.commands", "ipw.cli", "ipw.metering", "ipw.results", *RUNNING},
    # rescore writes a run folder; its before/after rows are analysis's (ipw.analysis.rescored), composed by
    # the commands
    "ipw.grading.rescore": {"ipw.analysis"},
    # the run folder is given what it needs of the inputs (the dataset file, the Query type) by its caller
    "ipw.results": {"ipw.inputs"},
}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every (module -> ... -> forbidden module) path, shortest first, one per pair."""
    out = []
    for layer, forbidden in FORBIDDEN.items():
        for start in sorted(m for m in graph if _under(m, layer)):
            seen, queue = {start: [start]}, [start]
            while queue:
                v = queue.pop(0)
                for w in sorted(graph[v]):
                    if w in seen:
                        continue
                    seen[w] = seen[v] + [w]
                    if any(_under(w, f) for f in forbidden):
                        out.append(" -> ".join(seen[w]))
                    else:
                        queue.append(w)
    return out


def test_finds_a_layer_violation():
    graph = {"ipw.telemetry.rapl": {"ipw.util"}, "ipw.util": {"ipw.analysis.stats"}, "ipw.analysis.stats": set()}
    assert layer_violations(graph) == ["ipw.telemetry.rapl -> ipw.util -> ipw.analysis.stats"]


def test_the_layers_hold():
    bad = layer_violations(import_graph())
    assert not bad, "a lower layer imports a higher one:\n" + "\n".join(bad)


#: A command module may use what the commands share (``ipw.commands.output``), never another command: what two
#: commands both need is the library's (issue 46: ``ipw run`` judged its runs through ``ipw rescore``'s module;
#: ``ipw compare --router`` and ``ipw report --router`` took the router's tables from ``ipw route``'s: they are
#: ``ipw.analysis.router``'s now).


def test_no_command_calls_another():
    graph = import_graph()
    bad = sorted((m, w) for m in graph if _under(m, "ipw.commands") for w in graph[m]
                 if _under(w, "ipw.commands") and w not in ("ipw.commands", "ipw.commands.output"))
    assert not bad, "a command module imports another command's: " + ", ".join(f"{m} -> {w}" for m, w in bad)
