"""Triton rendering of an instance."""
