"""The GPU check of issue 25 in one run (about 5 minutes on one H100 or H200), written to one JSON file.

1. ``environment``: the device's name, capability and driver, the torch, CUDA and Triton versions.
2. ``equivalence``: every registry attention (and the KEP variants of ``attention_scaling.py``) on the CPU and on the
   device in float64: the predictive mean and the gradients of every parameter and of the input within 1e-10; one
   float32, one bfloat16-autocast and one bfloat16-layer (converted, no autocast) training step on the device,
   finite; KEP-SVGP's Triton kernels against its
   PyTorch path on the device (float32, the benchmark's sizes, and at 8263 tokens, where the kernels split each
   sequence over three programs per head); the bfloat16-autocast output of softmax and
   KEP-SVGP against float32 (largest entry and norm, relative; issue 25's bound 2e-2); KEP-SVGP, the official-style
   row and Primal-Attention compiled (``aot_eager``) against eager mode in float64 (the mean and every gradient);
   the training steps of the ``--graphed-rows`` captured as CUDA graphs (:class:`GraphedStep`) against eager steps
   (float32 gradients in eval mode; in training, fresh draws at every replay; the autocast rows also with their
   forward passes under bfloat16 autocast, ``*_bf16_graphed_vs_eager``); a KEP-SVGP classifier's evaluation
   passes replayed from CUDA graphs (``gpattn.training.graphs.CapturedForward``, as ``--cuda-graphs`` evaluates)
   against eager passes (``captured_forward_vs_eager``).
3. ``counts``: operators (top-level aten calls) and kernel launches of one training step per row.
4. ``scaling``: forward + backward of one training step at N = 256 ... 16384 (B = 16, C = 128, 4 heads, s = 10) for
   softmax, the floor, KEP-SVGP (its default: the Triton kernels up to ``TRITON_MAX_TOKENS`` tokens; as
   ``kep_svgp_pytorch`` its PyTorch path, and above that length as ``kep_svgp_triton`` the kernels), the official-style
   row, SGPA (up to ``--max-sgpa-length``) and, with ``--official-path``, the official layer; bfloat16 autocast rows
   for softmax and KEP-SVGP; ``torch.compile`` (``mode="reduce-overhead"``, CUDA graphs) rows at ``--compile-lengths``:
   the layer compiled (``*_compiled``; its KL and KSVD penalty eager) and the step's whole loss compiled
   (``*_compiled_loss``, :class:`CompiledLoss`); at every length the eager step of the ``--graphed-rows`` captured
   as one CUDA graph and replayed (``*_graphed``, :class:`GraphedStep`: no compiler, the layers as they run eagerly),
   for softmax and KEP-SVGP also under bfloat16 autocast (``*_bf16_graphed``: the bf16 targets without the host
   time of autocast's casts).
   Medians of interleaved repetitions, CUDA events through synchronisation, every ratio from the same run.
5. ``train_step``: one training step of the comparison's MNIST-1D model (``gpattn.training.train_model``'s steps,
   batches of 64, the shared settings) per ``--train-step-rows`` row, on the device eagerly, compiled as
   ``gpattn compare --compile`` compiles it (CUDA graphs) and with its steps captured as ``gpattn compare
   --cuda-graphs`` captures them, and eagerly on one CPU thread: the median step time after warm-up steps, and the
   warm-up (a compile, a capture) in seconds.
6. ``kernels``: the device's busy time and kernels per training step of the floor and KEP-SVGP at the first compiled
   length, eager and as a compiled loss, with the largest kernels (the profiler's self device time).
7. ``mnist1d``: one MNIST-1D run (``--mnist1d-epochs``) per row of the comparison on the device and on one CPU thread
   of the same machine; then ``--jobs`` runs at once on the device against the same runs one by one (the records must
   be identical: deterministic kernels, :func:`gpattn.comparison.runner.run_environment`).

Every section records its errors instead of stopping the script (a timed section keeps the lengths, rows and runs it
measured before an error); the JSON is written after every section and, on Ctrl-C or SIGTERM (``timeout``, a job's
time limit), with what was measured until then; the summary is printed last. ``--minutes`` bounds the timed sections
4 to 7: past it they skip what remains.

Usage, from the repository root::

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --official-path ~/src/KEP-SVGP          # with the official layer
    python benchmarks/gpu_check.py --device cpu --smoke                     # the whole script at tiny sizes

On a machine whose Python lacks some of gpattn's dependencies (an image with torch, gpytorch and Triton but without
``pyro-ppl``, ``pyro-api`` and ``mnist1d``), download their wheels where the network is reachable, into a folder that
travels with the repository, and install them next to it before the check::

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .wheels \\
        pyro-ppl==1.9.2 pyro-api==0.1.2 mnist1d==0.0.2.post1
    python -m pip install -q --no-index --no-deps --target .site .wheels/*.whl
    PYTHONPATH=$PWD/.site:$PWD python benchmarks/gpu_check.py --out gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import itertools
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's start/stop lines out of the output
import torch  # noqa: E402

from gpattn.attention import attention_names, build_attention, select_arguments  # noqa: E402
from gpattn.fused import triton_scores  # noqa: E402

SCALING_SCRIPT = Path(__file__).resolve().with_name("attention_scaling.py")
#: the layers of the float64 CPU-vs-device check: the registry plus the KEP variants of attention_scaling.py
VARIANT_ROWS = ("kep_svgp_marginal", "kep_svgp_exact", "kep_svgp_official_style")
#: the rows of the scaling table and of the counts
TABLE_ROWS = ("softmax", "floor", "kep_svgp", "kep_svgp_official_style", "sgpa")
COMPILED_ROWS = ("floor", "kep_svgp")  # the target: compiled KEP within 1.2x of the compiled floor
AUTOCAST_ROWS = ("softmax", "kep_svgp")
#: the rows whose eager training step is captured as one CUDA graph (``--graphed-rows``' default)
GRAPHED_ROWS = ("softmax", "floor", "kep_svgp")
#: the layers whose compiled gradients are checked against eager mode (their hand-written autograd functions)
COMPILED_CHECK_ROWS = ("kep_svgp", "kep_svgp_official_style", "primal")
#: the comparison's rows timed on MNIST-1D (all of its default rows)
MNIST1D_ROWS = ("kep_svgp", "sgpa", "softmax", "softmax_mc_dropout", "primal")


def _sibling(path: Path):
    """A fresh copy of the benchmark file ``path`` as the module ``<stem>_for_<this module's name>``."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_for_{__name__}", path)
    module = importlib.util.module_from_spec(spec)
    # registered, as an import would: dynamo imports the module of a class it traces by name (the floor's, compiled in
    # CompiledLoss, failed with "No module named 'attention_scaling_for_gpu_check'"); one per loaded copy of this script
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCH = _sibling(SCALING_SCRIPT)
#: the JSON results, written after every section and on Ctrl-C or SIGTERM (shared with gpu_grid.py)
RESULTS = _sibling(SCALING_SCRIPT.with_name("_results_json.py"))


