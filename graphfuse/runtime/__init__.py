"""Owns tensors across steps and runs them: binding, the step call, guards, batches, the deferred
all-gather, start-up phases, step metrics."""
