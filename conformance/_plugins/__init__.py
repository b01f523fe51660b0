"""pytest plugin modules of the suite, one per area; :mod:`conformance.plugin` loads them all."""
