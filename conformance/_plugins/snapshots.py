"""The ``golden`` fixture: syrupy's ``snapshot`` with the tensor extension of :mod:`conformance.snapshots`, so
``assert golden == {"codes": t, "out": Approx(y, rtol, atol, why)}`` stores/compares under fixtures/snapshots/."""
from __future__ import annotations

import pytest

from conformance.snapshots import TensorSnapshotExtension


@pytest.fixture
def golden(snapshot):
    return snapshot.use_extension(TensorSnapshotExtension)
