r"""CUDA graphs of the training loop's steps (:attr:`~gpattn.training.TrainConfig.cuda_graphs`).

A small model's eager training step on a GPU is bound by the host, which dispatches its kernels one by one (a KEP-SVGP
step at the papers' lengths launches about 130). :class:`CapturedStep` captures the forward pass, the loss and the
backward pass of a step once, for one batch shape, as a CUDA graph, and then replays it on each batch of that shape:
one launch instead of hundreds. The loop keeps the rest eager (the reads of the loss parts and the gradient norm, the
clipping, AdamW and the schedule), so that its checks and its numbers stay as they are; a batch of another shape (the
last, smaller batch of an epoch) takes the eager step.

What a capture needs: fixed shapes (the static inputs, mask and labels the batches are copied into), no value read
on the host inside the step (every attention layer of the model must say
:attr:`~gpattn.attention.AttentionLayer.supports_graph_capture`; the loss's checks become device-side assertions),
and the loss weights as tensors (the annealed KL weight :math:`\beta_t` is a float64 tensor filled before each replay,
not a constant frozen into the graph). The gradients are allocated by the graph and written at every replay into the
same tensors; an eager step in between (a smaller batch) gives the parameters other gradient tensors, so the step
points each parameter's ``.grad`` back to the graph's after a replay. Random draws (reparameterisation noise,
dropout) are fresh at every replay, but not the eager step's draws: a run with graphs is reproducible (same seed,
same device) without equalling the eager run.

:class:`CapturedForward` does the same for the evaluation's passes (the validation after every epoch, and
``gpattn compare``'s final evaluation): a model wrapper whose forward passes without gradients in eval mode are
captured once per batch shape and mode (Monte Carlo samples or dropout masks drawn, or not) and replayed, :math:`T`
replays per batch.

:class:`EmulatedGraph` stands in for a CUDA graph on any device (the tests, on a CPU): its capture records the step
without consuming random numbers and its replay runs it again, writing the outputs and gradients into the captured
tensors as a replay does. With it a run equals the eager one bit for bit, which is how the loop's use of the graph is
tested without a GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._torch_compat import autocast_dtype, autocast_enabled, rehearsing_capture

__all__ = ["CapturedForward", "CapturedStep", "EmulatedGraph", "GraphCaptureError", "capture_refusals", "graph_class"]


class _CUDAGraph:
    """``torch.cuda.CUDAGraph`` behind the interface of :class:`CapturedStep`, on ``device`` whatever the current
    device is: warm-up calls on a side stream (the last one rehearsing the capture's code,
    :func:`~gpattn._torch_compat.rehearsing_capture`), then the capture on the same side stream. A capture that
    recorded nothing (work sent to another device's stream) raises instead of leaving a graph whose replays do
    nothing."""

    def __init__(self, parameters: Sequence[Tensor], device: torch.device):
        self.device = device  # the parameters are not needed here (EmulatedGraph's interface)
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, function: Callable[[], Tensor], warmup: int, check_syncs: bool = False) -> Tensor:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # Triton's compilation, cuBLAS's workspaces, the layers' cached constants
                for index in range(warmup):
                    last = index == warmup - 1
                    with rehearsing_capture() if last else contextlib.nullcontext():
                        # a host synchronisation (a value read) in the rehearsal raises here, before the capture
                        with _syncs_raise() if last and check_syncs else contextlib.nullcontext():
                            function()
            torch.cuda.current_stream().wait_stream(side)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with torch.cuda.graph(self.graph, stream=side):
                        output = function()
                except Exception as error:
                    cause = error.__context__ if error.__context__ is not None else error
                    raise GraphCaptureError(
                        f"the capture of a CUDA graph on {self.device} failed ({type(cause).__name__}: {cause}); a "
                        "failed capture can leave the process's CUDA state unusable (its stream, its memory pool, "
                        "the random generator's capture state): restart it without cuda_graphs"
                    ) from error
        for warning in caught:
            if "graph is empty" in str(warning.message).lower():
                raise RuntimeError(f"the CUDA graph on {self.device} captured nothing")
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return output

    def replay(self) -> None:
        with torch.cuda.device(self.device):
            self.graph.replay()


class GraphCaptureError(RuntimeError):
    """A CUDA graph's capture failed inside ``torch.cuda.graph``: nothing is retried or run in its place, since the
    process's CUDA state may be unusable after it."""


@contextlib.contextmanager
def _syncs_raise():
    """Within the block, an operation that synchronises the host with the GPU raises (``torch.cuda``'s sync debug
    mode ``"error"``), as it would end a capture."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


class EmulatedGraph:
    """A stand-in for a CUDA graph on any device (for tests): :meth:`capture` runs the step once without consuming the
    random numbers of ``device`` (as a capture, which records kernels without running them) and keeps its output and
    gradient tensors; :meth:`replay` runs it again and copies the new output and gradients into those tensors, leaving
    each parameter's ``.grad`` attribute as it found it (a replay writes into the captured memory and touches no
    Python attribute). Both run the capture's code (:func:`~gpattn._torch_compat.rehearsing_capture`). No speed-up,
    and a constant a real capture would freeze (a Python number read by the step) is read afresh at each replay: it
    checks how the loop uses a graph, not a graph.

    :param parameters: The parameters whose gradients the step writes.
    :param device: The device whose random numbers the capture leaves untouched (default: the CPU's).
    """

    def __init__(self, parameters: Sequence[Tensor], device: torch.device | None = None):
        self.parameters = list(parameters)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.function: Callable[[], Tensor] | None = None
        self.output: Tensor | None = None
        self.gradients: list[Tensor | None] = []
        self.replays = 0

    def capture(self, function: Callable[[], Tensor], warmup: int, check_syncs: bool = False) -> Tensor:
        self.function = function
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), rehearsing_capture():
            self.output = function().clone()
        # the captured tensors, as a capture leaves the graph's gradients in the parameters' .grad
        self.gradients = [None if parameter.grad is None else parameter.grad.clone() for parameter in self.parameters]
        for parameter, gradient in zip(self.parameters, self.gradients, strict=True):
            parameter.grad = gradient
        return self.output

    def replay(self) -> None:
        if self.function is None or self.output is None:
            raise RuntimeError("EmulatedGraph: replay() before capture()")
        attributes = [parameter.grad for parameter in self.parameters]
        with rehearsing_capture():
            self.output.copy_(self.function())
        for parameter, captured, attribute in zip(self.parameters, self.gradients, attributes, strict=True):
            if captured is not None:
                captured.copy_(parameter.grad)
            parameter.grad = attribute
        self.replays += 1


def capture_refusals(model: torch.nn.Module) -> list[str]:
    """The class names of the modules of ``model`` that say they cannot be captured in a CUDA graph
    (``supports_graph_capture`` false: an attention layer, or the features of one), sorted; empty when a training step
    of ``model`` can be captured."""
    return sorted(
        {type(module).__name__ for module in model.modules() if not getattr(module, "supports_graph_capture", True)}
    )


def _describe(inputs: Tensor, mask: Tensor | str | None) -> str:
    if isinstance(mask, str):
        return f"inputs {tuple(inputs.shape)} with the mask {mask!r}"
    return f"inputs {tuple(inputs.shape)} {'without' if mask is None else 'with'} a mask"


def graph_class(device: torch.device) -> type:
    """The graph :class:`CapturedStep` uses on ``device``: a CUDA graph on a CUDA device.

    :raises ValueError: On any other device (a CUDA graph needs CUDA).
    """
    if device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got {device}")
    return _CUDAGraph


class CapturedStep:
    r"""The forward pass, loss and backward pass of one batch shape, captured once and replayed.

    ``loss_parts(inputs, mask, labels)`` runs the model and returns the loss parts stacked in one tensor, the first
    of them the loss to minimise; :meth:`__call__` copies a batch into the static inputs, replays, points the
    parameters' gradients back to the graph's and returns the parts (a tensor the next replay overwrites). The first
    call captures (after ``warmup`` untimed calls of the step on a CUDA device), then replays.

    :param loss_parts: The step's loss parts, a function of ``(inputs, mask, labels)``.
    :param parameters: The parameters (their gradients are the graph's).
    :param device: The device (a CUDA device; any device with ``graph=EmulatedGraph``).
    :param warmup: Eager calls before the capture (CUDA only).
    :param graph: The graph class (default :func:`graph_class` of ``device``).

    .. note:: Cost: one copy of each batch into the static tensors and one graph launch per step, instead of the
        step's kernel launches; the capture once, plus ``warmup`` forward and backward passes.
    """

    def __init__(
        self,
        loss_parts: Callable[[Tensor, Tensor | None, Tensor], Tensor],
        parameters: Sequence[Tensor],
        device: torch.device,
        warmup: int = 3,
        graph: type | None = None,
    ):
        self.loss_parts, self.parameters = loss_parts, list(parameters)
        self.graph = (graph or graph_class(device))(self.parameters, device)
        self.warmup = warmup
        self.static: tuple[Tensor, Tensor | None, Tensor] | None = None
        self.output: Tensor | None = None
        self.gradients: list[Tensor | None] = []

    def _step(self, static: tuple[Tensor, Tensor | None, Tensor]) -> Tensor:
        # the gradients set to None first: inside a capture the backward pass then allocates the graph's own
        for parameter in self.parameters:
            parameter.grad = None
        parts = self.loss_parts(*static)
        parts[0].backward()
        return parts.detach()

    def __call__(self, inputs: Tensor, mask: Tensor | None, labels: Tensor) -> Tensor:
        if self.static is None:
            static = (inputs.clone(), None if mask is None else mask.clone(), labels.clone())
            self.output = self.graph.capture(lambda: self._step(static), self.warmup)
            self.static = static  # only once captured: a failed capture is tried again, not replayed
            self.gradients = [parameter.grad for parameter in self.parameters]
        else:
            if inputs.shape != self.static[0].shape or (mask is None) != (self.static[1] is None):
                captured, given = _describe(self.static[0], self.static[1]), _describe(inputs, mask)
                raise ValueError(f"CapturedStep: captured for {captured}, got {given}")
            for static, value in zip(self.static, (inputs, mask, labels), strict=True):
                if static is not None:
                    static.copy_(value)
        return self.replay()

    def replay(self) -> Tensor:
        """Replay the captured step on the static inputs as they are, point the parameters' gradients back to the
        graph's and return the loss parts (overwritten by the next replay)."""
        if self.static is None or self.output is None:
            raise RuntimeError("CapturedStep: replay() before the first call captured the step")
        self.graph.replay()
        for parameter, gradient in zip(self.parameters, self.gradients, strict=True):
            parameter.grad = gradient
        return self.output


#: errors after which an eager pass would fail too: out of memory, and a device error (e.g. a device-side assertion)
_FATAL_ERRORS = tuple(
    error for error in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None)) if error
)


