"""Sweeps of the trainer (grids in the TOML files here) and their reports."""
