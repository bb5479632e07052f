"""Imports run one way: the embedding tables stand alone (no strategies, no topology, no
Lightning), topology plans without the models, and importing the tables loads no Lightning
and no TensorBoard."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ctr_lightning"

# package folder -> the modules nothing under it may import, anywhere in a file (functions
# and TYPE_CHECKING blocks included)
FORBIDDEN = {
    "embedding": ("ctr_lightning.strategies", "ctr_lightning.topology", "lightning", "pytorch_lightning"),
    "topology": ("ctr_lightning.models",),
    "models": ("ctr_lightning.topology",),  # a callback plans placements (callbacks/auto_placement.py)
}


def imports(path: Path) -> list[tuple[int, list[str]]]:
    """``(line, the modules it may import)`` for every import in a file: ``from a import b``
    may import ``a`` and ``a.b``; relative imports are made absolute; the constant names given
    to ``importlib.import_module`` and ``__import__`` count too."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, [alias.name]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, [base] + [f"{base}.{alias.name}" for alias in node.names]))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) == "import_module" or getattr(node.func, "id", None) == "__import__")):
            found.append((node.lineno, [node.args[0].value]))
    return sorted(found)


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for line, modules in imports(path):
            bad = [m for m in modules if any(m == f or m.startswith(f + ".") for f in forbidden)]
            if bad:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {bad[0]}")
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_packages_import_one_way(folder):
    assert violations(folder, FORBIDDEN[folder]) == []


def test_the_scan_sees_every_kind_of_import(tmp_path, monkeypatch):
    fake = tmp_path / "ctr_lightning"
    (fake / "embedding").mkdir(parents=True)
    (fake / "embedding" / "x.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import lightning.pytorch as pl\n"
        "if TYPE_CHECKING:\n"
        "    from ctr_lightning.topology.planner import Plan\n"
        "def f():\n"
        "    from .. import strategies\n"
        "    import importlib; importlib.import_module('pytorch_lightning')\n"
        "from ctr_lightning.topologyx import y\n")  # a name that only starts alike is allowed
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert [v.split(" imports ")[1] for v in violations("embedding", FORBIDDEN["embedding"])] == [
        "lightning.pytorch", "ctr_lightning.topology.planner", "ctr_lightning.strategies", "pytorch_lightning"]


def test_importing_the_tables_loads_no_lightning_and_no_tensorboard():
    script = ("import sys, ctr_lightning.embedding\n"
              "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in "
              "('lightning', 'pytorch_lightning')} | {m for m in sys.modules if 'tensorboard' in m}))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HEAVY []" in result.stdout.splitlines()
