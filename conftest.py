# Loads the conformance suite's pytest plugin (options, tier markers, backend selection) for every
# test run from this repository: `pytest conformance/` and the self-tests in `tests/` alike.
pytest_plugins = ["conformance.plugin"]
