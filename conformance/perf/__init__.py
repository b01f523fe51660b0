"""The perf tier: a backend's time next to a BF16 baseline and the W4A16 floor (measurements, plugin, tests)."""
