"""Program -> executable: inductor with graphfuse's settings, the in-place epilogue, pieces and the
processes that compile them, whole-step CUDA graphs."""

from graphfuse.compiler.inductor import PHASES, use_inductor_defaults

# What tools outside the library may use (tools/bench_startup.py, check_compile_speed.py,
# bench_first_step.py); the rest is internal to graphfuse.
__all__ = ["PHASES", "use_inductor_defaults"]
