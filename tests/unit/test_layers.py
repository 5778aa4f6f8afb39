"""The rooms and their doors: the master's state and the slave's state import no MPI, no sockets and no shell
(with everything they import in turn), the desks do not import each other, master and slave talk only
through protocol/, and no module imports itself around a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGES = ("common", "protocol", "master", "slave", "control", "deploy", "bench")
#: what the pure rooms must not load, even through another module
SHELL = (
    "mpi4py",
    "zmq",
    "master.links",
    "master.run",
    "master.coordination",
    "master.metrics",
    "master.result_stream",
    "master.effects",
    "master.intake_shell",
    "slave.run",
)
#: what a desk leaves to the shell: the clock, files and the terminal (it returns effects: master/state/channels.py)
IO_MODULES, IO_CALLS = {"time", "sys", "os", "shutil"}, {"print", "open"}
DESKS = ("intake", "distribution", "moves", "hot_keys", "checkpoints", "payload", "stall")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The project modules `path` imports (at module level only, if asked)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            found.add(n.module)
            found |= {f"{n.module}.{a.name}" for a in n.names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


@pytest.mark.parametrize(
    "path", modules("master/state", "slave/state.py") or [None], ids=lambda p: str(p.relative_to(ROOT)) if p else "none"
)
def test_a_pure_room_loads_no_mpi_no_sockets_and_no_shell(path):
    name = module_name(path)
    probe = f"import sys; import {name}; print(sorted(m for m in sys.modules if m.startswith({SHELL!r})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{name} loads {out.stdout.strip()}"


@pytest.mark.parametrize("desk", DESKS + ("channels", "controller", "stats"))
def test_a_desk_reads_no_clock_and_writes_no_file_or_line(desk):
    """It is told the time and asks for messages, files and lines as effects."""
    tree = ast.parse((ROOT / "master" / "state" / f"{desk}.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not imported & IO_MODULES and not called & IO_CALLS


def test_the_desks_do_not_import_each_other():
    for desk in DESKS:
        others = {f"master.state.{d}" for d in DESKS if d != desk}
        assert not imports(ROOT / "master" / "state" / f"{desk}.py") & others, desk


def test_master_and_slave_talk_only_through_protocol():
    for path in modules("slave"):
        assert not {m for m in imports(path) if m.startswith("master")}, path
    for path in modules("master"):
        assert not {m for m in imports(path) if m.startswith("slave")}, path
    for path in modules("protocol", "common"):
        assert not {m for m in imports(path) if m.startswith(("master", "slave", "control", "deploy"))}, path


def test_no_module_imports_itself_around_a_circle():
    names = {module_name(p): p for p in modules(*PACKAGES)}
    graph = {n: {m for m in imports(p, top_level_only=True) if m in names and m != n} for n, p in names.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in graph[n]:
            assert state.get(m) != 1, "import circle: " + " -> ".join(path[path.index(m) :] + [m]) if m in path else m
            if m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
