"""The house rules of issue 12, enforced over graphfuse/ and passes/: no module over 350 lines and
no function over 60 lines (measured with ast, from `def` to its last line)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 350, 60

# Offenders in files other helpers are rewriting now; remove each entry once its file is fixed
# (the test below fails for an entry that no longer offends, so that the list only shrinks).
ALLOWED: set[str] = set()  # offenders allowed while being rewritten; empty since the issue-12/13/15 merges


def offenders() -> dict[str, int]:
    """{"path" or "path:function": its length in lines} for every module or function over its limit."""
    out = {}
    for package in ("graphfuse", "passes"):
        for f in sorted((ROOT / package).rglob("*.py")):
            name, source = f.relative_to(ROOT).as_posix(), f.read_text()
            if len(source.splitlines()) > MAX_MODULE_LINES:
                out[name] = len(source.splitlines())
            for node in ast.walk(ast.parse(source, name)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        out[f"{name}:{node.name}"] = length
    return out


def test_no_module_over_350_lines_and_no_function_over_60_lines():
    found = offenders()
    assert set(found) <= ALLOWED, {k: v for k, v in found.items() if k not in ALLOWED}


def test_the_allowlist_holds_only_current_offenders():
    stale = ALLOWED - set(offenders())
    assert not stale, f"fixed, remove from ALLOWED in tests/test_house.py: {sorted(stale)}"


def test_the_measure_sees_a_long_function(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "graphfuse").mkdir()
    (tmp_path / "passes").mkdir()
    (tmp_path / "graphfuse" / "long.py").write_text(f"def long():\n{body}\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert offenders() == {"graphfuse/long.py:long": MAX_FUNCTION_LINES + 1}
