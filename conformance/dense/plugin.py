"""The dense area's part of every report: its cross-case diagnosis (``Likely causes across cases``)."""
from __future__ import annotations

from conformance._framework.diagnosis_cases import CaseDiagnoser, register_case_diagnoser
from conformance.dense.cases import DENSE_CASES
from conformance.dense.diagnosis import diagnose_dense_cases

register_case_diagnoser(CaseDiagnoser("dense", "conformance/dense/test_dense.py", {c.id: c for c in DENSE_CASES}, diagnose_dense_cases))
