"""The values every stage hands on: Program and TensorMeta, the Signature of roles, the bucket layout,
the aligned blocks."""
