"""The fixture checkpoints a scenario serves: a family (e.g. ``dense-nvfp4_awq``) with weight sets ``a``
(served at start), ``b`` (different weights) and ``corrupt`` (``b`` minus one tensor of the last layer)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODELS = ("dense-nvfp4_awq", "moe-w4a16_nvfp4")


@dataclass(frozen=True)
class FixtureModel:
    family: str
    root: Path

    def path(self, weight_set: str) -> str:
        return str((self.root / f"{self.family}-{weight_set}").resolve())

    @property
    def a(self) -> str:
        return self.path("a")

    @property
    def b(self) -> str:
        return self.path("b")

    @property
    def corrupt(self) -> str:
        return self.path("corrupt")

    @property
    def is_awq(self) -> bool:
        return "awq" in self.family

    @classmethod
    def from_checkpoint_path(cls, path: str) -> "FixtureModel":
        p = Path(path)
        if not p.name.endswith("-a"):
            raise ValueError(f"{path!r} is not a fixture checkpoint of weight set 'a' (<family>-a)")
        return cls(p.name[:-2], p.parent)


def ensure_fixture_root(root: str | None) -> Path:
    """The fixture directory, built on first use by fixtures/make_checkpoints.py."""
    from fixtures.make_checkpoints import DEFAULT_OUT, ensure_checkpoints

    return ensure_checkpoints(Path(root) if root else DEFAULT_OUT)
