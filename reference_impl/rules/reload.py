"""Weight-reload binding (docs/contracts.md section 6; SGLang 0.5.23 ``layers.utils.common.copy_or_rebind_param`` and
``alias_or_bind_derived_param``).

CUDA graphs capture tensor addresses, so re-preparing weights after a reload must write into the existing
Parameter when it can (same shape and dtype: the object and its data pointer survive) and only otherwise
rebind the Parameter's storage. A missing attribute, or one that is not a Parameter, becomes a new
Parameter. All results have ``requires_grad == False``.

docs/contracts.md section 6 adds: when the state is captured by a graph (``graph_captured=True``) a rebind must raise
RuntimeError asking for a recapture, because the graph would keep reading the old storage.
CODE: SGLang 0.5.23's ``copy_or_rebind_param`` compares shape and dtype only (not device: ``copy_`` moves
across devices) and never raises; its recapture guard lives where the graph-captured state is re-derived
after a reload: ``refresh_cutedsl_standard_scales_for_weight_update`` (the CuTe DSL MoE scales) raises
RuntimeError ("... CUDA graph recapture is required.") when a captured scale changes shape, dtype or device.
"""
from __future__ import annotations

import torch
from torch.nn import Parameter


class RecaptureRequired(RuntimeError):
    """A rebind would leave captured CUDA graphs reading freed storage."""


RECAPTURE_MESSAGE = "CUDA graph recapture is required"


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
                f"{tuple(new_value.shape)}/{new_value.dtype}; CUDA graphs captured the old storage: {RECAPTURE_MESSAGE}"
            )
        current.data = new_value
        action = "rebind"
    current.requires_grad_(False)
    return action


def alias_or_bind_derived_param(module: torch.nn.Module, source_name: str, derived_name: str,
                                derived_value: torch.Tensor) -> str:
    """Bind a tensor derived from ``module.<source_name>`` (e.g. swizzled block scales) under ``derived_name``.

    When the source is a Parameter of the same dtype and the derived value broadcasts to its shape, the value
    is written (broadcast) into the source's storage and ``derived_name`` becomes a second name for the source
    Parameter (one buffer, so a reload that refills the source re-derives in place): returns ``alias``.
    Otherwise the value is bound under ``derived_name`` by :func:`copy_or_rebind_param` and the source is left
    alone: returns that function's action (``copy``, ``rebind`` or ``create``)."""
    derived_value = derived_value.detach()
    source = getattr(module, source_name, None)
    if isinstance(source, Parameter) and source.dtype == derived_value.dtype:
        try:
            filled = torch.broadcast_to(derived_value, source.shape)
        except RuntimeError:  # not broadcastable to the source's shape
            filled = None
        if filled is not None:
            source.data.copy_(filled)
            source.requires_grad_(False)
            setattr(module, derived_name, source)
            return "alias"
    return copy_or_rebind_param(module, derived_name, derived_value)
