"""The ``golden`` fixture: syrupy's ``snapshot`` with the tensor extension of :mod:`conformance._framework.snapshots`, so
``assert golden == {"codes": t, "out": Approx(y, rtol, atol, why)}`` stores/compares under fixtures/snapshots/."""
from __future__ import annotations

import pytest

from conformance._framework.snapshots import TensorSnapshotExtension


@pytest.fixture
def golden(snapshot):
    return snapshot.use_extension(TensorSnapshotExtension)
