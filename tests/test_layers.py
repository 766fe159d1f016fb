"""The package's import graph (read from the source with ``ast``, every import statement,
function-level ones included) has no cycle, and every import goes down the layers or stays in
its own:

    engine  ->  models  ->  worlds  ->  job  ->  apps

engine: the decoding core and its utilities (decoding/, generate, drafting, protocols, the
method registry, continuous/ numerics, records, shards, stats, timing, tracking,
batch_invariant, compiled); models: model code, drafters, metrics, toy assets, prompt sets, the theory
lab's models; worlds: what a target name resolves to (coolsd.worlds); job: the one generation
job and its summary; apps: command lines, reports, the Hydra runner.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "coolsd"
LAYERS = {  # module prefix -> layer; the longest matching prefix decides
    "coolsd": 0,
    "coolsd.models": 1, "coolsd.drafters": 1, "coolsd.metrics": 1, "coolsd.toy": 1, "coolsd.prompts": 1,
    "coolsd.theory": 1,
    "coolsd.worlds": 2,
    "coolsd.job": 3, "coolsd.summary": 3, "coolsd.config_schema": 3,  # the job config's schema and range checks
    "coolsd.runner": 4, "coolsd.merge": 4, "coolsd.evaluate": 4, "coolsd.report": 4,
    "coolsd.drafters.train": 4,  # the drafter-training command line (python -m coolsd.drafters.train)
}
NAMES = ["engine", "models", "worlds", "job", "apps"]


def layer_of(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from a.b import c`` counts a.b.c when c is a
    module, else a.b); a package's own ``__init__`` importing its submodules is not an edge back."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                           for a in node.names]
            deps.update(m for m in map(resolve, (t for t in targets if t.split(".")[0] == "coolsd")) if m)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({NAMES[layer_of(m)]}) imports {d} ({NAMES[layer_of(d)]})"
                  for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_every_import_goes_down_the_layers():
    assert upward_imports(import_graph()) == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves on a scratch package: an engine module importing the job, which
    imports it back."""
    pkg = tmp_path / "coolsd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "generate.py").write_text("def f():\n    from coolsd.job import g\n")
    (pkg / "job.py").write_text("from coolsd import generate\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["coolsd.generate", "coolsd.job"]]
    assert upward_imports(graph) == ["coolsd.generate (engine) imports coolsd.job (job)"]
