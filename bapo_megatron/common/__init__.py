"""What the trainer, the engines and the weight tools share: the data types (Sample, RolloutBatch,
ModelSpec), the SGLang protocol, the weight-update group, tensor handles, and the Hugging Face
checkpoint format. It imports nothing of trainer/, rollout/ or weights/ (tests/unit/test_layering.py).

Layers, each importing only those before it: errors, fsutil, algo, config -> common ->
trainer, rollout -> weights -> the driver modules (train, driver, cli, logger)."""