@contextlib.contextmanager
def triton_setting(value: str):
    """``GPATTN_TRITON`` set to ``value`` inside the block: ``"0"`` the PyTorch code of KEP-SVGP's fused scores,
    ``"1"`` the Triton kernels at any sequence length."""
    previous = os.environ.get(triton_scores.TRITON_VARIABLE)
    os.environ[triton_scores.TRITON_VARIABLE] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(triton_scores.TRITON_VARIABLE, None)
        else:
            os.environ[triton_scores.TRITON_VARIABLE] = previous


def pytorch_path():
    """KEP-SVGP's fused scores by their PyTorch code instead of the Triton kernels inside the block."""
    return triton_setting("0")


def triton_kernels():
    """KEP-SVGP's fused scores by the Triton kernels inside the block, also above ``TRITON_MAX_TOKENS``."""
    return triton_setting("1")


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


# -- 1. environment --------------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    info = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": getattr(triton_scores.triton, "__version__", None),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average": _load(),
        "gpattn_revision": _git_revision(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(
            name=properties.name,
            capability=f"{properties.major}.{properties.minor}",
            memory_gib=round(properties.total_memory / 2**30, 1),
            multiprocessors=properties.multi_processor_count,
            driver=_nvidia_smi("driver_version"),
        )
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def _nvidia_smi(field: str) -> str | None:
    try:
        result = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else None


def _git_revision() -> str | None:
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or None


# -- 2. equivalence --------------------------------------------------------------------------------------------------
def _small_layer(name: str, length: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if name in BENCH.VARIANTS and name not in attention_names():
        layer = BENCH._build(name, 16, 2, 4, torch.device("cpu"), length=length)
    else:
        layer = build_attention(name, 16, 2, **select_arguments(name, num_inducing=4, max_len=length))
    return layer.to(dtype)


def _mean_and_gradients(layer: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> list[torch.Tensor]:
    layer.eval().zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    output = layer(x)
    loss = (output * probe).sum() + layer.kl_divergence()  # zero for deterministic layers
    loss.backward()
    # no gradient counts as a zero one (a compiled step on torch < 2.4 may give one where eager mode gives none)
    gradients = [torch.zeros_like(p) if p.grad is None else p.grad for p in layer.parameters() if p.requires_grad]
    return [output.detach(), x.grad, *gradients]


def _difference(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """The largest entry of |other - reference| / max(1, |reference|) over the tensors."""
    worst = 0.0
    for want, got in zip(reference, other, strict=True):
        got = got.detach().to(want.device, want.dtype)
        scale = want.abs().clamp_min(1.0)
        worst = max(worst, float(((got - want).abs() / scale).max()))
    return worst


def _training_steps_finite(layer: torch.nn.Module, x: torch.Tensor, device: torch.device) -> dict:
    results = {}
    for label, enabled in (("float32", False), ("bfloat16", True)):
        layer.train().zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled):
            output = layer(x)
            loss = output.float().square().mean() + layer.kl_divergence().float()
            for term in getattr(layer, "added_loss_terms", tuple)():
                loss = loss + term.loss()
        loss.backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        results[label] = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g).all()) for g in grads)
    # a layer converted to bfloat16, outside autocast (on CUDA the Triton kernels are the default for it); a layer
    # that needs float32 parameters refuses it (a TypeError that says so): recorded as refused
    half = copy.deepcopy(layer).to(torch.bfloat16).train()
    try:
        output = half(x.to(torch.bfloat16))
    except TypeError as error:
        results["bfloat16_layer"] = f"refused: {error}"
        return results
    loss = output.float().square().mean() + half.kl_divergence().float()
    for term in getattr(half, "added_loss_terms", tuple)():
        loss = loss + term.loss().float()
    loss.backward()
    grads = [p.grad for p in half.parameters() if p.grad is not None]
    results["bfloat16_layer"] = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g).all()) for g in grads)
    return results


