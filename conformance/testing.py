"""The suite's public helpers: what a test, a backend or a report reader may import besides the vendor
interfaces (:mod:`conformance.interfaces`). Everything under ``conformance._framework`` is private and may
change without notice; docs/ cite these names only.

* :class:`Approx`: a float tensor in a ``golden`` snapshot, compared within a tolerance whose derivation it
  carries (docs/snapshots.md);
* :func:`record_tensors`: save named tensors as the running test's failure artifacts from code that has no
  fixture at hand (docs/reports.md);
* :class:`Builtin` / :func:`register`: add a built-in implementation (a row of the selection table that
  ``--backend``, ``--engine`` and ``--server-api`` read), e.g. from a vendor's pytest plugin;
* :func:`detect_hardware` / :class:`Hardware` / :class:`Gpu`: the GPUs this process sees, as the tier markers
  and ``summary.json`` describe them.
* :func:`as_params`: parametrize a test over cases (anything with an ``id`` and a ``tier``): one ``pytest.param``
  each, with its id and its tier marker (duplicate ids and unknown tiers rejected).
* :data:`ENTRY_PROPERTY` / :data:`REASON_PROPERTY` / :data:`WHY_NOT_STRICT_PROPERTY`: the JUnit ``<property>``
  names a test covered by an expectation-file entry carries (docs/reports.md), for report readers.
"""
from __future__ import annotations

from conformance._framework.cases import as_params
from conformance._framework.expectations import ENTRY_PROPERTY, REASON_PROPERTY, WHY_NOT_STRICT_PROPERTY
from conformance._framework.reporting import record_tensors
from conformance._framework.selection import Builtin, register
from conformance._framework.snapshots import Approx
from conformance._framework.tiers import Gpu, Hardware, detect_hardware

__all__ = ["ENTRY_PROPERTY", "REASON_PROPERTY", "WHY_NOT_STRICT_PROPERTY", "Approx", "Builtin", "Gpu", "Hardware",
           "as_params", "detect_hardware", "record_tensors", "register"]
