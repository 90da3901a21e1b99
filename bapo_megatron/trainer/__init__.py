"""Megatron-Core side: model build, vocab-parallel log-probs, the loss in the pipeline schedule."""
