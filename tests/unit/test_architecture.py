"""The import rules of docs/architecture.md, enforced: every import in framework/, at
module level or inside a function, goes to a package its row allows."""

import ast
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
