"""Checks shared by the public entry points: every error says what was expected and what came.

Scalars (constructor and CLI arguments) are checked with :func:`check_int`, :func:`check_seed`, :func:`check_float`,
:func:`check_choice`, :func:`check_bool` and :func:`check_device`; tensors with :func:`check_tensor`, which costs O(1)
apart from one elementwise pass when ``finite=True`` (skipped while TorchScript or ``torch.compile`` trace, and on
the ``meta`` device, where values do not exist). Layers guard their results with :func:`check_overflow`, which
refuses input tokens too large for their dtype (:func:`check_token_magnitude`) once a result is not finite.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable, Sequence
from itertools import zip_longest
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._torch_compat import autocast_enabled, values_unreadable


class InputTypeError(TypeError, ValueError):
    """A wrong type or dtype. A :class:`TypeError` that is also a :class:`ValueError`, so that code written against
    the ``ValueError`` these checks raised before keeps working (as ``numpy.AxisError`` is both a ``ValueError`` and
    an ``IndexError``)."""


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def _is_tracing() -> bool:
    """Whether no value can be read on the host: TorchScript, ``torch.jit.trace``, ``torch.compile`` or the capture of
    a CUDA graph (:func:`~gpattn._torch_compat.values_unreadable`): the value checks are then skipped."""
    return torch.jit.is_scripting() or torch.jit.is_tracing() or values_unreadable()


def all_finite(value: Tensor) -> bool:
    """Whether a tensor holds no NaN and no infinity: one reduction pass and no full-size temporary, about ten times
    faster on large CPU tensors than ``torch.isfinite(value).all()``. A finite sum answers at once (two operators,
    the sum and its read: on a GPU one kernel and one synchronisation); a sum that is not finite (a NaN or an infinity,
    or finite entries whose sum overflows) is settled by ``torch.aminmax``, which propagates NaN."""
    if value.numel() == 0 or not (value.is_floating_point() or value.is_complex()):
        return True
    if value.is_complex():
        return all_finite(torch.view_as_real(value))
    if math.isfinite(value.sum().item()):
        return True
    low, high = torch.aminmax(value)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def assert_indices_on_device(indices: Tensor, size: int, message: str) -> None:
    """Check that every entry of ``indices`` lies in ``[0, size)`` without reading a value: an asynchronous assertion
    (``torch._assert_async``) that raises ``RuntimeError(message)`` on a CPU and is a device-side assert on a GPU (the
    process's CUDA context is then unusable). For a CUDA graph being captured, where the eager range checks cannot
    read the values."""
    torch._assert_async(((indices >= 0) & (indices < size)).all(), message)


def non_finite_parameters(*modules: torch.nn.Module) -> list[str]:
    """The names of the parameters of ``modules`` that hold a NaN or an infinity (:func:`all_finite` each), in
    ``named_parameters`` order: what a divergence message names."""
    return [
        name
        for module in modules
        for name, parameter in module.named_parameters()
        if not all_finite(parameter.detach())
    ]


def check_int(name: str, value: Any, minimum: int | None = 1, maximum: int | None = None, where: str = "") -> int:
    """An integer in ``[minimum, maximum]`` (either bound may be ``None``): a Python or NumPy integer
    (``numbers.Integral``, e.g. ``numpy.int64``), not a bool (Python's or NumPy's).

    :raises InputTypeError: For a non-integer (a float, also an integral one such as ``15.0``, a string, a bool).
    :raises ValueError: For an integer out of range.
    :return: ``value`` as a Python ``int``.
    """
    if minimum is not None and maximum is not None:
        wanted = f"an integer in [{minimum}, {maximum}]"
    elif minimum == 1:
        wanted = "a positive integer"
    elif minimum == 0:
        wanted = "a non-negative integer"
    elif minimum is not None:
        wanted = f"an integer >= {minimum}"
    elif maximum is not None:
        wanted = f"an integer <= {maximum}"
    else:
        wanted = "an integer"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}")
    return int(value)


#: The largest seed :func:`check_seed` accepts: ``torch.Generator.manual_seed`` reads its seed as a 64-bit integer
#: and refuses :math:`2^{64}` and beyond ("Overflow when unpacking long long").
MAX_SEED = 2**64 - 1


def check_seed(name: str, value: Any, where: str = "") -> int:
    """A seed of gpattn's random generators: a non-negative integer (as :func:`check_int`) up to :data:`MAX_SEED`,
    so that ``torch.Generator().manual_seed(seed)`` takes every accepted seed (also where NumPy, which takes larger
    ones, draws: one range for every seed of the package).

    :raises InputTypeError: For a non-integer.
    :raises ValueError: For a negative seed or one above :data:`MAX_SEED`.
    :return: ``value`` as a Python ``int``.
    """
    seed = check_int(name, value, minimum=0, where=where)
    if seed > MAX_SEED:
        raise ValueError(
            f"{_prefix(where)}expected {name} to be a non-negative integer at most 2**64 - 1 = {MAX_SEED} (gpattn's "
            f"seeds are 64-bit, as torch.Generator.manual_seed takes them), got {value!r}"
        )
    return seed


def check_float(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    strict_minimum: bool = False,
    strict_maximum: bool = False,
    where: str = "",
) -> float:
    """A finite real number (not a bool) within the given bounds.

    :param strict_minimum: Exclude ``minimum`` itself (e.g. a positive lengthscale).
    :param strict_maximum: Exclude ``maximum`` itself (e.g. a dropout rate below 1).
    :raises InputTypeError: For a non-number (a string, a bool, a tensor with more than one element).
    :raises ValueError: For NaN, an infinity, or a number out of range.
    :return: ``value`` as a Python ``float``.
    """
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if strict_minimum else '>='} {minimum:g}")
    if maximum is not None:
        bounds.append(f"{'<' if strict_maximum else '<='} {maximum:g}")
    wanted = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}")
    number = float(value)
    out_of_range = not math.isfinite(number)
    if minimum is not None:
        out_of_range |= number < minimum or (strict_minimum and number == minimum)
    if maximum is not None:
        out_of_range |= number > maximum or (strict_maximum and number == maximum)
    if out_of_range:
        raise ValueError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}")
    return number


def check_choice(name: str, value: Any, choices: Sequence[Any], where: str = "") -> Any:
    """One of ``choices`` (compared with ``==``; unhashable values are fine).

    :raises ValueError: Naming the accepted values.
    """
    try:
        known = value in choices
    except (TypeError, ValueError):  # e.g. an array, whose == is elementwise
        known = False
    if not known:
        raise ValueError(f"{_prefix(where)}expected {name} to be one of {list(choices)}, got {value!r}")
    return value


def check_bool(name: str, value: Any, where: str = "") -> bool:
    """A flag: a Python or NumPy bool, returned as a Python bool. Truthiness would read the string ``"no"`` or
    ``"False"`` as true, and ``2`` or ``0.5`` as a flag, without a word.

    :raises InputTypeError: For anything else (a string, a number, ``None``, a tensor), naming ``name``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise InputTypeError(f"{_prefix(where)}expected {name} to be True or False, got {value!r}")
    return bool(value)


def check_device(name: str, value: Any, where: str = "", types: Sequence[str] | None = None) -> torch.device:
    """A device string or :class:`torch.device` that exists on this machine (``cpu``, ``cuda``, ``cuda:<index>``...).

    :param types: The device types accepted (e.g. ``("cpu", "cuda")``), or ``None`` for any.
    :raises ValueError: For a string torch does not parse, a device type not in ``types``, or a CUDA/MPS device that
        is not available here.
    """
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"{_prefix(where)}expected {name} to be a device such as 'cpu', 'cuda' or 'cuda:0', got {value!r}"
        ) from error
    if types is not None and device.type not in types:
        forms = [f"'{kind}'" for kind in types] + [f"'{kind}:<index>'" for kind in types if kind != "cpu"]
        wanted = " or ".join([", ".join(forms[:-1]), forms[-1]] if len(forms) > 1 else forms)
        raise ValueError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{_prefix(where)}{name}={value!r} but CUDA is not available on this machine; use 'cpu'")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{_prefix(where)}{name}={value!r} but this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{_prefix(where)}{name}={value!r} but MPS is not available on this machine; use 'cpu'")
    return device


