"""The autocast state of a custom autograd function's forward pass, restored in its backward pass.

``torch.autocast`` runs the matrix products of a forward pass in bfloat16 or float16 and leaves the backward pass to
the autograd engine, which runs without autocast: a hand-written backward pass of mixed-precision tensors must
restore the forward pass's state to run the same products (``torch.amp.custom_bwd`` does this for one device type
fixed at decoration; these helpers read the device of the call).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from .._torch_compat import autocast_dtype, autocast_enabled

__all__ = ["AutocastState", "autocast_state", "full_precision", "restored_autocast", "wide_dtype"]

#: ``(device_type, dtype)`` of an enabled autocast region, or ``None``
AutocastState = tuple[str, torch.dtype] | None


def autocast_state(device_type: str) -> AutocastState:
    """The autocast state of ``device_type`` (``"cpu"``, ``"cuda"``, ...) now: ``(device_type, dtype)`` when autocast
    is enabled there, else ``None``."""
    if not autocast_enabled(device_type):
        return None
    return device_type, autocast_dtype(device_type)


def restored_autocast(state: AutocastState) -> AbstractContextManager:
    """A context that runs its block under ``state`` (of :func:`autocast_state`): autocast on the same device with
    the same dtype, or nothing."""
    if state is None:
        return nullcontext()
    device_type, dtype = state
    return torch.autocast(device_type, dtype=dtype)


def full_precision(state: AutocastState) -> AbstractContextManager:
    """A context that runs its block without autocast on the device of ``state`` (for the small tensors that need
    float32 inside an autocast region), or nothing when ``state`` is ``None``."""
    if state is None:
        return nullcontext()
    return torch.autocast(state[0], enabled=False)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which quantities of a ``dtype`` computation that need precision are formed (sums, norms, draws,
    floors): float32 for the half-precision dtypes of autocast, else ``dtype`` itself (float32 or float64; no aten
    call, unlike ``torch.promote_types``)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32
