"""Program -> executable: inductor with graphfuse's settings, the in-place epilogue, pieces and the
processes that compile them, whole-step CUDA graphs."""
