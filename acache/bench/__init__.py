"""Benchmarks behind ``acache bench``."""
