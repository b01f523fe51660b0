"""The fused-MoE W4A16 area: cases (routing inputs included), checks, error bounds (derived)."""
