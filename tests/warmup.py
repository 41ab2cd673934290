"""Imported by the test session's warm server (tests/conftest.py, gridtrain/runtime/warm.py)
before its first fork: the built-in corpus, which most multi-process tests train on,
read and tokenized once for every worker of the session instead of once per rank."""

from gridtrain.data.corpora import builtin_bytes

builtin_bytes()
