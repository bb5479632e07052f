"""No class of the package over 300 lines of code, so that each stays one job a newcomer can read.

Lines of code: the class's lines less docstrings, comments and blank lines (a docstring
that explains more is never the reason to split a class).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ctr_lightning", "strategies", "datamodules")
MAX_CODE_LINES = 300


def docstring_lines(node: ast.AST) -> set[int]:
    lines: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def class_code_lines(source: str) -> dict[str, int]:
    """Lines of code of every class in ``source`` (nested ones under their dotted name)."""
    tree = ast.parse(source)
    text = source.splitlines()
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                skip = docstring_lines(child)
                out[prefix + child.name] = sum(
                    1 for number in range(child.lineno, child.end_lineno + 1)
                    if number not in skip and text[number - 1].strip() and not text[number - 1].strip().startswith("#"))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def test_counting_leaves_out_docstrings_comments_and_blank_lines():
    source = 'class A:\n    """Doc.\n\n    More.\n    """\n\n    # why\n    x = 1\n\n    def f(self):\n        """F."""\n        return 2\n'
    assert class_code_lines(source) == {"A": 4}  # class line, x, def, return


def test_a_long_class_is_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CODE_LINES + 1))
    assert class_code_lines(f"class Big:\n{body}\n")["Big"] > MAX_CODE_LINES


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_over_300_lines_of_code(package):
    over = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, lines in class_code_lines(path.read_text()).items():
            if lines > MAX_CODE_LINES:
                over.append(f"{path.relative_to(ROOT)}: {name} has {lines} lines of code")
    assert not over, "split these along their seams:\n" + "\n".join(over)
