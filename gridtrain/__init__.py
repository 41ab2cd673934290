"""gridtrain: train GPT-style language models on a data x pipeline x tensor parallel grid."""

__version__ = "0.1.0"