class CapturedForward(torch.nn.Module):
    r"""A model whose evaluation passes are replayed from CUDA graphs: ``CapturedForward(model, device)(inputs,
    mask=mask)`` returns ``model(inputs, mask=mask)`` (and ``(inputs)`` returns ``model(inputs)``; any other call,
    e.g. a mapping of keyword arguments, runs the model eagerly).

    A forward pass without gradients in evaluation mode (what :func:`~gpattn.training.evaluate` and
    :func:`~gpattn.models.monte_carlo_logits` run :math:`T` times per batch) is captured once per *signature*, the
    inputs' shape, dtype and device, the mask's shape (or the string, or ``None``), the modes of the model's modules
    (train or eval, :func:`~gpattn.attention.sample_attention`), autocast's state and inference mode, and replayed
    afterwards: the batch is copied into the graph's static inputs and a copy of its output is returned (the next
    replay overwrites the graph's own). Random draws are fresh at each replay, but not those of eager passes (the
    warm-up passes before a capture draw too): the numbers are reproducible, not the eager evaluation's. Any other call
    (gradients on, the model in training mode) runs the model eagerly. The wrapper holds ``model`` as its submodule
    ``model``, so that ``eval()``, ``sample_attention`` and ``mc_dropout`` reach the model's modules. The graphs read
    the parameters and buffers where they were at the capture, which the optimiser's steps and ``load_state_dict``
    update in place; a parameter or buffer moved elsewhere (``load_state_dict(..., assign=True)``, ``.to(dtype)``)
    discards every graph, and the next passes capture again.

    A host synchronisation in the model's last warm-up pass (a value read, which would end the capture) raises there,
    before anything is captured (``torch.cuda``'s sync debug mode), as does any other error of the warm-up passes (a
    model output that is not a tensor): that signature then runs eagerly, after a warning naming the error. A capture
    that fails inside ``torch.cuda.graph`` raises :class:`GraphCaptureError` (the process's CUDA state may be
    unusable after it), as do out-of-memory and device errors.

    :param model: Maps ``(inputs, mask=mask)`` to a tensor of logits.
    :param device: The model's device (a CUDA device; any device with ``graph=EmulatedGraph``).
    :param warmup: Eager passes before each capture (CUDA only).
    :param graph: The graph class (default :func:`graph_class` of ``device``).

    .. note:: Cost: per signature, ``warmup`` passes, one capture and the graph's memory (kept until
        :meth:`release` or until the wrapper is dropped); per call, a copy of the batch in and of the output out,
        one look at the parameters' and buffers' addresses, and one graph launch instead of the pass's kernel
        launches.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, warmup: int = 2, graph: type | None = None):
        super().__init__()
        self.model = model
        self.device = torch.device(device)
        self.graph_type = graph or graph_class(self.device)
        self.warmup = warmup
        self.graphs: dict[tuple, tuple[Any, Tensor, Tensor | str | None, Tensor] | None] = {}
        self.addresses: tuple[int, ...] = ()
        self.training = model.training  # the wrapper's own flag only: the model's modules keep theirs

    def release(self) -> None:
        """Drop every graph (their memory goes back to the allocator); later passes capture again."""
        self.graphs.clear()

    def _signature(self, inputs: Tensor, mask: Tensor | str | None) -> tuple:
        masks = mask if mask is None or isinstance(mask, str) else (tuple(mask.shape), mask.dtype)
        modes = tuple((module.training, getattr(module, "sample_in_eval", None)) for module in self.model.modules())
        device = inputs.device.type
        autocast = autocast_enabled(device) and autocast_dtype(device)
        precision = (autocast, torch.is_inference_mode_enabled())
        return tuple(inputs.shape), inputs.dtype, inputs.device, masks, modes, precision

    def _addresses(self) -> tuple[int, ...]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return tuple(tensor.data_ptr() for tensor in tensors)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        simple = len(args) == 1 and isinstance(args[0], Tensor) and set(kwargs) <= {"mask"}
        if torch.is_grad_enabled() or self.model.training or not simple:
            return self.model(*args, **kwargs)
        inputs, mask = args[0], kwargs.get("mask")
        addresses = self._addresses()
        if addresses != self.addresses:  # parameters or buffers moved: every graph reads the old memory
            self.graphs.clear()
            self.addresses = addresses
        signature = self._signature(inputs, mask)
        if signature not in self.graphs:
            self.graphs[signature] = self._capture(inputs, mask)
        captured = self.graphs[signature]
        if captured is None:  # its warm-up failed: eager from then on
            return self.model(*args, **kwargs)
        graph, static_inputs, static_mask, output = captured
        static_inputs.copy_(inputs)
        if isinstance(static_mask, Tensor):
            static_mask.copy_(mask)
        graph.replay()
        return output.clone()

    def _capture(self, inputs: Tensor, mask: Tensor | str | None) -> tuple | None:
        static_inputs = inputs.clone()
        static_mask = mask.clone() if isinstance(mask, Tensor) else mask
        graph = self.graph_type([], self.device)

        def run() -> Tensor:  # the model called as the caller called it (with or without a mask argument)
            output = self.model(static_inputs) if mask is None else self.model(static_inputs, mask=static_mask)
            if not isinstance(output, Tensor):
                raise TypeError(f"expected the model to return a tensor, got {type(output).__name__}")
            return output

        try:
            output = graph.capture(run, self.warmup, check_syncs=True)
        except GraphCaptureError:
            raise
        except (RuntimeError, TypeError, ValueError) as error:
            if isinstance(error, _FATAL_ERRORS):  # out of memory, a device-side assertion: eager would fail too
                raise
            warnings.warn(
                f"CapturedForward: the evaluation pass on {_describe(inputs, mask)} cannot be captured in a CUDA graph "
                f"({type(error).__name__}: {error}); it runs eagerly",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        return graph, static_inputs, static_mask, output