def equivalence(device: torch.device, smoke: bool, graphed_rows: tuple[str, ...] = GRAPHED_ROWS) -> dict:
    """CPU against ``device`` in float64 for every layer; finite float32/bfloat16/bfloat16-layer steps; Triton against
    PyTorch;
    CUDA-graph steps against eager ones."""
    length, results = 12, {}
    x = torch.randn(2, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, length, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for name in (*attention_names(), *VARIANT_ROWS):
        try:
            layer = _small_layer(name, length, torch.float64)
            moved = copy.deepcopy(layer).to(device)  # before a call leaves per-call tensors on the layer
            reference = _mean_and_gradients(layer, x, probe)
            other = _mean_and_gradients(moved, x.to(device), probe.to(device))
            difference = _difference(reference, other)
            finite = _training_steps_finite(moved.float(), x.float().to(device), device)
            results[name] = {"float64_difference": difference, "ok": difference <= 1e-10, "steps_finite": finite}
        except Exception as error:  # noqa: BLE001 (recorded: the check goes on with the next layer)
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    try:
        results["kep_svgp_triton_vs_pytorch"] = _triton_against_pytorch(device, smoke)
    except Exception as error:  # noqa: BLE001 (recorded: the check goes on)
        results["kep_svgp_triton_vs_pytorch"] = {"error": f"{type(error).__name__}: {error}"}
    try:
        results["kep_svgp_split_triton_vs_pytorch"] = _triton_against_pytorch(device, smoke, split=True)
    except Exception as error:  # noqa: BLE001 (recorded: the check goes on)
        results["kep_svgp_split_triton_vs_pytorch"] = {"error": f"{type(error).__name__}: {error}"}
    for name in COMPILED_CHECK_ROWS:
        try:
            results[f"{name}_compiled_vs_eager"] = _compiled_against_eager(name, device, x, probe)
        except Exception as error:  # noqa: BLE001 (recorded: the check goes on)
            results[f"{name}_compiled_vs_eager"] = {"error": f"{type(error).__name__}: {error}"}
    for row, name, bfloat16 in _graphed_rows(device, graphed_rows):
        try:
            results[f"{row}_vs_eager"] = _graphed_against_eager(name, device, smoke, bfloat16=bfloat16)
        except Exception as error:  # noqa: BLE001 (recorded: the check goes on)
            results[f"{row}_vs_eager"] = {"error": f"{type(error).__name__}: {error}"}
    if device.type == "cuda":
        try:
            results["captured_forward_vs_eager"] = _captured_forward_against_eager(device)
        except Exception as error:  # noqa: BLE001 (recorded: the check goes on)
            results["captured_forward_vs_eager"] = {"error": f"{type(error).__name__}: {error}"}
    for name in AUTOCAST_ROWS:
        try:
            results[f"{name}_bfloat16_error"] = _bfloat16_error(name, device, smoke)
        except Exception as error:  # noqa: BLE001 (recorded: the check goes on)
            results[f"{name}_bfloat16_error"] = {"error": f"{type(error).__name__}: {error}"}
    return results


class _CompiledLayer(torch.nn.Module):
    """A layer whose forward pass and KL are both compiled (``aot_eager``), with the layer's parameters."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer
        self._compiled = (
            torch.compile(layer, backend="aot_eager"),
            torch.compile(layer.kl_divergence, backend="aot_eager"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._compiled[0](x)

    def kl_divergence(self) -> torch.Tensor:
        return self._compiled[1]()


def _compiled_against_eager(name: str, device: torch.device, x: torch.Tensor, probe: torch.Tensor) -> dict:
    """The layer and its KL compiled (``backend="aot_eager"``: dynamo and AOT autograd, as every backend traces,
    without generating kernels) against eager mode on ``device`` in float64: the predictive mean and every gradient
    within 1e-10. torch 2.11 gave every input of the fused scores and of the KL a zero gradient under compile until they
    stopped returning a tensor modified in place."""
    layer = _small_layer(name, x.shape[1], torch.float64).to(device)
    x, probe = x.to(device), probe.to(device)
    reference = _mean_and_gradients(layer, x, probe)
    torch._dynamo.reset()
    compiled = _mean_and_gradients(_CompiledLayer(layer), x, probe)
    difference = _difference(reference, compiled)
    return {"float64_difference": difference, "ok": difference <= 1e-10}


class GraphedStep:
    """One training step of ``layer`` on the input ``x`` (the benchmark's loss and its backward pass) captured as one
    CUDA graph and replayed, by the training loop's :class:`~gpattn.training.graphs.CapturedStep`: the launches of the
    eager step, its Triton kernels among them, without the host's dispatch. The layer must support capture
    (``supports_graph_capture``: it reads no value while captured, so that its magnitude guards are off in the graph).
    Warm-up steps on a side stream come first (the last one running the capture's code), the gradients are the graph's
    own tensors, written at every replay; random draws are fresh at every replay.

    :param layer: The layer, on a CUDA device (its gradients are the graph's from here on).
    :param x: The input; :meth:`__call__` copies another batch of its shape into the graph's own.
    :param warmup: Eager steps before the capture.
    :param graph: The graph class (default: a CUDA graph; the tests pass the CPU's stand-in,
        :class:`~gpattn.training.graphs.EmulatedGraph`).
    :param context: A context for the forward pass (e.g. bfloat16 autocast, captured with it; the backward pass
        outside it, as ``torch.autocast`` recommends).
    """

    def __init__(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        warmup: int = 3,
        graph: type | None = None,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        from gpattn.training.graphs import CapturedStep

        if not getattr(layer, "supports_graph_capture", True):  # the floor (a benchmark module) reads nothing
            raise ValueError(f"{type(layer).__name__} does not support graph capture")
        self.layer, self.labels = layer, x.new_zeros(0)
        parameters = [parameter for parameter in layer.parameters() if parameter.requires_grad]

        def loss(inputs: torch.Tensor, mask: None, labels: torch.Tensor) -> torch.Tensor:
            with context():  # the forward pass under the row's context (autocast), the backward pass outside it
                return BENCH.step_loss(layer, inputs)[None]

        self.step = CapturedStep(loss, parameters, x.device, warmup, graph)
        self.step(x, None, self.labels)  # the capture (and a first replay)

    def __call__(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the step (on ``x`` if given); returns the graph's loss tensor (overwritten by the next replay)."""
        parts = self.step.replay() if x is None else self.step(x, None, self.labels)
        return parts[0]


def _gradients(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.grad.detach().clone() for parameter in layer.parameters() if parameter.grad is not None]


def _graphed_against_eager(
    name: str, device: torch.device, smoke: bool, graph: type | None = None, bfloat16: bool = False
) -> dict:
    """A CUDA-graph step of ``name`` against the eager step, float32 (with ``bfloat16``: the forward passes of both
    under bfloat16 autocast), at the benchmark's sizes: in eval mode (the predictive mean: no draw) the loss and every
    gradient, relative to the largest entry (same kernels, so close to rounding: within 1e-4, 1e-3 under autocast),
    and the gradients of a replay on another input against the eager step's there (an empty or stale graph fails); in
    training two replays, which must differ for a stochastic layer (fresh draws, not the captured ones) and be finite,
    their gradients in the same tensors."""
    batch, length, width, heads, rank = (2, 16, 16, 2, 4) if smoke else (16, 256, 128, 4, 10)
    torch.manual_seed(0)
    x, other = (torch.randn(batch, length, width, device=device) for _ in range(2))
    context = _forward_context(device, bfloat16)
    results = {}
    for mode in ("eval", "train"):
        layer = BENCH._build(name, width, heads, rank, device, length=length).train(mode == "train")
        eager = copy.deepcopy(layer)
        graphed = GraphedStep(layer, x, graph=graph, context=context)
        first = graphed().detach().clone()
        pointers = [parameter.grad.data_ptr() for parameter in layer.parameters() if parameter.grad is not None]
        if mode == "eval":
            for index, value in enumerate((x, other)):
                loss = graphed(value).detach().clone() if index else first
                eager.zero_grad(set_to_none=True)
                with context():
                    reference_loss = BENCH.step_loss(eager, value)
                reference_loss.backward()
                reference = [reference_loss.detach(), *_gradients(eager)]
                results[f"eval_difference_{index}"] = _difference(reference, [loss, *_gradients(layer)])
        else:
            second = graphed().detach().clone()
            results["train_finite"] = bool(torch.isfinite(first) & torch.isfinite(second))
            stochastic = getattr(layer, "is_stochastic", False)
            results["train_replays_differ"] = bool(first != second) if stochastic else None
        after = [parameter.grad.data_ptr() for parameter in layer.parameters() if parameter.grad is not None]
        results[f"{mode}_gradients_in_place"] = after == pointers
    fresh = results["train_replays_differ"] is not False  # None: a deterministic layer
    close = max(results["eval_difference_0"], results["eval_difference_1"]) <= (1e-3 if bfloat16 else 1e-4)
    in_place = results["eval_gradients_in_place"] and results["train_gradients_in_place"]
    results["ok"] = close and results["train_finite"] and fresh and in_place
    return results


def _captured_forward_against_eager(device: torch.device, graph: type | None = None) -> dict:
    """A KEP-SVGP token classifier's evaluation passes through :class:`~gpattn.training.graphs.CapturedForward`
    against eager passes, float32: the predictive mean (no draw) on two inputs (the second a replay) and again after
    the parameters changed in place (a stale graph fails), relative to the largest logit; four Monte Carlo passes by
    ``monte_carlo_logits``, finite and pairwise different (fresh draws at every replay); every capture taken (no
    eager fallback, no warning)."""
    from gpattn.attention import sample_attention
    from gpattn.models import Transformer, monte_carlo_logits
    from gpattn.training.graphs import CapturedForward

    torch.manual_seed(0)
    model = Transformer(4, embed_dim=32, depth=1, num_heads=2, attention="kep_svgp", vocab_size=8, max_len=16)
    model = model.to(device).eval()
    tokens = [torch.randint(0, 8, (64, 16), device=device) for _ in range(2)]
    captured = CapturedForward(model, device, graph=graph)
    results = {}
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for index, value in enumerate(tokens):
            results[f"mean_difference_{index}"] = _difference([model(value)], [captured(value)])
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
        results["mean_difference_after_a_step"] = _difference([model(tokens[0])], [captured(tokens[0])])
        with sample_attention(captured):
            samples = monte_carlo_logits(captured, tokens[0], num_samples=4)
    results["samples_finite"] = bool(torch.isfinite(samples).all())
    results["samples_differ"] = all(not torch.equal(samples[i], samples[j]) for i in range(4) for j in range(i))
    results["graphs"] = len(captured.graphs)
    results["all_captured"] = all(entry is not None for entry in captured.graphs.values())
    results["warnings"] = [str(warning.message)[:300] for warning in caught]
    close = max(value for key, value in results.items() if key.startswith("mean_difference")) <= 1e-5
    results["ok"] = close and results["samples_finite"] and results["samples_differ"] and results["all_captured"]
    return results


def _bfloat16_error(name: str, device: torch.device, smoke: bool) -> dict:
    """The layer's output (eval mode: the predictive mean) under bfloat16 autocast against float32 on ``device``, at
    the benchmark's sizes: the largest entry and the norm of the difference relative to float32's largest entry and
    norm (issue 25: within 2e-2)."""
    batch, length, width = (2, 16, 16) if smoke else (16, 256, 128)
    torch.manual_seed(0)
    layer = build_attention(name, width, 2 if smoke else 4, **select_arguments(name, num_inducing=4 if smoke else 10))
    layer = layer.to(device).eval()
    x = torch.randn(batch, length, width, device=device)
    with torch.no_grad():
        reference = layer(x).float()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            low = layer(x).float()
    entry = float((low - reference).abs().max() / reference.abs().max().clamp_min(1e-30))
    norm = float((low - reference).norm() / reference.norm().clamp_min(1e-30))
    return {"largest_entry": entry, "norm": norm, "ok": max(entry, norm) <= 2e-2}


@contextlib.contextmanager
def _kernel_calls():
    """The calls of the fused scores' Triton forward kernel inside the block (a list, one entry per call): whether the
    kernels ran, observed rather than predicted."""
    from gpattn.features import amortized_scores

    calls, original = [], amortized_scores.scores_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    amortized_scores.scores_forward = counted
    try:
        yield calls
    finally:
        amortized_scores.scores_forward = original


def _triton_against_pytorch(device: torch.device, smoke: bool, split: bool = False) -> dict:
    """The KEP layer's float32 predictive mean and gradients through the Triton kernels and through the PyTorch code
    on ``device``: the relative difference, and whether the kernels ran (on CUDA they must, for ``ok``). At the
    benchmark's sizes, or with ``split`` at a length the kernels split over three programs per sequence and head
    (``2 TOKENS_PER_PROGRAM + BLOCK_N + 7`` tokens: the last tile and chunk partial; the kernels forced as above
    ``TRITON_MAX_TOKENS``)."""
    batch, length, width = (2, 16, 16) if smoke else (16, 256, 128)
    if split:
        batch, length = 2, 2 * triton_scores.TOKENS_PER_PROGRAM + triton_scores.BLOCK_N + 7
    torch.manual_seed(0)
    layer = build_attention("kep_svgp", width, 2 if smoke else 4, num_inducing=4 if smoke else 10).to(device)
    x = torch.randn(batch, length, width, device=device)
    probe = torch.randn(batch, length, width, device=device)
    with pytorch_path():
        reference = _mean_and_gradients(layer, x, probe)
    with triton_kernels() if split else contextlib.nullcontext(), _kernel_calls() as calls:
        kernels = _mean_and_gradients(layer, x, probe)
    worst = 0.0
    for want, got in zip(reference, kernels, strict=True):
        worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
    ran = bool(calls)
    result = {"relative_difference": worst, "kernels_ran": ran, "ok": worst < 1e-4 and (ran or device.type != "cuda")}
    if split:
        result.update(tokens=length, programs_per_head=-(-length // triton_scores.TOKENS_PER_PROGRAM))
    return result


# -- 3. counts -------------------------------------------------------------------------------------------------------
def _profiled(step, device: torch.device, *, host: bool, warmup: int = 1, steps: int = 1):
    """The profiler of ``steps`` calls of ``step`` after ``warmup`` untimed ones, the device synchronised before and
    after: the CPU's events (``host``, or always on a CPU) and, on CUDA, the device's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] if host or device.type != "cuda" else []
    activities += [ProfilerActivity.CUDA] if device.type == "cuda" else []
    for _ in range(warmup):
        step()
    BENCH._synchronize(device)
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        BENCH._synchronize(device)
    return profiler


def _counts(step, device: torch.device) -> dict:
    profiler = _profiled(step, device, host=True)
    operators = 0
    launches = 0
    for event in profiler.events():
        if "LaunchKernel" in event.name or event.name == "cudaGraphLaunch":
            launches += 1
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        operators += parent is None
    return {"operators": operators, "kernel_launches": launches if device.type == "cuda" else None}


def counts(device: torch.device, args: argparse.Namespace) -> dict:
    x = torch.randn(args.batch, args.lengths[0], args.embed_dim, device=device)
    results = {}
    for row, layer, context in _rows(device, args, args.lengths[0], compiled=False):
        results[row] = _counts(lambda layer=layer, context=context: _step(layer, x, context), device)
    return results


# -- 4. scaling ------------------------------------------------------------------------------------------------------
def _step(layer, x, context) -> None:
    with context():
        BENCH._step(layer, x)


def _autocast(device: torch.device):
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def _forward_context(device: torch.device, bfloat16: bool) -> Callable[[], contextlib.AbstractContextManager]:
    """The context of a graphed row's forward pass: bfloat16 autocast on ``device``, or none (float32)."""
    return _autocast(device) if bfloat16 else contextlib.nullcontext


class CompiledLoss(torch.nn.Module):
    """A training step's whole loss compiled as one function: the layer's forward pass, its KL and its added loss terms
    (the KSVD penalty), so that a CUDA graph captures all of it; ``torch.compile(layer)`` alone leaves the KL and the
    added terms, and their backward passes, to eager mode. Timed by the same step as the layers (``BENCH._step``): its
    output is the loss, its own KL zero and it has no added terms.

    :param compile_options: Passed to ``torch.compile`` (``mode``, ``backend``).
    """

    def __init__(self, layer: torch.nn.Module, **compile_options):
        super().__init__()
        self.layer = layer
        self._loss = torch.compile(BENCH.step_loss, **compile_options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._loss(self.layer, x)

    def kl_divergence(self) -> float:
        return 0.0


def _compile_mode(device: torch.device) -> str:
    """``torch.compile``'s mode of the compiled rows: CUDA graphs on CUDA, the default mode elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else "default"


def _rows(device: torch.device, args: argparse.Namespace, length: int, compiled: bool):
    """``(row, layer, context)`` of one length: the eager rows, their bfloat16 and PyTorch-path variants, and with
    ``compiled`` the CUDA-graph rows."""
    plain = contextlib.nullcontext
    for name in TABLE_ROWS:
        if name == "sgpa" and length > args.max_sgpa_length:
            continue
        layer = BENCH._build(name, args.embed_dim, args.num_heads, args.rank, device, length=length)
        yield name, layer, plain
        if name == "kep_svgp":  # the default takes the kernels up to TRITON_MAX_TOKENS: the other path beside it
            yield "kep_svgp_pytorch", layer, pytorch_path
            if length > triton_scores.TRITON_MAX_TOKENS:
                yield "kep_svgp_triton", layer, triton_kernels
        if name in AUTOCAST_ROWS:
            yield f"{name}_bf16", layer, _autocast(device)
        if compiled and name in COMPILED_ROWS:
            yield f"{name}_compiled", torch.compile(layer, mode=_compile_mode(device)), plain
            yield f"{name}_compiled_loss", CompiledLoss(layer, mode=_compile_mode(device)), plain


def _graphed_rows(device: torch.device, names: Sequence[str]):
    """``(row, name, bfloat16)`` of the CUDA-graph rows (none off CUDA): each of ``names`` captured in float32
    (``{name}_graphed``) and, for the autocast rows, with its forward pass under bfloat16 autocast
    (``{name}_bf16_graphed``, :func:`_forward_context`: the bf16 targets without the host time that autocast's casts
    add to an eager step)."""
    for name in names if device.type == "cuda" else ():
        yield f"{name}_graphed", name, False
        if name in AUTOCAST_ROWS:
            yield f"{name}_bf16_graphed", name, True


def scaling(device: torch.device, args: argparse.Namespace, deadline: float, into: dict | None = None) -> dict:
    """The scaling table (``table``: per length the rows' median step times, the rows that did not run) and its
    ``ratios``; filled into ``into`` (returned) as it goes, so that the lengths timed before an error or a stop stay.
    A row that fails in its first step or while timed is left out of its length and its error recorded."""
    results = {} if into is None else into
    official = BENCH.load_official(args.official_path) if args.official_path else None
    timing = argparse.Namespace(warmup=2, min_reps=3, max_reps=args.max_reps, budget_s=args.budget_s)
    table = results["table"] = {}
    for length in args.lengths:
        if time.perf_counter() > deadline:
            table[length] = {"skipped": "time budget"}
            continue
        x = torch.randn(args.batch, length, args.embed_dim, device=device)
        steps = {}
        for row, layer, context in _rows(device, args, length, compiled=length in args.compile_lengths):
            steps[row] = lambda layer=layer, context=context, x=x: _step(layer, x, context)
        if official is not None:
            step = BENCH.OfficialStep(official, args.embed_dim, args.num_heads, length, args.rank, device)
            steps[BENCH.OFFICIAL] = lambda step=step, x=x: step(x)
        row_errors = {}
        for row, name, bfloat16 in _graphed_rows(device, args.graphed_rows):  # captured here: failures are recorded
            try:
                layer = BENCH._build(name, args.embed_dim, args.num_heads, args.rank, device, length=length)
                steps[row] = GraphedStep(layer, x, context=_forward_context(device, bfloat16))
            except Exception as error:  # noqa: BLE001
                row_errors[row] = f"{type(error).__name__}: {error}"
        for row, step in list(steps.items()):  # a row that cannot run (a kernel that does not compile, memory) is
            try:  # left out of this length and recorded; the other rows are still timed
                step()
            except Exception as error:  # noqa: BLE001
                row_errors[row] = f"{type(error).__name__}: {error}"
                del steps[row]
        load = _load()
        try:  # a row that fails while timed (out of memory) is left out and recorded, the others keep their times
            times = BENCH._interleaved_medians(steps, timing, device, errors=row_errors)
            table[length] = {"times_ms": times, "load": [load, _load()]}
        except Exception as error:  # noqa: BLE001 (an error outside the rows' steps ends this length, not the check)
            table[length] = {"error": f"{type(error).__name__}: {error}"}
        if row_errors:
            table[length]["row_errors"] = row_errors
        results["ratios"] = _ratios(table)
        del steps
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"N={length}: {table[length]}", flush=True)
    results["ratios"] = _ratios(table)
    return results


RATIOS = (
    ("kep_svgp / floor", "kep_svgp", "floor"),
    ("kep_svgp / softmax", "kep_svgp", "softmax"),
    ("kep_svgp / kep_svgp_pytorch", "kep_svgp", "kep_svgp_pytorch"),
    ("kep_svgp_triton / kep_svgp_pytorch", "kep_svgp_triton", "kep_svgp_pytorch"),
    ("compiled kep_svgp / compiled floor", "kep_svgp_compiled", "floor_compiled"),
    ("compiled loss kep_svgp / compiled loss floor", "kep_svgp_compiled_loss", "floor_compiled_loss"),
    ("graphed kep_svgp / graphed floor", "kep_svgp_graphed", "floor_graphed"),
    ("graphed kep_svgp / compiled floor", "kep_svgp_graphed", "floor_compiled"),
    ("graphed kep_svgp / graphed softmax", "kep_svgp_graphed", "softmax_graphed"),
    ("graphed kep_svgp / kep_svgp", "kep_svgp_graphed", "kep_svgp"),
    ("official-style / official", "kep_svgp_official_style", BENCH.OFFICIAL),
    ("bf16 kep_svgp / bf16 softmax", "kep_svgp_bf16", "softmax_bf16"),
    ("bf16 kep_svgp / kep_svgp", "kep_svgp_bf16", "kep_svgp"),
    ("graphed bf16 kep_svgp / graphed bf16 softmax", "kep_svgp_bf16_graphed", "softmax_bf16_graphed"),
    ("graphed bf16 kep_svgp / graphed kep_svgp", "kep_svgp_bf16_graphed", "kep_svgp_graphed"),
)


def _ratios(table: dict) -> dict:
    ratios = {}
    for length, entry in table.items():
        times = entry.get("times_ms", {})
        ratios[length] = {label: times[a] / times[b] for label, a, b in RATIOS if a in times and b in times}
    return ratios


# -- 5. kernels -------------------------------------------------------------------------------------------------------
#: the steps whose kernels are listed: the floor and KEP-SVGP, eagerly and (where compiled rows run) as a compiled loss
KERNEL_ROWS = ("floor", "kep_svgp")


def _self_time_us(entry, device: torch.device) -> float:
    """The self time of one profiler average: the device's on CUDA (torch 2.4+ names it ``self_device_time_total``,
    older releases ``self_cuda_time_total``), the CPU's on a CPU."""
    if device.type != "cuda":
        return float(entry.self_cpu_time_total)
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(entry, name, 0.0)
        if value:
            return float(value)
    return 0.0


def _kernel_table(step, device: torch.device, steps: int = 3, top: int = 12) -> dict:
    """What one step spends on the device, from the profiler (``steps`` steps after three untimed ones): the device's
    busy time and the kernels (and copies) per step, and the ``top`` kernels by time; on a CPU the operators' calls
    and self CPU time instead."""
    profiler = _profiled(step, device, host=False, warmup=3, steps=steps)
    entries = [(e.key, e.count, _self_time_us(e, device)) for e in profiler.key_averages()]
    entries = sorted((entry for entry in entries if entry[2] > 0), key=lambda entry: -entry[2])
    return {
        "busy_us_per_step": sum(entry[2] for entry in entries) / steps,
        "kernels_per_step": sum(entry[1] for entry in entries) / steps,
        "top": [
            {"name": name[:100], "per_step": count / steps, "us_per_step": time_us / steps}
            for name, count, time_us in entries[:top]
        ],
    }


def kernels(device: torch.device, args: argparse.Namespace, deadline: float, into: dict | None = None) -> dict:
    """The device time of one training step and its largest kernels, for the floor and KEP-SVGP at the first compiled
    length (eager, and with compiled rows the whole loss compiled as in :class:`CompiledLoss`): where a CUDA-graph step
    spends its time once the host's dispatch is gone. Filled into ``into`` (returned) as it goes."""
    length = (args.compile_lengths or args.lengths)[0]
    x = torch.randn(args.batch, length, args.embed_dim, device=device)
    results = {} if into is None else into
    results.update(length=length, rows={})
    for name in KERNEL_ROWS:
        layer = BENCH._build(name, args.embed_dim, args.num_heads, args.rank, device, length=length)
        forms = {"eager": layer}
        if args.compile_lengths:
            forms["compiled_loss"] = CompiledLoss(layer, mode=_compile_mode(device))
        for form, module in forms.items():
            if time.perf_counter() > deadline:
                results["rows"][f"{name}_{form}"] = "skipped: time budget"
                continue
            try:
                table = _kernel_table(lambda module=module: BENCH._step(module, x), device)
            except Exception as error:  # noqa: BLE001 (recorded: the other rows still run)
                table = {"error": f"{type(error).__name__}: {error}"}
            results["rows"][f"{name}_{form}"] = table
    return results


# -- 6. MNIST-1D -----------------------------------------------------------------------------------------------------
def _metrics(record) -> dict:
    content = record.to_dict()
    content["train"].pop("seconds", None)
    return content


class _EnoughSteps(Exception):
    """Raised by the step timer of :func:`_timed_steps` once it has timed its steps."""


def _timed_steps(row: str, where: str, compiled: bool, args: argparse.Namespace, data, graphs: bool = False) -> dict:
    """The median milliseconds per training step of the MNIST-1D comparison model of ``row`` on ``where`` (after the
    warm-up steps), the warm-up's seconds (a compiled model compiles there, a graphed step is captured there) and the
    batch size; ``graphs``: the full-size steps captured as a CUDA graph (``gpattn compare --cuda-graphs``)."""
    from gpattn.comparison import CompareConfig
    from gpattn.comparison.runner import run_environment
    from gpattn.comparison.runs import build_model, compile_model, make_train_config
    from gpattn.methods import get_method
    from gpattn.training import Callback, train_model

    class StepTimer(Callback):
        """Records the time at the end of every step and stops the run after the warm-up and timed steps, before its
        validation (a step reads the device, so its end on the host is its end on the device)."""

        def __init__(self, warmup: int, steps: int):
            self.warmup, self.steps, self.ends = warmup, steps, []

        def on_step_end(self, context, epoch, step, values) -> None:
            self.ends.append(time.perf_counter())
            if len(self.ends) == self.warmup + self.steps + 1:
                raise _EnoughSteps

    config = CompareConfig(attentions=(row,), device=where, threads=1, tuned=False, progress=False, cuda_graphs=graphs)
    method = get_method(row)
    hyperparameters = config.hyperparameters("mnist1d", method, data.defaults)
    timer = StepTimer(args.train_step_warmup, args.train_step_steps)
    with run_environment(config):  # one thread, and deterministic kernels on CUDA, as a comparison's runs
        torch.manual_seed(0)
        model = build_model(method, hyperparameters, data.num_classes, data.model_kwargs).to(where)
        if compiled:
            compile_model(model, where)
        train_config = make_train_config(config, method, hyperparameters, 0)
        start = time.perf_counter()
        with contextlib.suppress(_EnoughSteps):
            train_model(model, data.train, data.val, train_config, callbacks=[timer])
    timed = timer.ends[args.train_step_warmup :]
    intervals = sorted(later - earlier for earlier, later in itertools.pairwise(timed))
    return {
        "step_ms": 1000 * intervals[len(intervals) // 2],
        "warmup_s": timer.ends[args.train_step_warmup] - start,
        "steps": len(intervals),
        "batch_size": hyperparameters.batch_size,
    }


def train_step(device: torch.device, args: argparse.Namespace, deadline: float, into: dict | None = None) -> dict:
    """The median training step per ``--train-step-rows`` row and variant (``rows``), filled into ``into`` (returned)
    as it goes."""
    from gpattn.comparison import load_task

    results = {} if into is None else into
    rows: dict = results.setdefault("rows", {})
    data = load_task("mnist1d")
    variants = [(str(device), False, False)] + [(str(device), True, False)] * (not args.smoke)
    if device.type == "cuda":
        variants.append((str(device), False, True))
    if device.type != "cpu":
        variants.append(("cpu", False, False))
    for row in args.train_step_rows:
        entry = rows[row] = {}
        for where, compiled, graphs in variants:
            name = f"{where}{' compiled' if compiled else ''}{' graphs' if graphs else ''}"
            if time.perf_counter() > deadline:
                entry[name] = "skipped: time budget"
                continue
            try:
                entry[name] = _timed_steps(row, where, compiled, args, data, graphs)
            except Exception as error:  # noqa: BLE001 (recorded: the other variants still run)
                entry[name] = {"error": f"{type(error).__name__}: {error}"}
        _step_ratio(entry, "compiled / eager", f"{device} compiled", str(device))
        _step_ratio(entry, "graphs / eager", f"{device} graphs", str(device))
        if device.type != "cpu":
            _step_ratio(entry, f"{device.type} / cpu", str(device), "cpu")
    return results


def _step_ratio(entry: dict, label: str, numerator: str, denominator: str) -> None:
    # entry[label]: the ratio of two variants' step times, where both were timed
    times = [entry.get(name) for name in (numerator, denominator)]
    if all(isinstance(value, dict) and "step_ms" in value for value in times):
        entry[label] = times[0]["step_ms"] / times[1]["step_ms"]


def mnist1d(device: torch.device, args: argparse.Namespace, deadline: float, into: dict | None = None) -> dict:
    """One MNIST-1D run per ``--mnist1d-rows`` row on the device and on the CPU (``runs``: seconds and test accuracy,
    or the run's error), then the identity of ``--jobs`` runs at once against the same runs one by one
    (``jobs_identity``), skipped where the runs one by one alone, as timed above, would end past the deadline.
    Filled into ``into`` (returned) as it goes."""
    from gpattn.comparison import CompareConfig, load_task, train_and_evaluate
    from gpattn.comparison.runner import execute_runs, run_environment

    results = {} if into is None else into
    runs = results.setdefault("runs", {})
    results["jobs_identity"] = None
    data = load_task("mnist1d")
    # the shared settings (tuned=False): a tuned file would replace --mnist1d-epochs
    settings = dict(
        mnist1d_epochs=args.mnist1d_epochs, eval_samples=2, fidelity_sequences=0, temperature_scaling=False,
        progress=False, seeds=(0,), tasks=("mnist1d",), threads=1, tuned=False,
    )  # fmt: skip
    for row in args.mnist1d_rows:
        for where in (str(device), "cpu") if device.type == "cuda" else ("cpu",):
            if time.perf_counter() > deadline:
                runs.setdefault(row, {})[where] = "skipped: time budget"
                continue
            config = CompareConfig(attentions=(row,), device=where, **settings)
            try:
                with run_environment(config):
                    start = time.perf_counter()
                    record = train_and_evaluate(config, "mnist1d", row, 0, data=data)
                seconds = time.perf_counter() - start
                runs.setdefault(row, {})[where] = {"seconds": seconds, "test_accuracy": record.metrics.test.accuracy}
            except Exception as error:  # noqa: BLE001 (recorded: the other runs still run)
                runs.setdefault(row, {})[where] = {"error": f"{type(error).__name__}: {error}"}
    rows, seeds = args.mnist1d_rows[:2], (0,) if args.smoke else (0, 1)  # up to two rows and two seeds
    plan = [("mnist1d", row, seed) for row in rows for seed in seeds]
    # the runs one by one take about the device's times above (the runs together, at most as long, come after them)
    timed = [runs.get(row, {}).get(str(device)) for row in rows]
    expected = sum(entry["seconds"] for entry in timed if isinstance(entry, dict) and "seconds" in entry) * len(seeds)
    left = deadline - time.perf_counter()
    if left <= 0 or expected > left:
        results["jobs_identity"] = (
            f"skipped: time budget ({expected:.1f} s of runs one by one, {max(left, 0):.1f} s left)"
        )
        return results
    config = CompareConfig(attentions=tuple(rows), device=str(device), jobs=1, **{**settings, "seeds": seeds})
    try:
        start = time.perf_counter()
        alone = execute_runs(config, plan)
        middle = time.perf_counter()
        together = execute_runs(dataclasses.replace(config, jobs=args.jobs), plan)
        end = time.perf_counter()
    except Exception as error:  # noqa: BLE001 (recorded beside the runs above)
        results["jobs_identity"] = {"error": f"{type(error).__name__}: {error}"}
        return results
    results["jobs_identity"] = {
        "runs": len(plan),
        "jobs": args.jobs,
        "seconds_one_by_one": middle - start,
        "seconds_together": end - middle,
        "identical_records": all(_metrics(a) == _metrics(b) for a, b in zip(alone, together, strict=True)),
    }
    return results


# -- main ------------------------------------------------------------------------------------------------------------
def _section(results: dict, name: str, function, *arguments, partial: bool = False) -> None:
    """``results[name]``: what ``function(*arguments)`` returns, or its error (the next section still runs). With
    ``partial`` the function fills ``results[name]`` as it goes (its keyword ``into``), so that what it measured before
    an error, Ctrl-C or SIGTERM stays in the results beside the error."""
    start = time.perf_counter()
    into = results[name] = {} if partial else None
    try:
        results[name] = function(*arguments, into=into) if partial else function(*arguments)
    except Exception as error:  # noqa: BLE001 (recorded: the next section still runs)
        results[name] = {
            **(into or {}),
            "error": f"{type(error).__name__}: {error}",
            "traceback": traceback.format_exc(),
        }
    except KeyboardInterrupt as error:  # Ctrl-C or SIGTERM (Stopped): recorded, and the run stops
        results[name] = {**(into or {}), "stopped": f"{type(error).__name__}: {error}"}
        raise
    finally:
        results.setdefault("seconds", {})[name] = time.perf_counter() - start
        print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)


def summary(results: dict) -> str:
    """The lines printed last: what passed, the ratios per length, the MNIST-1D times."""
    lines = [f"device: {results['environment'].get('name')} ({results['environment'].get('device')})"]
    checks = {name: entry for name, entry in results.get("equivalence", {}).items() if isinstance(entry, dict)}
    failed = [name for name, entry in checks.items() if not entry.get("ok")]
    lines.append(f"equivalence: {len(checks) - len(failed)} ok, not ok: {failed or 'none'}")
    for name, entry in results.items():  # a section that failed or was stopped as a whole
        for key in ("error", "stopped"):
            if isinstance(entry, dict) and isinstance(entry.get(key), str):
                lines.append(f"{name} {key}: {entry[key]}")
    if "stopped" in results:
        lines.append(f"stopped: {results['stopped']}")
    for row, entry in results.get("counts", {}).items():
        if isinstance(entry, dict) and "operators" in entry:
            lines.append(f"counts {row}: {entry['operators']} operators, {entry['kernel_launches']} launches")
    for length, ratios in results.get("scaling", {}).get("ratios", {}).items():
        lines.append(f"N={length}: " + ", ".join(f"{label} {value:.2f}" for label, value in ratios.items()))
    for length, entry in results.get("scaling", {}).get("table", {}).items():
        for row, error in entry.get("row_errors", {}).items():
            lines.append(f"N={length}: {row} did not run ({error})")
    for row, entry in results.get("kernels", {}).get("rows", {}).items():
        if isinstance(entry, dict) and "busy_us_per_step" in entry:
            lines.append(
                f"kernels {row}: {entry['busy_us_per_step'] / 1000:.2f} ms busy, {entry['kernels_per_step']:.0f} "
                f"kernels per step; largest: {entry['top'][0]['name'] if entry['top'] else '-'}"
            )
    for row, entry in results.get("train_step", {}).get("rows", {}).items():
        lines.append(f"train step {row}: {entry}")
    for row, entry in results.get("mnist1d", {}).get("runs", {}).items():
        lines.append(f"mnist1d {row}: {entry}")
    lines.append(f"jobs identity: {results.get('mnist1d', {}).get('jobs_identity')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every section at tiny sizes, without compiled rows and with one job: checks the script itself (on a CPU)",
    )
    parser.add_argument(
        "--official-path",
        metavar="DIR",
        help="a checkout of the official KEP-SVGP code: its layer as a row of the scaling table",
    )
    parser.add_argument(
        "--out",
        default="benchmarks/results/gpu_check.json",
        help="the JSON file, written after every section and on Ctrl-C or SIGTERM (default %(default)s)",
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="sequence lengths of the scaling table"
    )
    parser.add_argument(
        "--compile-lengths",
        type=int,
        nargs="*",
        default=[1024],
        help="lengths with compiled rows (torch.compile, reduce-overhead on CUDA); the kernels section's length; none: "
        "no compiled rows",
    )
    parser.add_argument("--max-sgpa-length", type=int, default=4096, help="SGPA's N x N matrices stop there")
    parser.add_argument(
        "--graphed-rows",
        nargs="*",
        default=list(GRAPHED_ROWS),
        help="rows whose step is captured as a CUDA graph (on CUDA only)",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--embed-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--max-reps", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=6.0, help="seconds of repetitions per length")
    parser.add_argument(
        "--train-step-rows",
        nargs="+",
        default=["kep_svgp", "softmax"],
        help="comparison rows of the train_step section",
    )
    parser.add_argument("--train-step-warmup", type=int, default=5, help="steps before the timed ones")
    parser.add_argument("--train-step-steps", type=int, default=30, help="timed training steps")
    parser.add_argument("--mnist1d-epochs", type=int, default=3, help="epochs of each MNIST-1D run")
    parser.add_argument(
        "--mnist1d-rows",
        nargs="+",
        default=list(MNIST1D_ROWS),
        help="rows of the MNIST-1D runs (the first two: identity)",
    )
    parser.add_argument("--jobs", type=int, default=4, help="runs at once on the device in the identity check")
    parser.add_argument(
        "--minutes",
        type=float,
        default=5.5,
        help="past this many minutes from the start, the scaling, train_step, kernels and mnist1d sections skip their "
        "remaining lengths, rows and runs (recorded as skipped; the one under way finishes, and the jobs identity "
        "check runs only if its runs fit); equivalence and counts always run (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.smoke:  # every section at tiny sizes; no compiled rows (a cold compile takes minutes on a CPU) and one
        # job in the identity check (worker processes cost seconds each to start; tests/comparison covers them)
        args.lengths, args.compile_lengths, args.batch, args.embed_dim, args.num_heads = [16, 32], [], 2, 16, 2
        args.rank, args.max_reps, args.budget_s, args.mnist1d_epochs, args.jobs = 4, 3, 0.2, 1, 1
        args.mnist1d_rows = args.train_step_rows = ["kep_svgp"]
        args.train_step_warmup, args.train_step_steps = 1, 3
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    deadline = time.perf_counter() + 60 * args.minutes
    out = Path(args.out)
    results: dict = {"config": vars(args), "environment": environment(device)}
    sections = (
        ("equivalence", equivalence, (device, args.smoke, tuple(args.graphed_rows)), False),
        ("counts", counts, (device, args), False),
        ("scaling", scaling, (device, args, deadline), True),
        ("train_step", train_step, (device, args, deadline), True),
        ("kernels", kernels, (device, args, deadline), True),
        ("mnist1d", mnist1d, (device, args, deadline), True),
    )
    # the file is written after every section, and on Ctrl-C or SIGTERM with what was measured until then
    with RESULTS.kept_when_stopped(results, out, "sections"):
        RESULTS.write_results(results, out)
        for name, function, arguments, partial in sections:
            _section(results, name, function, *arguments, partial=partial)
            RESULTS.write_results(results, out)
    print(summary(results))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
