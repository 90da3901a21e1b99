"""Prompt data: record files read where they lie (records.py), prompts rendered for the model (prompts.py)."""
