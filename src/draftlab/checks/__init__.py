"""Correctness checks: the lossless audit and the row-invariance check of the exact route."""
