"""The project's import graph has no cycles (imports inside functions count too: a lazy import is
still a dependency), and the benchmarks depend on no test module. Read from the source, so nothing
heavy is imported."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "pools", "attention_nodes", "expert_nodes", "m2n_comm", "telemetry", "models", "kernels",
            "planner", "training", "clients", "bench")


def modules() -> dict[str, Path]:
    """Every module of the project by dotted name (a package by its own name)."""
    found = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports: `from pkg import mod` counts as pkg.mod when that is a
    module (the package's __init__ runs first, but Python resolves that order itself)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out |= subs or {node.module}
    return out & known.keys()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    known = modules()
    graph = {m: imports(f, known) - {m} for m, f in known.items()}
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_benchmarks_import_no_test_module():
    known = modules()
    for name, path in known.items():
        if name.startswith("bench"):
            tree = ast.parse(path.read_text())
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not {m for m in imported if m == "tests" or m.startswith("tests.")}, name


def test_every_imported_name_exists():
    """`from project.module import name` everywhere (benchmarks included, which no test imports)
    names something that exists: a module moved or a function renamed fails here, not in a user's
    benchmark run."""
    import importlib

    known, missing = modules(), []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in PACKAGES):
                module = importlib.import_module(node.module)
                missing += [f"{name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and f"{node.module}.{a.name}" not in known]
    assert missing == []
