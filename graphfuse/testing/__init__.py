"""What the demo, the benchmarks and the tests share: spawning real process groups (launch), the
small GPT (models) and per-rank progress files (progress)."""
