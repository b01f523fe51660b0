"""Every stored snapshot under fixtures/snapshots/ belongs to a test that still exists.

syrupy's own unused-snapshot check is a warning here (``--snapshot-warn-unused`` in pyproject's addopts): under
pytest-xdist it rebuilds "used" from the workers' reports, and snapshots whose test was *skipped* on one worker
(tests/server/test_server_golden.py's writer runs only with --snapshot-update) were counted unused in some worker layouts
and not in others, which turned a run with every test passing into exit code 1 (issue 21). This check is the
deterministic replacement: a snapshot file is stale when its test module or test function no longer exists.
False-failure risk: none for a file syrupy wrote (syrupy names it <module>/<function>[<params>].<ext>);
a function defined by other means than ``def`` would be reported stale (none here)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SNAPSHOT_NAME = re.compile(r"^(?P<function>[A-Za-z_][A-Za-z0-9_]*)(\[.*\])?\.")


def stale_snapshot_files(snapshot_dir: Path, test_roots: list[Path]) -> list[str]:
    """Snapshot files (relative to ``snapshot_dir``) whose test module or ``def`` of the test function is missing."""
    stale = []
    for path in sorted(snapshot_dir.glob("*/*")):
        module = path.parent.name
        if module.startswith("_"):  # written directly, not by syrupy (tests/server/test_server_golden.py checks them)
            continue
        sources = [p for root in test_roots for p in root.rglob(f"{module}.py")]
        match = _SNAPSHOT_NAME.match(path.name)
        defined = match is not None and any(
            re.search(rf"^\s*(async\s+)?def {match['function']}\(", p.read_text(), re.M) for p in sources
        )
        if not defined:
            stale.append(str(path.relative_to(snapshot_dir)))
    return stale


def test_every_stored_snapshot_has_its_test():
    stale = stale_snapshot_files(ROOT / "fixtures" / "snapshots", [ROOT / "tests", ROOT / "conformance"])
    assert not stale, f"snapshot files whose test is gone (delete them or regenerate with --snapshot-update): {stale}"


def test_a_renamed_test_leaves_its_snapshot_reported(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("def test_kept(golden):\n    pass\n")
    snaps = tmp_path / "snaps" / "test_mod"
    snaps.mkdir(parents=True)
    for name in ("test_kept[a].tensors.json", "test_renamed[a].tensors.json"):
        (snaps / name).write_text("{}")
    (tmp_path / "snaps" / "test_gone_module").mkdir()
    (tmp_path / "snaps" / "test_gone_module" / "test_kept.tensors.json").write_text("{}")
    assert stale_snapshot_files(tmp_path / "snaps", [tmp_path / "tests"]) == [
        "test_gone_module/test_kept.tensors.json",
        "test_mod/test_renamed[a].tensors.json",
    ]
