"""Import SGLang 0.5.23 on a CPU-only host.

SGLang's package import reaches ``torchvision`` at module level through multimodal configs
(``sglang.srt.configs`` -> ``nano_nemotron_vl``/``deepseek_ocr`` -> ``torchvision.transforms``). The only
torchvision wheels on PyPI link ``libtorch_cuda``, so they cannot load next to ``torch+cpu``. None of the
rule code we call touches torchvision, so when it is not installed we register an import placeholder for
``torchvision.*``: importing succeeds, any *use* (calling or instantiating anything) raises RuntimeError.

transformers decides once (lru_cache) whether torchvision is available; we let it decide *before* the
placeholder exists, so transformers keeps treating torchvision as absent.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

from conformance.interfaces.errors import EngineUnavailable

SGLANG_VERSION = "0.5.23"


class SGLangUnavailable(EngineUnavailable):
    """SGLang (or one of its import-time dependencies) is not importable here."""


def _placeholder_attr(qualname: str) -> type:
    def _refuse(*_args, **_kwargs):
        raise RuntimeError(f"{qualname}: torchvision is not installed (CPU import placeholder)")

    class _Meta(type):
        def __getattr__(cls, attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _placeholder_attr(f"{qualname}.{attr}")

    return _Meta(qualname.rsplit(".", 1)[-1], (), {"__init__": _refuse, "__class_getitem__": classmethod(lambda c, _i: c)})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder_attr(f"{self.__name__}.{attr}")


class _TorchvisionPlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _PlaceholderModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _install_torchvision_placeholder() -> bool:
    if any(isinstance(f, _TorchvisionPlaceholderFinder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    try:  # let transformers cache "torchvision absent" before the placeholder exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except Exception:  # transformers missing or changed: SGLang's own import will report it
        pass
    sys.meta_path.append(_TorchvisionPlaceholderFinder())
    return True


def import_sglang_module(name: str) -> types.ModuleType:
    """Import ``sglang.<...>`` on CPU; raises :class:`SGLangUnavailable` with the cause if it cannot."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailable(
            f"sglang is not installed (pip install --no-deps -r ci/requirements-sglang.txt, sglang=={SGLANG_VERSION})"
        )
    _install_torchvision_placeholder()
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise SGLangUnavailable(f"cannot import {name}: {type(exc).__name__}: {exc}") from exc


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")
