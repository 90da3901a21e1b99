"""bapo-megatron: BAPO reinforcement learning of LLMs on Megatron-Core and SGLang."""

__version__ = "0.1.0"
