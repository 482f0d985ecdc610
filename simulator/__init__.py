"""Varuna simulator package."""