def keyword_arguments(function: Any, exclude: Sequence[str] = ()) -> list[str]:
    """The arguments of ``function``'s signature that a keyword can name (not ``*args``, ``**kwargs`` or
    positional-only ones), besides ``exclude``, in signature order; for a class, those of its constructor."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind in named and p.name not in exclude]


def check_sequence(name: str, value: Any, example: str, where: str = "") -> None:
    """Refuse a ``value`` that is not an iterable of items, or is a string (which would be iterated letter by letter).

    :param example: A value to show in the message, e.g. ``"('blur',)"``.
    :raises InputTypeError: ``value`` is a ``str`` or ``bytes``, or not iterable.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InputTypeError(f"{_prefix(where)}expected {name} to be a sequence, e.g. {example}, got {value!r}")


def check_digits(name: str, value: Any, where: str = "") -> tuple[int, ...]:
    """A sequence of digit classes ``0..9`` (Python or NumPy integers, a tensor or an array of them) or ``None``
    (none), as a tuple of Python ints.

    :raises InputTypeError: ``value`` is not a sequence (a bare number, a string).
    :raises ValueError: An element that is not an integer in ``0..9`` (bools included).
    """
    if isinstance(value, (Tensor, np.ndarray)):  # elements of a tensor are 0-d tensors, not integers
        value = value.tolist()
    if value is not None and (isinstance(value, (str, bytes)) or not isinstance(value, Iterable)):
        raise InputTypeError(
            f"{_prefix(where)}expected {name} to be a sequence of digits in 0..9 (e.g. (8, 9)), () or None, got "
            f"{value!r}"
        )
    digits = () if value is None else tuple(value)
    if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c <= 9 for c in digits):
        raise ValueError(f"{_prefix(where)}expected {name} to be digits in 0..9, got {value!r}")
    return tuple(int(c) for c in digits)


