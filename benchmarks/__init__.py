"""Benchmarks for gridtrain; run each module as a script (see benchmarks/README.md)."""
