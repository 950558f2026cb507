"""A training step -> Program: capture() traces forward, backward and update (step.py), the update alone
(update.py), and the tracing helpers both use (tracing.py).

`gf.capture` is the function, bound by graphfuse's face after this package is imported; import the
modules here by their full names (`graphfuse.capture.step`)."""
