"""graphfuse in the trainers people already use: `graphfuse.integrations.transformers.GraphfuseTrainer`
(Hugging Face Trainer) and `graphfuse.integrations.accelerate.prepare` (a plain accelerate loop).
Each module imports its library (the `hf` extra, `pip install graphfuse[hf]`); this package imports neither."""
