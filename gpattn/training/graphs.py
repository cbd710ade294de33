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

:class:`EmulatedGraph` stands in for a CUDA graph on any device (the tests, on a CPU): its capture records the step
without consuming random numbers and its replay runs it again, writing the outputs and gradients into the captured
tensors as a replay does. With it a run equals the eager one bit for bit, which is how the loop's use of the graph is
tested without a GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._torch_compat import rehearsing_capture

__all__ = ["CapturedStep", "EmulatedGraph", "capture_refusals", "graph_class"]


class _CUDAGraph:
    """``torch.cuda.CUDAGraph`` behind the interface of :class:`CapturedStep`, on ``device`` whatever the current
    device is: warm-up calls on a side stream (the last one rehearsing the capture's code,
    :func:`~gpattn._torch_compat.rehearsing_capture`), then the capture on the same side stream. A capture that
    recorded nothing (work sent to another device's stream) raises instead of leaving a graph whose replays do
    nothing."""

    def __init__(self, parameters: Sequence[Tensor], device: torch.device):
        self.device = device  # the parameters are not needed here (EmulatedGraph's interface)
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, function: Callable[[], Tensor], warmup: int) -> Tensor:
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # Triton's compilation, cuBLAS's workspaces, the layers' cached constants
                for index in range(warmup):
                    with rehearsing_capture() if index == warmup - 1 else contextlib.nullcontext():
                        function()
            torch.cuda.current_stream().wait_stream(side)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.cuda.graph(self.graph, stream=side):
                    output = function()
        for warning in caught:
            if "graph is empty" in str(warning.message).lower():
                raise RuntimeError(f"the CUDA graph of the training step on {self.device} captured nothing")
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        return output

    def replay(self) -> None:
        with torch.cuda.device(self.device):
            self.graph.replay()


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

    def capture(self, function: Callable[[], Tensor], warmup: int) -> Tensor:
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


def _describe(inputs: Tensor, mask: Tensor | None) -> str:
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
