"""The house's sizes: no module of the package or of tools/ over 500 lines, no function over 60.

A long function is where concerns pile up unseen (cli.dry_run, EngineCore, mcore_to_hf all grew
past the limit one feature at a time); the check keeps the limit a rule rather than a hope."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLACES = ("bapo_megatron", "tools")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def oversized(root: Path = ROOT, places=PLACES) -> list[str]:
    """'path: N lines' for every file over the limit, 'path:line name: N lines' for every function."""
    found = []
    for place in places:
        for file in sorted((root / place).rglob("*.py")):
            text = file.read_text()
            name = file.relative_to(root)
            if (lines := text.count("\n")) > MAX_FILE_LINES:
                found.append(f"{name}: {lines} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_file_or_function_over_the_limits():
    assert not oversized(), "\n".join(oversized())


def test_the_check_sees_a_long_function_and_a_long_file(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("def f():\n" + body + "\n" * MAX_FILE_LINES)
    (tmp_path / "pkg" / "short.py").write_text("def g():\n    return 1\n")
    assert oversized(tmp_path, ("pkg",)) == ["pkg/long.py: 561 lines", "pkg/long.py:1 f: 61 lines"]
