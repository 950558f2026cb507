"""graphfuse's version: one place that the face, program files and the backend's metadata read."""

__version__ = "0.1.0"
