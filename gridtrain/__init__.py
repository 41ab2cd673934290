"""gridtrain: train transformer language models on a data x tensor x pipeline x context x expert parallel grid.

The public Python API, importable from the package itself:

* :func:`pretrain` (``gridtrain.training.loop``): the training loop with your providers;
* :class:`Datasets` (``gridtrain.data``): what a datasets provider returns;
* :func:`load_model` (``gridtrain.checkpoint.huggingface``): a trained model as an
  ``nn.Module`` that returns logits.

Where everything else lives is in the subpackages' docstrings and docs/design.md.
"""

__version__ = "0.1.0"

# name -> module that defines it; imported on first use, so that ``import gridtrain``
# does not import torch (spawned workers import the package before they may import torch)
_PUBLIC = {
    "pretrain": "gridtrain.training.loop",
    "Datasets": "gridtrain.data",
    "load_model": "gridtrain.checkpoint.huggingface",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'gridtrain' has no attribute {name!r}")
