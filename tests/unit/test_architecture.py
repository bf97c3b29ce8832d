"""The import rules of docs/architecture.md, enforced: every import in framework/, at
module level or inside a function, goes to a package its row allows. And the sizes of
issue 42 over framework/ and tools/: no file over MAX_FILE_LINES lines, no function over
MAX_FUNCTION_LINES lines or MAX_PARAMETERS parameters, no import cycle between modules
(imports inside functions included)."""

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rules() -> dict[str, set[str]]:
    """package -> what it may import, read from the table in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        m = re.match(r"^\| ([a-z_.]+) \|([^|]*)\|$", line.strip())
        if m and m.group(1) != "package":
            table[m.group(1)] = {d.strip() for d in m.group(2).split(",") if d.strip()}
    return table


def package_of(module: str) -> str | None:
    """framework.a.b.c -> "a"; None outside the framework (or the root package)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "framework" and len(parts) > 1 else None


def imports(path: Path) -> list[str]:
    """Every framework module `path` imports (from x import y: x.y when y is a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in found if m.startswith("framework.")]


def allowed(target: str, allowed_entries: set[str]) -> bool:
    """Whether an import of module `target` (framework.x...) is in the allowed set
    (entries are packages, or package.module for one module of a package)."""
    rest = target.split(".", 1)[1]
    return any(rest == entry or rest.startswith(entry + ".") for entry in allowed_entries)


def violations(table: dict[str, set[str]]) -> list[str]:
    bad = []
    for path in sorted((ROOT / "framework").rglob("*.py")):
        me = package_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if me is None or me == "__init__":
            continue
        for target in imports(path):
            other = package_of(target)
            if other in (None, me) or allowed(target, table.get(me, set())):
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {target}: {me} may import only "
                       f"{', '.join(sorted(table.get(me, set()))) or 'nothing of the framework'}")
    return bad


def test_every_import_follows_the_rules_of_the_architecture_page():
    assert violations(rules()) == []


def test_every_package_has_a_row_and_the_checker_catches_a_violation():
    table = rules()
    packages = {package_of(".".join(p.relative_to(ROOT).with_suffix("").parts))
                for p in (ROOT / "framework").rglob("*.py")} - {None, "__init__"}
    assert packages == set(table), packages ^ set(table)
    # The same checker with the model allowed nothing of `parallel`: the model's import
    # of the tensor-parallel plan is then reported.
    strict = dict(table, model={"config", "errors"})
    assert any("framework/model/llama.py imports framework.parallel.tensor" in v
               for v in violations(strict))


# --- Sizes: files, functions, import cycles (framework/ and tools/) --------------------

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60  # from the `def` line to the last line of the body
MAX_PARAMETERS = 8  # every parameter (*args and **kwargs too), self and cls not counted
SIZED = ("framework", "tools")


@functools.cache
def sources() -> dict[str, tuple[Path, ast.Module]]:
    """module name (framework.io.data; a package: its __init__'s, framework.io) ->
    (path, parsed source), for every module of framework/ and tools/."""
    found = {}
    for top in SIZED:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = (path, ast.parse(path.read_text(), str(path)))
    return found


def long_files(limit: int = MAX_FILE_LINES) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {n} lines"
            for path, _ in sources().values()
            if (n := len(path.read_text().splitlines())) > limit]


def _functions(tree: ast.Module):
    """(qualified name, node) of every function and method, nested ones too."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)
    yield from walk(tree, "")


def parameters(fn: ast.FunctionDef) -> int:
    """How many parameters `fn` takes (MAX_PARAMETERS' count)."""
    a = fn.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if named and named[0] in ("self", "cls"):
        named = named[1:]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def big_functions(max_lines: int = MAX_FUNCTION_LINES,
                  max_parameters: int = MAX_PARAMETERS) -> list[str]:
    bad = []
    for path, tree in sources().values():
        for name, fn in _functions(tree):
            lines, params = fn.end_lineno - fn.lineno + 1, parameters(fn)
            if lines > max_lines:
                bad.append(f"{path.relative_to(ROOT)}:{fn.lineno} {name}: {lines} lines")
            if params > max_parameters:
                bad.append(f"{path.relative_to(ROOT)}:{fn.lineno} {name}: {params} parameters")
    return bad


def imported(module: str, is_package: bool, tree: ast.Module, known) -> set[str]:
    """The modules of `known` that `module` imports, from every `import` and `from ...
    import` at any depth (inside functions too), relative ones resolved; `from a.b
    import c` is an import of a.b.c when that is a module, else of a.b."""
    package = module if is_package else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x: the package; from .. import x: its parent
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names)
    return {t for t in targets if t in known and t != module}


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of framework/ and tools/ it imports (`imported`)."""
    known = sources()
    return {module: imported(module, path.name == "__init__.py", tree, known)
            for module, (path, tree) in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle [a, b, ..., a] through each group of modules that import each other
    (each strongly connected component of more than one module; Tarjan 1972)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):  # recursive: the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the first module of `group` (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def test_no_file_is_over_400_lines():
    assert long_files() == [], "\n".join(long_files())


def test_no_function_is_over_60_lines_or_8_parameters():
    assert big_functions() == [], "\n".join(big_functions())


def test_no_import_cycle():
    found = [" -> ".join(c) for c in cycles(import_graph())]
    assert found == [], "import cycles:\n" + "\n".join(found)


def test_the_size_checks_catch_what_they_check():
    """Each checker reports what it is made to see: lower limits, a cycle of a made-up
    graph, relative imports and imports inside functions, self not counted."""
    assert long_files(limit=1) and big_functions(max_lines=1, max_parameters=0)
    known = sources()
    source = ast.parse("from .corpus_dataset import CorpusDataset\nfrom .. import config\n"
                       "def f():\n    from . import tokenizer\n    import framework.errors")
    assert imported("framework.io.data", False, source, known) == {
        "framework.io.corpus_dataset", "framework.config", "framework.io.tokenizer",
        "framework.errors"}
    assert "framework.io.data" in import_graph()["framework.run.train"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [
        ["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    method = ast.parse("class A:\n    def f(self, a, *b, c, **d): pass").body[0].body[0]
    assert parameters(method) == 4
