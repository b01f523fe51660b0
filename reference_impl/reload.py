"""Weight-reload binding (SPEC.md section 6; SGLang 0.5.23 ``layers.utils.common.copy_or_rebind_param``).

CUDA graphs capture tensor addresses, so re-preparing weights after a reload must write into the existing
Parameter when it can (same shape and dtype: the object and its data pointer survive) and only otherwise
rebind the Parameter's storage. A missing attribute, or one that is not a Parameter, becomes a new
Parameter. All results have ``requires_grad == False``.

SPEC 6 adds: when the state is captured by a graph (``graph_captured=True``) a rebind must raise
RuntimeError asking for a recapture, because the graph would keep reading the old storage.
CODE: SGLang 0.5.23 compares shape and dtype only (not device: ``copy_`` moves across devices) and has no
recapture guard in this function.
"""
from __future__ import annotations

import torch
from torch.nn import Parameter


class RecaptureRequired(RuntimeError):
    """A rebind would leave captured CUDA graphs reading freed storage."""


def copy_or_rebind_param(module: torch.nn.Module, name: str, new_value: torch.Tensor, *, graph_captured: bool = False) -> str:
    """Bind ``new_value`` to ``module.<name>``; returns what happened: ``copy``, ``rebind`` or ``create``."""
    new_value = new_value.detach()
    current = getattr(module, name, None)
    if not isinstance(current, Parameter):
        setattr(module, name, Parameter(new_value, requires_grad=False))
        return "create"
    if current.data.shape == new_value.shape and current.data.dtype == new_value.dtype:
        current.data.copy_(new_value)
        action = "copy"
    else:
        if graph_captured:
            raise RecaptureRequired(
                f"{name}: reloaded tensor changed from {tuple(current.shape)}/{current.dtype} to "
                f"{tuple(new_value.shape)}/{new_value.dtype}; CUDA graphs captured the old storage, recapture them"
            )
        current.data = new_value
        action = "rebind"
    current.requires_grad_(False)
    return action
