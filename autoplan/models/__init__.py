"""Models shipped with autoplan: a GPT (GPT-2/GPT-3 shaped) and small test models."""

from .gpt import GPT, GPTConfig
from .small import SmallCNN, SmallMLP

__all__ = ["GPT", "GPTConfig", "SmallCNN", "SmallMLP"]
