"""The ways in: DistModel (gf.compile), ShardedOptimizer (gf.shard_optimizer), the torch.compile
backend and its registration, the backward rewrite, and the PyTorch habits both keep."""
