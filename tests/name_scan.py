"""The scan behind the "no list of registered names outside the registry" tests (methods, drafter
kinds, targets, metrics, protocols): every literal tuple / list / set of a source file that holds two
or more registered names as strings."""
import ast
from pathlib import Path


def name_lists(path: Path, names: set, declared=()) -> list:
    """(line, names) of every tuple / list / set literal in ``path`` holding two or more of ``names``
    as strings, less those inside a value assigned to a name in ``declared`` (a registration or a
    declaration: a world's ``targets``, its ``record_metrics``)."""
    tree = ast.parse(Path(path).read_text())
    skip = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id in declared for t in targets):
                skip |= {id(x) for x in ast.walk(n.value)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in skip:
            found = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
            if len(found) >= 2:
                out.append((node.lineno, found))
    return out
