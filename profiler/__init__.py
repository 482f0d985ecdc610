"""Varuna profiler package."""
