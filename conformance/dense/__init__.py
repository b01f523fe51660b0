"""The dense W4A16 area: cases, checks, error bounds (derived), single-rounding checks, golden data."""
