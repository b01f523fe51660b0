"""The checkpoints the scenarios serve and their golden truths.

* Fixture families (``--server-models``, e.g. ``dense-nvfp4_awq``): ``<root>/<family>-a`` (served at start),
  ``-b`` (different weights) and ``-corrupt`` (``b`` minus one tensor of its last layer), built by
  fixtures/make_checkpoints.py on first use into its default directory: a clone's ``fixtures/checkpoints/``
  (git-ignored), or for a pip-installed suite the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``,
  ``nvfp4-w4a16-conformance/checkpoints``). A directory given with ``--server-checkpoints`` is only read: it must
  hold an up-to-date build.
* A user's checkpoint (``--server-checkpoint PATH``, repeatable): ``a`` is the user's directory, read only;
  ``b`` and ``corrupt`` are derived (conformance/server/derive.py) into the session's work directory,
  which the suite creates and removes; golden outputs are computed by the reference model, once per session.
* ``--server-weights bf16``: every weight set of either kind is served as its BF16-dequantized copy
  (conformance/server/bf16_copies.py), made into the session's work directory; the truth stays the NVFP4
  original's (``ServedModel.original``).
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from conformance._framework.data import checkpoint_builder
from conformance.server.derive import derive_corrupt, derive_different_weights
from conformance.server.golden import MAX_NEW_TOKENS, PROMPTS, GoldenTruth, label_of, load_fixture_golden

DEFAULT_MODELS = ("dense-nvfp4_awq", "moe-w4a16_nvfp4")
SERVED_WEIGHTS = ("nvfp4", "bf16")  # --server-weights
WORK_DIR_ENV = "NVFP4_SERVER_WORK_DIR"
USER_PREFIX = "ckpt"


class ModelError(ValueError):
    """A checkpoint or tokenizer the scenarios cannot use; the message says why and what to pass."""


@dataclass(frozen=True)
class ServedModel:
    """One served checkpoint: weight sets ``a`` / ``b``, the corrupt checkpoint and the tokenizer."""

    name: str
    a: str
    b: str
    corrupt: str
    corrupt_tensor: str     # the one tensor ``corrupt`` lacks
    tokenizer: str          # tokenizer.json the server is started with and the prompts are encoded with
    user: bool = False      # a user's checkpoint (never written)
    original: "ServedModel | None" = None  # BF16 copies: the NVFP4 checkpoints they were made from (the truth)

    def path(self, weight_set: str) -> str:
        return {"a": self.a, "b": self.b, "corrupt": self.corrupt}[weight_set]

    @property
    def truth_model(self) -> "ServedModel":
        """The checkpoints the golden truth is of: the NVFP4 originals of BF16 copies, else these."""
        return self.original or self


# ----------------------------------------------------------------------------------------- tokenizers
def resolve_tokenizer(checkpoint: str, tokenizer: str | None) -> str:
    """The tokenizer.json for ``checkpoint``: ``tokenizer`` (a file, or a directory holding tokenizer.json)
    when given, else the checkpoint's own."""
    if tokenizer:
        p = Path(tokenizer)
        candidate = p / "tokenizer.json" if p.is_dir() else p
        if not candidate.is_file():
            raise ModelError(f"--tokenizer {tokenizer!r}: no tokenizer.json there")
        return str(candidate.resolve())
    own = Path(checkpoint) / "tokenizer.json"
    if not own.is_file():
        raise ModelError(f"checkpoint {checkpoint!r} has no tokenizer.json (ModelOpt exports have none): pass "
                         f"--tokenizer PATH (a tokenizer.json, or the original model's directory holding one)")
    return str(own.resolve())


