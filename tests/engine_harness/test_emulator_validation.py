"""The emulator rejects bad inputs the way FlashInfer 0.7.4 does: each case names the FlashInfer check
it mirrors (``source``) and the exception type (and message) that check raises. The same cases run
against the real library on the ``b200`` tier (``conformance/engine_harness/test_emulator_vs_flashinfer.py``)."""
from __future__ import annotations

import pytest

from conformance.testing import as_params
from conformance.engine_harness.emulator_cases import BAD_INPUT_CASES, BadInputCase, emulator_api


def test_enough_cases():
    """The acceptance asks for at least 15 bad-input cases that real FlashInfer rejects too."""
    assert sum(c.real_raises for c in BAD_INPUT_CASES) >= 15


@pytest.mark.parametrize("case", as_params(BAD_INPUT_CASES))
def test_emulator_rejects_like_flashinfer(case: BadInputCase):
    with pytest.raises(Exception) as info:
        case.call(emulator_api(), "cpu")
    case.expect.check(info.value)
