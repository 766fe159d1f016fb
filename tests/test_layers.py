"""The package's import graph (read from the source with ``ast``, every import statement,
function-level ones included) has no cycle, and every import goes down the layers or stays in
its own. The folders are the layers (docs/architecture.md):

    util  ->  engine  ->  models  ->  worlds  ->  job  ->  apps

util: coolsd/util/ (errors, input loading, records and files, statistics); engine: coolsd/engine/
(decoding, the loop and its signals, drafting, methods, the model protocol, continuous numerics);
models: coolsd/models/ (model families, EAGLE drafters), coolsd/metrics/, coolsd/toy/,
coolsd/prompts/, coolsd/theory/ (the exact lab); worlds: coolsd/worlds/ (what a target name
resolves to); job: coolsd/job/ (the one generation job, its schema, shards, summary, tracking);
apps: coolsd/cli/ (command lines) and coolsd/report/ (tables and plots).
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "coolsd"
LAYERS = {  # top-level folder -> layer: every module's folder decides, with no exemption
    "coolsd.util": 0,
    "coolsd.engine": 1,
    "coolsd.models": 2, "coolsd.metrics": 2, "coolsd.toy": 2, "coolsd.prompts": 2, "coolsd.theory": 2,
    "coolsd.worlds": 3,
    "coolsd.job": 4,
    "coolsd.cli": 5, "coolsd.report": 5,
}
NAMES = ["util", "engine", "models", "worlds", "job", "apps"]


def layer_of(module: str) -> int:
    """The layer of the top-level folder holding ``module`` (``coolsd.<folder>...``); the package's
    own ``__init__`` imports nothing and is below every layer."""
    if module == "coolsd":
        return -1
    return LAYERS[".".join(module.split(".")[:2])]


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


def test_every_module_sits_in_a_layer_folder():
    """No module at the package's top level and no folder outside the table: a new file's folder
    names its layer."""
    stray = sorted(m for m in modules() if m != "coolsd" and ".".join(m.split(".")[:2]) not in LAYERS)
    assert stray == []


def test_the_tests_mirror_the_package():
    """tests/<folder>/ holds the tests of coolsd/<folder>/ (tests/benchmarks/: benchmarks/); this
    file, about the package as a whole, sits at the top."""
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    package = {m.split(".")[1] for m in LAYERS}
    assert folders - package - {"benchmarks"} == set()
    assert [p.name for p in tests.glob("test_*.py")] == [Path(__file__).name]


def documented_tree(text: str) -> set[str]:
    """The paths of the ``coolsd/`` tree in docs/architecture.md (the text block that starts with
    ``coolsd/``; two spaces of indent per level, a folder's name ends in ``/``)."""
    block = text.split("```text\ncoolsd/\n", 1)[1].split("```", 1)[0]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        stack[depth - 1:] = [name.rstrip("/")]
        paths.add("/".join(stack) + ("/" if name.endswith("/") else ""))
    return paths


def package_tree(root: Path = PACKAGE) -> set[str]:
    out = set()
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if "__pycache__" in rel.parts or rel.parts[:2] == ("toy", "assets") or p.name == "__init__.py":
            continue
        if p.is_dir():
            out.add(rel.as_posix() + "/")
        elif p.suffix == ".py":
            out.add(rel.as_posix())
    return out


def test_the_architecture_tree_matches_the_package():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    documented = documented_tree(doc)
    actual = package_tree()
    assert sorted(actual - documented) == [], "in the package, not in docs/architecture.md's tree"
    assert sorted(documented - actual) == [], "in docs/architecture.md's tree, not in the package"
    # a wrong depth is a different path: the check reads the nesting too
    assert documented_tree("```text\ncoolsd/\n  engine/\n  loop.py\n```") == {"engine/", "loop.py"}


def deferred_imports(root: Path = PACKAGE) -> list[str]:
    """Package imports inside functions that do not say why (a ``# deferred: <reason>`` comment on
    the line above or the same line): an internal import is deferred only to keep a heavy module
    off a path that must stay fast (a refused config), never to hide an edge from these checks
    (they read function-level imports too)."""
    out = []
    for name, path in modules(root).items():
        src = path.read_text().splitlines()
        tree = ast.parse("\n".join(src))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(m.split(".")[0] == "coolsd" for m in mods):
                    said = [src[node.lineno - 1]] + ([src[node.lineno - 2]] if node.lineno > 1 else [])
                    if not any("# deferred:" in line for line in said):
                        out.append(f"{name}:{node.lineno}")
    return sorted(out)


def test_every_deferred_package_import_says_why():
    assert deferred_imports() == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves on a scratch package: an engine module importing the job, which
    imports it back."""
    pkg = tmp_path / "coolsd"
    for sub in ("engine", "job"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "loop.py").write_text("def f():\n    from coolsd.job.generation import g\n")
    (pkg / "job" / "generation.py").write_text("from coolsd.engine import loop\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["coolsd.engine.loop", "coolsd.job.generation"]]
    assert upward_imports(graph) == ["coolsd.engine.loop (engine) imports coolsd.job.generation (job)"]
    assert deferred_imports(pkg) == ["coolsd.engine.loop:2"]
    (pkg / "stray.py").write_text("")
    assert "coolsd.stray" in [m for m in modules(pkg) if ".".join(m.split(".")[:2]) not in LAYERS]
