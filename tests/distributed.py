"""Multi-rank tests run on real Gloo process groups (no mocked collectives): see graphfuse.launch."""

from graphfuse.launch import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
