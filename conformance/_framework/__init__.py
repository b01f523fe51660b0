"""The suite's pytest framework (private): cases as data, hardware tiers and their markers, the ``--backend``
option, expectation files, reports, tensor snapshots. :mod:`conformance.plugin` loads it."""
