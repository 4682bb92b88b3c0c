"""The package is the process: what each module may import, read from the source files.

``poller/`` runs in the poller process, ``buffer/`` in the trainer. Of ``poller/``, the trainer runs only the
wire (``poller/wire/``), what both run beside it (``poller/common/``) and the store clients
(``poller/sources/``). Every import is counted, at module level or inside a function, under
``TYPE_CHECKING`` or not, and so is every string that names a module (a source spec, ``python -m`` argv, a
lazy attribute): only the crossings in ``DECLARED`` may break a rule.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import poller

ROOT = Path(poller.__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str | None = None) -> set[str]:
    """Every module ``path`` imports, as absolute dotted names (``name``: the module's, if not under ROOT)."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _SPEC.fullmatch(node.value):
            found.add(node.value.partition(":")[0])
    return {module for module in found if module.split(".")[0] in ("poller", "buffer")}


# A string that names one of our modules, alone or as a spec ("poller.sources.sqlite:SqliteSource").
_SPEC = re.compile(r"(poller|buffer)(\.\w+)+(:[\w.]+)?|(poller|buffer):[\w.]+")


def _graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "poller").rglob("*.py")) + sorted((ROOT / "buffer").rglob("*.py"))
    assert len(files) > 20
    return {_module_name(path): _imports(path) for path in files}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# What a trainer may run of poller/: the wire, what both run beside it, the store clients, and the release both
# packages report (one constant setup.cfg reads).
SHARED = ("poller.wire", "poller.common", "poller.sources", "poller._version")
# The wire itself takes nothing from outside it (the release aside).
WIRE = ("poller.wire", "poller._version")
# Crossings by name: importer -> what it may name across the line, and why.
DECLARED = {
    "poller": {"buffer.process"},  # poller.PollerProcess, resolved on a trainer's first use
    "buffer.process": {"poller.child"},  # the argv of the poller it spawns: `python -m poller.child`
}


def _undeclared(name: str, deps: set[str]) -> set[str]:
    return {m for m in deps if not any(_within(m, allowed) for allowed in DECLARED.get(name, ()))}


def test_the_wire_imports_nothing_outside_itself() -> None:
    offenders = {name: sorted(m for m in deps if not any(_within(m, s) for s in WIRE))
                 for name, deps in _graph().items() if _within(name, "poller.wire")}
    assert {name: deps for name, deps in offenders.items() if deps} == {}


def test_the_poller_never_imports_the_trainer() -> None:
    offenders = {name: sorted(m for m in _undeclared(name, deps) if _within(m, "buffer"))
                 for name, deps in _graph().items() if _within(name, "poller")}
    assert {name: deps for name, deps in offenders.items() if deps} == {}


def test_the_trainer_imports_the_poller_only_through_the_wire() -> None:
    offenders = {name: sorted(m for m in _undeclared(name, deps)
                        if _within(m, "poller") and not any(_within(m, s) for s in SHARED))
                 for name, deps in _graph().items() if _within(name, "buffer")}
    assert {name: deps for name, deps in offenders.items() if deps} == {}


def test_the_walk_finds_every_form_of_import(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text("from typing import TYPE_CHECKING\n"
                      "from . import sibling\n"
                      "from ..wire import tags\n"
                      "if TYPE_CHECKING:\n    from buffer.process import PollerProcess\n"
                      "def late():\n    import buffer.core\n"
                      "SPEC = 'buffer.ring:Ring'\n"
                      "ARGV = ['-m', 'buffer.child']\n"
                      "LAZY = {'x': 'poller.lazy'}\n"
                      "NOT_A_MODULE = 'the poller. buffer'\n")
    found = _imports(module, "poller.pkg.mod")
    assert {"poller.pkg.sibling", "poller.wire.tags", "buffer.process", "buffer.core", "buffer.ring", "buffer.child",
            "poller.lazy"} <= found
    assert not any(" " in name for name in found)


def test_every_declared_crossing_is_still_made() -> None:
    graph = _graph()
    assert {name: sorted(names - graph[name]) for name, names in DECLARED.items() if names - graph[name]} == {}


def test_a_running_poller_never_loads_the_trainers_package(tmp_path: Path) -> None:
    # poller.PollerProcess is resolved from buffer.process on first use: only a trainer asks for it.
    code = ("import sys, poller.worker, poller.child, poller.cli, poller.sources.sqlite, poller.sources.transferqueue; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'buffer'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
