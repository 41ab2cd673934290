"""gridtrain: train GPT-style language models on a data x pipeline x tensor parallel grid."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``gridtrain.load_model`` without importing torch at ``import gridtrain`` (the
    spawned workers import the package before they may import torch)."""
    if name == "load_model":
        from gridtrain.checkpoint.huggingface import load_model

        return load_model
    raise AttributeError(f"module 'gridtrain' has no attribute {name!r}")
