"""The kernels in inductor's generated code, and what the step launches: read from the output
modules (the `.py` files with a `call` function) under inductor cache directories.

For each module: the distinct kernel definitions by kind (Triton pointwise `poi`, persistent
reduction `per`, reduction `red`; C++ `cpp`), the kernel launches in `call` (a kernel defined
once may be launched many times), the calls of extern kernels (`extern_kernels.mm`, ...) and
of ATen ops run as they are (`torch.ops.aten....`), and the launches grouped by kernel family
(the kernel's name without its index: `triton_poi_fused_cat_view_86` -> `triton_poi_fused_cat_view`).

    python tools/bench_startup.py --device cuda ... --starts fresh torch_compile --cache-dir /tmp/ic
    python tools/kernel_launches.py /tmp/ic /tmp/ic-torch-compile [--top 20] [--json]
"""

from __future__ import annotations

import argparse
import json
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
    lines = source[start.end():].splitlines()[1:]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path, help="inductor cache directories or output modules")
    ap.add_argument("--top", type=int, default=15, help="kernel families to print per module, most launched first")
    ap.add_argument("--json", action="store_true", help="print the whole analysis as JSON")
    args = ap.parse_args()
    report = {str(p): {str(f): analyse(f.read_text(errors="replace")) for f in output_modules(p)} for p in args.paths}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for path, modules in report.items():
        if not modules:
            print(f"{path}: no output module (no .py file with a call function)")
        for name, m in modules.items():
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(m["kinds"].items()))
            extern = sum(m["extern_calls"].values())
            print(f"{name}: {m['kernels']} kernels ({kinds}), {m['launches']} launches, {extern} extern calls, "
                  f"{sum(m['aten_calls'].values())} ATen calls")
            for fam, n in list(m["families"].items())[: args.top]:
                print(f"  {n:5d}  {fam}")


if __name__ == "__main__":
    main()
