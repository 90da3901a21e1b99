"""Weights: HF <-> Megatron layout maps, conversion, resharding to the inference layout."""
