"""The MoE area's part of every report: its cross-case diagnosis (``Likely causes across cases``)."""
from __future__ import annotations

from conformance._framework.diagnosis_cases import CaseDiagnoser, register_case_diagnoser
from conformance.moe.cases import MOE_CASES
from conformance.moe.diagnosis import diagnose_moe_cases

register_case_diagnoser(CaseDiagnoser("MoE", "conformance/moe/test_moe.py", {c.id: c for c in MOE_CASES}, diagnose_moe_cases))
