"""Debugging tools: parity checks and the first-divergent-op finder."""
