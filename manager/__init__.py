"""Varuna manager package."""
