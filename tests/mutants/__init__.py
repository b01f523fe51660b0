"""Deliberately broken backends ("mutants") and correct-but-different ones, per area: the self-tests prove
that the conformance checks reject every mutant and accept every variant."""
