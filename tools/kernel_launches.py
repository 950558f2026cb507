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
from pathlib import Path

from graphfuse.analysis import analyse, output_modules


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
            print(
                f"{name}: {m['kernels']} kernels ({kinds}), {m['launches']} launches, {extern} extern calls, "
                f"{sum(m['aten_calls'].values())} ATen calls"
            )
            for fam, n in list(m["families"].items())[: args.top]:
                print(f"  {n:5d}  {fam}")


if __name__ == "__main__":
    main()
