"""The package's shape: every package is installed, no import cycle, no module shadowed by an export.

Implementation under test: the layout of ``witcert/`` and the package list in ``pyproject.toml``.
Oracle: the source tree itself, read with ``ast`` (every ``import`` statement, at any depth,
counts as an edge: a deferred import is still a dependency). Tolerance: exact.
"""
import ast
import tomllib
from pathlib import Path

import witcert

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"witcert": ROOT / "witcert", "witcert.kernels": ROOT / "kernels", "witcert.spec": ROOT / "spec"}


def _modules() -> dict[str, Path]:
    """Every product module: dotted name -> file."""
    found = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts or (folder.name != "witcert" and path.name.startswith("test_")):
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts]) if parts else prefix
            if prefix == "witcert" and parts and parts[0] in ("kernels", "spec"):
                continue
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Product modules imported by ``name`` (any depth), resolved to the deepest module named."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        edges.update(t for t in targets if t in MODULES and t != name)
    return edges


def test_every_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, f"packages missing from pyproject.toml: {sorted(packages - listed)}"


def test_no_import_cycle_in_the_product_package():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_product_modules_do_not_import_the_top_level_package():
    # the top level re-exports from the subpackages; a subpackage importing it back would be a cycle
    offenders = [n for n, p in MODULES.items() if n != "witcert" and "witcert" in _imports(n, p)]
    assert not offenders, f"import the defining module instead of `witcert`: {offenders}"


def test_no_exported_name_shadows_a_module():
    for name in witcert.__all__:
        assert f"witcert.{name}" not in MODULES, f"witcert.{name} is both an export and a module"


def test_core_imports_no_upper_layer():
    """``witcert.core`` is the lowest layer: no tier, gate, scheme, integration or verification module."""
    upper = ("witcert.tier_a", "witcert.tier_b", "witcert.gate", "witcert.schemes", "witcert.integrations",
             "witcert.observatory", "witcert.verification", "witcert.cli")
    offenders = {n: sorted(i for i in _imports(n, p) if i.startswith(upper))
                 for n, p in MODULES.items() if n.startswith("witcert.core")}
    assert not any(offenders.values()), f"core imports an upper layer: {offenders}"
