"""The measurements of tools/bench_multigpu.py, one module each (correctness, comm, step), over common."""