def broadcastable(*shapes: Sequence[int]) -> bool:
    """Whether shapes broadcast against each other (trailing sizes equal or 1): O(number of dimensions), no tensor
    operation (also while tracing or compiling)."""
    for sizes in zip_longest(*(reversed(tuple(shape)) for shape in shapes), fillvalue=1):
        if len({size for size in sizes if size != 1}) > 1:
            return False
    return True


def _render_shape(shape: Sequence[int | str]) -> str:
    return "(" + ", ".join(str(size) for size in shape) + ")"


def check_tensor(
    name: str,
    value: Any,
    shape: Sequence[int | str] | None = None,
    *,
    floating: bool = False,
    integer: bool = False,
    non_empty: bool = False,
    like: Tensor | None = None,
    like_name: str = "the parameters",
    match_dtype: bool = True,
    finite: bool = False,
    meaning: str = "",
    where: str = "",
) -> Tensor:
    """A tensor of the expected kind, shape, dtype and device, optionally with finite values only.

    :param shape: Expected shape: an ``int`` is a fixed size, a ``str`` names a free size (``"B"``, ``"N"``), and
        a leading ``"..."`` allows any number of batch dimensions, e.g. ``("B", "N", 64)`` or ``("...", "N", 3)``.
    :param floating: Require a floating-point dtype.
    :param integer: Require an integer (not bool) dtype.
    :param non_empty: Require every dimension named in ``shape`` (the fixed and named ones) to be non-zero.
    :param like: A reference tensor (e.g. a parameter) whose device, and dtype unless ``match_dtype=False``, the
        value must share. Under ``torch.autocast``, which mixes float32 and its lower precisions on purpose, those
        pass; a float64 value with another ``like`` (or the reverse) does not: autocast casts no float64 tensor.
    :param like_name: What ``like`` is, for the message (plural).
    :param finite: Require no NaN or infinity (one elementwise pass; skipped while tracing and on ``meta``).
    :param meaning: What the dimensions are, added to the shape message (e.g. ``"(batch, tokens, embed_dim)"``).
    :raises InputTypeError: Not a tensor, or a wrong dtype.
    :raises ValueError: A wrong shape, an empty dimension, a device mismatch or a non-finite value.
    """
    prefix = _prefix(where)
    if not isinstance(value, Tensor):
        raise InputTypeError(f"{prefix}expected {name} to be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise InputTypeError(f"{prefix}expected {name} to be a floating-point tensor, got {value.dtype}")
    if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise InputTypeError(f"{prefix}expected {name} to be an integer tensor, got {value.dtype}")
    if shape is not None:
        expected = _render_shape(shape) + (f" = {meaning}" if meaning else "")
        batched = len(shape) > 0 and shape[0] == "..."
        fixed = list(shape[1:] if batched else shape)
        got = tuple(value.shape)
        trailing = got[len(got) - len(fixed) :] if len(got) >= len(fixed) else ()
        wrong_rank = len(got) < len(fixed) if batched else len(got) != len(fixed)
        mismatch = any(isinstance(want, int) and size != want for size, want in zip(trailing, fixed, strict=False))
        if wrong_rank or mismatch:
            raise ValueError(f"{prefix}expected {name} of shape {expected}, got {got}")
        if non_empty and any(size == 0 for size in trailing):
            raise ValueError(f"{prefix}expected {name} of shape {expected}, non-empty, got {got}")
    if like is not None:
        if value.device != like.device:
            raise ValueError(
                f"{prefix}{name} is on {value.device} but {like_name} are on {like.device}: move one of them "
                f"(.to({str(like.device)!r}))"
            )
        # torch.autocast mixes float32 and its lower precisions on purpose, but casts no float64 tensor: a float64 value
        # with other parameters (or the reverse) failed deep inside with a bare dtype error
        mixed = autocast_enabled(value.device.type) and torch.float64 not in (value.dtype, like.dtype)
        if match_dtype and value.dtype != like.dtype and not mixed:
            raise InputTypeError(
                f"{prefix}{name} is {value.dtype} but {like_name} are {like.dtype}: cast one of them "
                f"(.to({like.dtype}))"
            )
    skip_finite = value.device.type == "meta" or _is_tracing()
    if finite and not skip_finite and not all_finite(value):
        raise ValueError(f"{prefix}{name} contains NaN or Inf values")
    return value


#: The factor below :math:`\sqrt{f_{\max}}` at which :func:`check_token_magnitude` refuses tokens: the margin left for
#: the sums over tokens and dimensions that multiply a quantity growing like :math:`|x|^2`.
MAGNITUDE_MARGIN = 1e3


def token_magnitude_limit(dtype: torch.dtype, power: int = 2) -> float:
    r"""The largest token magnitude a layer accepts in ``dtype`` for a quantity that grows like :math:`|x|^p`
    (``power``): :math:`(f_{\max} / 10^6)^{1/p}`, so that the quantity stays :math:`10^6` (:data:`MAGNITUDE_MARGIN`
    squared) below the largest value for its sums.

    With ``power=2`` (attention scores, squared distances, quadratic forms of the values) it is
    :math:`\sqrt{f_{\max}} / 10^3`: 1.8e16 in float32 and bfloat16, 1.3e151 in float64, 0.26 in float16. With
    ``power=4`` (the KSVD penalty :math:`\eta J^2`) 1.4e8 in float32, 3.7e75 in float64; with ``power=5`` (its
    gradients) 3.2e6 in float32, 2.8e60 in float64, 0.58 in float16.
    """
    return (torch.finfo(dtype).max / MAGNITUDE_MARGIN**2) ** (1.0 / power)


def square_limit(dtype: torch.dtype) -> float:
    r"""The largest magnitude of a result whose square must stay representable in ``dtype``, with a margin of
    :data:`MAGNITUDE_MARGIN` for the sums it enters: :math:`\sqrt{f_{\max} / 10^3}` (5.8e17 in float32, 8.1 in
    float16). A layer passes it as ``bound`` to :func:`check_overflow` for results that are squared later (scores
    whose squares are variances, an objective whose square is a penalty)."""
    return (torch.finfo(dtype).max / MAGNITUDE_MARGIN) ** 0.5


def check_token_magnitude(tokens: Tensor | Sequence[Tensor], growth: str, where: str = "", power: int = 2) -> None:
    r"""Refuse input tokens too large for their dtype: a ``ValueError`` when :math:`\max |x|` exceeds
    :func:`token_magnitude_limit` (of ``power``), saying what overflows and what to do; nothing otherwise.

    Costs one reduction pass over each distinct tensor (``torch.aminmax``, no temporary; skipped while tracing or
    compiling, and on ``meta``). The layers call it through :func:`check_overflow`, i.e. only once a result is not
    finite (or beyond its bound), so that the normal path pays a single reduction over their outputs (and float16,
    whose limit is 0.26, keeps working for ordinary tokens).

    :param tokens: The layer's input tokens (one tensor or several, e.g. the queries and the context).
    :param growth: What overflows, for the message, e.g. ``"the attention scores <q, k> grow like |x|^2"``.
    :param power: The power of :math:`|x|` the overflowing quantity grows like.
    :raises ValueError: Naming the magnitude reached, the dtype and its limit.
    """
    tokens = list({id(part): part for part in ([tokens] if isinstance(tokens, Tensor) else tokens)}.values())
    if _is_tracing() or any(part.device.type == "meta" for part in tokens):
        return
    dtype = tokens[0].dtype
    extremes = [torch.aminmax(part.detach()) for part in tokens if part.numel()]
    magnitude = max((max(-float(low), float(high)) for low, high in extremes), default=0.0)
    if magnitude > token_magnitude_limit(dtype, power):
        remedy = "" if dtype == torch.float64 else " or use float64"
        largest = torch.finfo(dtype).max
        root = "sqrt(finfo.max)" if power == 2 else f"finfo.max^(1/{power})"
        raise ValueError(
            f"{_prefix(where)}the input tokens reach |x| = {magnitude:.3g}, too large for {dtype}: {growth}, which "
            f"overflows beyond about {root} = {largest ** (1.0 / power):.3g}; rescale the inputs (e.g. a LayerNorm "
            f"before the layer){remedy}"
        )


def within_bound(values: Sequence[Tensor | None], bound: float = math.inf) -> bool:
    """Whether every tensor of ``values`` (``None`` entries skipped) is finite and within ``[-bound, bound]``: one fused
    max-norm pass over all of them (``torch._foreach_norm``, which propagates NaN) and one host synchronisation,
    whatever their number (one per dtype and device when they differ), the comparison made on the host. ``True`` while
    tracing or compiling and for ``meta`` tensors (nothing can be read)."""
    present = [value for value in values if value is not None and value.numel()]
    if not present or _is_tracing() or any(value.device.type == "meta" for value in present):
        return True  # nothing to check, or no value to read (tracing, compiling, meta tensors)
    with torch.no_grad():
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for value in present:  # _foreach_norm takes one dtype and device per call
            groups.setdefault((value.dtype, value.device), []).append(value)
        largest = []
        for group in groups.values():  # each group's largest magnitude in its own dtype (float64 stays float64)
            norms = torch._foreach_norm(group, math.inf)
            largest.append(norms[0] if len(norms) == 1 else torch.stack(norms).amax())
        # the largest magnitudes read as Python floats (exact for every floating dtype), compared on the host
        magnitudes = [magnitude.item() for magnitude in largest]
        return all(math.isfinite(magnitude) and magnitude <= bound for magnitude in magnitudes)  # NaN fails both


def check_overflow(
    results: Sequence[Tensor | None],
    tokens: Tensor | Sequence[Tensor],
    growth: str,
    where: str = "",
    *,
    bound: float = math.inf,
    power: int = 2,
) -> bool:
    """The guard a layer runs after its forward pass: when one of ``results`` holds a NaN or an infinity, or a value
    beyond ``bound`` (a result whose square or product is about to overflow), refuse tokens beyond
    :func:`token_magnitude_limit` (of ``power``) with :func:`check_token_magnitude`'s message.

    One fused reduction over all results and one host synchronisation on the normal path (:func:`within_bound`;
    skipped while tracing or compiling, and on ``meta``).

    :param results: What the layer computed from the tokens (its output, its loss terms); ``None`` entries are skipped.
    :param tokens: The input tokens.
    :param growth: What overflows, for the message.
    :param bound: The largest magnitude a result may reach (default: any finite value).
    :param power: The power of :math:`|x|` the overflowing quantity grows like (:func:`token_magnitude_limit`).
    :return: Whether every result is finite and within ``bound`` (``True`` also when the check is skipped);
        ``False`` when one is not but the tokens are within the limit (e.g. diverged parameters), which the caller may
        diagnose further.
    :raises ValueError: A result out of range from tokens beyond the limit.
    """
    if within_bound(results, bound):
        return True
    check_token_magnitude(tokens, growth, where, power)
    return False


def check_positive(name: str, value: Any, like: Tensor, where: str = "") -> Tensor:
    """A number or tensor of finite values > 0 (what a ``Positive`` constraint can represent: its inverse transform
    of a value <= 0 is NaN), as a tensor with the dtype and device of ``like``.

    :raises InputTypeError: For something that is not a number or a tensor of numbers (a bool included).
    :raises ValueError: For a value <= 0, NaN or infinite.
    """
    wanted = "a finite number > 0 (or a tensor of them)"
    try:
        if torch.as_tensor(value).dtype == torch.bool:  # True would be read as 1.0 (check_float refuses it too)
            raise TypeError("a bool is not a number")
        tensor = torch.as_tensor(value, dtype=like.dtype, device=like.device)  # a float read once, in like's dtype
    except (TypeError, ValueError, RuntimeError) as error:
        raise InputTypeError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}") from error
    if tensor.device.type != "meta" and not (torch.isfinite(tensor).all() and (tensor > 0).all()):
        raise ValueError(f"{_prefix(where)}expected {name} to be {wanted}, got {value!r}")
    return tensor


def initialize_positive(module: torch.nn.Module, raw_name: str, name: str, value: object, where: str) -> None:
    """Set the positive parameter ``name`` of ``module`` (stored as ``raw_name`` under a ``Positive`` constraint) to
    ``value``, a number or a tensor that GPyTorch's ``initialize`` can fit to the parameter's shape (one that expands
    to it, or one with as many elements).

    :raises InputTypeError: For something that is not a number or a tensor of numbers.
    :raises ValueError: For a value <= 0, NaN or infinite, or of a shape that does not fit the parameter's.
    """
    raw = getattr(module, raw_name)
    value = check_positive(name, value, raw, where=where)
    expands = value.dim() <= raw.dim() and all(
        size in (1, wanted) for size, wanted in zip(reversed(value.shape), reversed(raw.shape), strict=False)
    )
    if not expands and value.numel() != raw.numel():
        raise ValueError(
            f"{_prefix(where)}expected {name} to be a number or a tensor that expands to shape {tuple(raw.shape)}, got "
            f"shape {tuple(value.shape)}"
        )
    constraint = getattr(module, f"{raw_name}_constraint")
    module.initialize(**{raw_name: constraint.inverse_transform(value)})
