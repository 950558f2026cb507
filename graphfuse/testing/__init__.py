"""What the demo, the benchmarks and the tests share: spawning real process groups (launch) and the
small GPT (models)."""
