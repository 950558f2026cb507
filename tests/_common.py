"""What the tests share: the repository's root, and real Gloo process groups for multi-rank tests
(no mocked collectives; see graphfuse.testing.launch)."""

from pathlib import Path

from graphfuse.testing.launch import free_port, run_ranks

ROOT = Path(__file__).resolve().parents[1]  # the repository: docs/, tools/, tests/fixtures/

__all__ = ["ROOT", "free_port", "run_ranks"]