def check_tokenizer_fits(checkpoint: str, tokenizer_json: str) -> list[list[int]]:
    """Encode :data:`PROMPTS`; raise :class:`ModelError` unless every id the tokenizer can produce is one
    the model can embed. Returns the prompt ids."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tokenizer_json)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the user's file
        raise ModelError(f"{tokenizer_json}: not a tokenizer.json the `tokenizers` library can read ({exc})") from exc
    config = Path(checkpoint) / "config.json"
    try:
        vocab = int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{config}: cannot read vocab_size ({exc})") from exc
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise ModelError(f"tokenizer {tokenizer_json} has {size} tokens but the model's vocabulary is {vocab}: it "
                         f"does not fit this checkpoint (pass the model's own tokenizer with --tokenizer)")
    ids = [tok.encode(p).ids for p in PROMPTS]
    for p, seq in zip(PROMPTS, ids):
        if not seq:
            raise ModelError(f"tokenizer {tokenizer_json} encodes the prompt {p!r} to no tokens")
    return ids


def tokenizer_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json).get_vocab_size(with_added_tokens=True)


# ----------------------------------------------------------------------------------------- fixtures
def ensure_fixture_root(root: str | None) -> Path:
    """The fixture directory: the builder's default (built on first use), or a directory the user
    built (read only: never written; an error if it is not an up-to-date build)."""
    builder = checkpoint_builder()
    if not root or Path(root).resolve() == builder.DEFAULT_OUT.resolve():
        return builder.ensure_checkpoints(builder.DEFAULT_OUT)
    if not builder.is_up_to_date(Path(root)):
        raise ModelError(f"--server-checkpoints {root!r} does not hold an up-to-date fixture build (the suite never "
                         f"writes there): build it with `python -m nvfp4_conformance_fixtures.make_checkpoints --out {root}`")
    return Path(root)


def fixture_model(family: str, root: Path) -> ServedModel:
    builder = checkpoint_builder()
    arch = family.split("-", 1)[0]
    if arch not in ("dense", "moe") or not (root / f"{family}-a").is_dir():
        raise ModelError(f"unknown fixture family {family!r} (in {root}: "
                         f"{sorted(p.name[:-2] for p in root.glob('*-a'))})")
    a, b, corrupt = (str((root / f"{family}-{s}").resolve()) for s in ("a", "b", "corrupt"))
    return ServedModel(family, a, b, corrupt, builder.corrupt_tensor_name(arch, builder.hf_config(arch)),
                       str(Path(a) / "tokenizer.json"))


# ----------------------------------------------------------------------------------------- the session's work directory
def work_dir() -> Path:
    """The session's own directory (shared by pytest-xdist workers through ``NVFP4_SERVER_WORK_DIR``)."""
    path = os.environ.get(WORK_DIR_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="nvfp4-server-suite-")
        os.environ[WORK_DIR_ENV] = path
        atexit.register(shutil.rmtree, path, True)  # made here: removed at exit whoever else removes it first
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def remove_work_dir() -> None:
    path = os.environ.pop(WORK_DIR_ENV, None)
    if path and Path(path).name.startswith("nvfp4-server-suite-"):
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ----------------------------------------------------------------------------------------- the catalog
class ModelCatalog:
    """The session's served models (fixture families or user checkpoints) and their golden truths."""

    def __init__(self, families: list[str], fixture_root: str | None, checkpoints: list[str],
                 tokenizer: str | None, weights: str = "nvfp4", truth_device: str | None = None):
        if weights not in SERVED_WEIGHTS:
            raise ModelError(f"--server-weights {weights!r}: choose from {', '.join(SERVED_WEIGHTS)}")
        self.families, self.fixture_root, self.weights = families, fixture_root, weights
        self.checkpoints = [str(Path(c).resolve()) for c in checkpoints]
        #: served name -> user checkpoint (names carry the index, so two checkpoints with one label differ)
        self._user_names = {f"{USER_PREFIX}{i}-{label_of(c)}": c for i, c in enumerate(self.checkpoints)}
        self.tokenizer = tokenizer
        self.truth_device = truth_device  # where the reference's truth runs (None: CUDA if available)
        self._root: Path | None = None
        self._models: dict[str, ServedModel] = {}
        self._truths: dict[tuple[str, str], GoldenTruth] = {}

    def names(self) -> list[str]:
        return list(self._user_names) if self.checkpoints else list(self.families)

    def serve_fixture_dir(self, root: Path, family: str) -> None:
        """Serve fixture family ``family`` from the build directory ``root`` (an attached server's checkpoint)."""
        self.families, self.fixture_root, self._root = [family], str(root), None
        self._models.clear()

    def check_user_checkpoints(self) -> None:
        """Start-up checks of every user checkpoint: one the reference can serve (every tensor it needs, no
        KV-cache quantization, BF16 unquantized tensors: reference_impl/model.validate_checkpoint reads them
        all once), and a tokenizer present and fitting."""
        from reference_impl.model.checkpoint import CheckpointError, load_checkpoint
        from reference_impl.model import validate_checkpoint

        for c in self.checkpoints:
            if not (Path(c) / "config.json").is_file():
                raise ModelError(f"--server-checkpoint {c!r}: no config.json (expects a Hugging Face layout directory)")
            try:
                validate_checkpoint(load_checkpoint(c))
            except CheckpointError as exc:
                raise ModelError(f"--server-checkpoint {c!r} cannot be served by the reference: {exc}") from exc
            check_tokenizer_fits(c, resolve_tokenizer(c, self.tokenizer))

    def served(self, name: str) -> ServedModel:
        if name not in self._models:
            model = self._user_model(name) if self.checkpoints else self._fixture(name)
            self._models[name] = self._bf16_copies(model) if self.weights == "bf16" else model
        return self._models[name]

    def _bf16_copies(self, model: ServedModel) -> ServedModel:
        """``model`` served as BF16-dequantized copies of its weight sets (made once per session)."""
        from conformance.server.bf16_copies import STAMP, copy_tensor_name, write_bf16_copy

        base = work_dir() / f"bf16-{model.name}"
        with _locked(work_dir() / f"bf16-{model.name}.lock"):
            for weight_set in ("a", "b", "corrupt"):
                dst = base / weight_set
                if not (dst / STAMP).is_file():
                    shutil.rmtree(dst, ignore_errors=True)
                    write_bf16_copy(model.path(weight_set), dst)
        tokenizer = model.tokenizer
        if Path(tokenizer).parent == Path(model.a):  # the checkpoint's own tokenizer: the copy has it too
            tokenizer = str(base / "a" / Path(tokenizer).name)
        return ServedModel(model.name, str(base / "a"), str(base / "b"), str(base / "corrupt"),
                           copy_tensor_name(model.corrupt_tensor), tokenizer, model.user, model)

    def _fixture(self, family: str) -> ServedModel:
        if self._root is None:
            self._root = ensure_fixture_root(self.fixture_root)
        return fixture_model(family, self._root)

    def _user_model(self, name: str) -> ServedModel:
        src = self._user_names.get(name)
        if src is None:
            raise ModelError(f"no user checkpoint is served as {name!r} (served: {', '.join(self._user_names)})")
        tokenizer = resolve_tokenizer(src, self.tokenizer)
        base = work_dir() / name
        with _locked(work_dir() / f"{name}.lock"):
            done = base / "derived.json"
            if not done.is_file():
                shutil.rmtree(base, ignore_errors=True)
                unchanged = derive_different_weights(Path(src), base / "b")
                tensor = derive_corrupt(base / "b", base / "corrupt")
                done.write_text(json.dumps({"corrupt_tensor": tensor, "unchanged_in_b": unchanged}))
            info = json.loads(done.read_text())
        return ServedModel(name, src, str(base / "b"), str(base / "corrupt"), info["corrupt_tensor"], tokenizer, True)

    def truth(self, model: ServedModel, weight_set: str) -> GoldenTruth:
        model = model.truth_model
        key = (model.name, weight_set)
        if key not in self._truths:
            self._truths[key] = self._computed(model, weight_set) if model.user else self._snapshot(model, weight_set)
        return self._truths[key]

    def _snapshot(self, model: ServedModel, weight_set: str) -> GoldenTruth:
        from reference_impl.model.checkpoint import read_tensors
        from reference_impl.truth.golden import checkpoint_digest

        path = model.path(weight_set)
        golden = load_fixture_golden(model.name, weight_set)
        if checkpoint_digest(read_tensors(path)) != golden.checkpoint_digest:
            raise ModelError(f"fixture checkpoint {path} is not the one its golden snapshot was made from: rebuild the "
                             f"fixtures (`python fixtures/make_checkpoints.py`; they are made from fixed seeds) and keep "
                             f"fixtures/snapshots/ as the repository has it (the golden data is the reference's)")
        ids = check_tokenizer_fits(path, model.tokenizer)
        if ids != golden.prompt_ids:
            raise ModelError(f"{model.tokenizer} encodes the prompts to {ids}, the golden snapshot has "
                             f"{golden.prompt_ids}")
        return GoldenTruth(f"{model.name}-{weight_set}", path, golden, device=self.truth_device)

    def _computed(self, model: ServedModel, weight_set: str) -> GoldenTruth:
        """Golden outputs by the reference model, once per session (cached in the work directory)."""
        from conformance._framework.snapshots import deserialize_entries, serialize_entries
        from reference_impl.truth.golden import ExactModel

        from conformance.server.golden import golden_entries, golden_from_entries

        path = model.path(weight_set)
        cache = work_dir() / model.name / f"golden-{weight_set}.json"
        with _locked(work_dir() / f"{model.name}-golden-{weight_set}.lock"):
            if not cache.is_file():
                ids = check_tokenizer_fits(model.a, model.tokenizer)
                golden = ExactModel(path, self.truth_device).golden(ids, MAX_NEW_TOKENS)
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(serialize_entries(golden_entries(golden)))
            golden = golden_from_entries(deserialize_entries(cache.read_text()))
        size = tokenizer_size(model.tokenizer)
        beyond = sorted({int(t) for t in golden.output_ids.flatten() if int(t) >= size})
        if beyond:
            raise ModelError(f"the reference model generates token ids {beyond[:5]} on {path}, which the tokenizer "
                             f"{model.tokenizer} ({size} tokens) cannot decode: their text would be lost; pass the "
                             f"model's own tokenizer with --tokenizer")
        return GoldenTruth(f"{model.name}-{weight_set}", path, golden, device=self.truth_device)
