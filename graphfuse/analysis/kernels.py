"""The kernels in inductor's generated code and what the step launches, read from its output
modules (the `.py` files with a `call` function): tools/kernel_launches.py prints it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

_TRITON_DEF = re.compile(r"^(triton_(\w+?)_\w+) = async_compile\.triton\(", re.M)
_CPP_DEF = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_ATEN = re.compile(r"\btorch\.ops\.(\w+\.\w+)\.\w+\(")


def family(kernel: str) -> str:
    """A kernel's name without its index: the kernels of identical blocks share a family."""
    return re.sub(r"_\d+$", "", kernel)


def _call_body(source: str) -> str:
    """The text of the module's `call` function (the launches), up to the next top-level line."""
    start = re.search(r"^(\s*)def call\(", source, re.M)
    if start is None:
        return ""
    indent = len(start.group(1))
    lines = source[start.end() :].splitlines()[1:]
    body = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(body)


def analyse(source: str) -> dict:
    """Kernel definitions, launches and extern calls of one output module."""
    triton = {name: kind for name, kind in _TRITON_DEF.findall(source)}
    cpp = set(_CPP_DEF.findall(source))
    body = "\n".join(line for line in _call_body(source).splitlines() if not line.lstrip().startswith("#"))
    launches: Counter = Counter()
    for name in triton:
        launches[name] = len(re.findall(rf"\b{name}\.run\(", body))
    for name in cpp:
        launches[name] = len(re.findall(rf"\b{name}\(", body))
    kinds = Counter(triton.values())
    if cpp:
        kinds["cpp"] = len(cpp)
    families: Counter = Counter()
    for name, n in launches.items():
        families[family(name)] += n
    return {
        "kernels": len(triton) + len(cpp),
        "kinds": dict(kinds),
        "launches": sum(launches.values()),
        "extern_calls": dict(Counter(_EXTERN.findall(body))),
        "aten_calls": dict(Counter(_ATEN.findall(body))),
        "families": dict(families.most_common()),
    }


def output_modules(root: Path) -> list[Path]:
    """Inductor's output modules under `root` (a cache directory or one file)."""
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    return [f for f in files if re.search(r"^\s*def call\(", f.read_text(errors="replace"), re.M)]
