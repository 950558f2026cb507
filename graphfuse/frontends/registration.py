"""backend="graphfuse" known to torch.compile: by the package's entry point when installed, and
by the same entry point declared through a metadata finder when graphfuse is imported from a
source tree (PYTHONPATH), without importing torch._dynamo at graphfuse's import."""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys

from graphfuse._version import __version__
from graphfuse.frontends.torch_compile import graphfuse_backend

# The same entry point as pyproject.toml's [project.entry-points.torch_dynamo_backends]: change both together.
ENTRY_POINT = "[torch_dynamo_backends]\ngraphfuse = graphfuse.frontends.torch_compile:graphfuse_backend\n"


class _SourceTreeDistribution(importlib.metadata.Distribution):
    """What `pip install` would declare for graphfuse, for a graphfuse imported from a source
    tree (PYTHONPATH): its name, version and torch_dynamo_backends entry point."""

    def read_text(self, filename: str) -> str | None:
        if filename == "entry_points.txt":
            return ENTRY_POINT
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: graphfuse\nVersion: {__version__}\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(__file__).parent.parent / path


class _SourceTreeFinder:
    """A sys.meta_path entry that finds no module, only graphfuse's distribution metadata."""

    @staticmethod
    def find_spec(*args, **kwargs) -> None:
        return None

    @staticmethod
    def find_distributions(context=None):
        if getattr(context, "name", None) in (None, "graphfuse"):
            yield _SourceTreeDistribution()


def register() -> None:
    """Make backend="graphfuse" known to torch.compile when graphfuse is not pip-installed.
    Installed, its entry point does it (and a second registration would make dynamo raise
    "duplicate name"). Not installed, graphfuse declares the same entry point through a
    metadata finder, which dynamo reads when it first looks a backend name up, so importing
    graphfuse does not import torch._dynamo (0.4 s); if dynamo has already read the entry
    points, the backend is registered directly."""
    if "graphfuse" in importlib.metadata.entry_points(group="torch_dynamo_backends").names:
        return
    sys.meta_path.append(_SourceTreeFinder())
    registry = sys.modules.get("torch._dynamo.backends.registry")
    if registry is not None and "graphfuse" not in registry._COMPILER_FNS:
        registry.register_backend(graphfuse_backend, name="graphfuse")
