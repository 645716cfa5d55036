"""Benchmarks of memcc against its peers (not part of the installed tool)."""
