"""Forward+backward time and peak memory of every attention layer against sequence length.

Each layer of the registry (plus the marginal-sampling and exact-feature KEP variants) runs a training step,
``(layer(x).sum() + layer.kl_divergence() + added loss terms).backward()`` (the added terms: the KSVD penalty, the CGP
regulariser), on a batch ``x`` of shape ``(B, N, C)``. SGPA and exact-feature KEP, whose N x N matrices grow as
O(N^2), and CGPT, whose Cholesky factorisations grow as O(N^3), stop at a length cap each. Repetitions are
interleaved across layers (layer 1, layer 2, ..., layer 1, ...) and the median is reported, so that drifts in the
machine's load hit every layer alike; ratios against softmax attention come from the same run. With ``--memory``,
the peak of live tensors during one step is measured in a separate pass: from the PyTorch profiler's allocation
events on CPU, ``torch.cuda.max_memory_allocated`` less what was allocated before the step on GPU.

A second sweep times the ranked layers at one length for every rank ``s`` (``--ranks``, at ``--rank-length``), and
the KL term alone (``kl_divergence()`` forward+backward), whose cost must not depend on ``N`` and grow linearly in
``s``. For ranks above the head width the cosine kernel's feature dimension is raised to ``s`` (its rank is at most
``p``). The script ends with the issue's targets as measured ratios and writes JSON and a log-log figure.

Two reference rows come with every length: ``floor``, the matrix products a KEP layer cannot avoid (the query, key
and amortised value projections, the ``(s, p)`` weights, the ``(s, N)`` scores and the output GEMM, forward and
backward, without normalisation, KSVD penalty, KL or sampling), and, with ``--official-path DIR``, ``official_kep``:
the official KEP-SVGP layer (``KEP_SVGPAttention`` of ``kep_svgp.py``) imported from the user's own checkout of
https://github.com/yingyichen-cyy/KEP-SVGP (never copied into this repository), stepped on
``out.sum() + kl + J^2`` with the paper's KSVD objective :math:`J`. ``kep_svgp_official_style`` is gpattn's layer in
the official configuration (``primal_tokens`` features, ``marginal`` sampling, one shared posterior, ``d_out = s``).
Every table prints the load average and the threads, the ratios official-style / official, KEP / official,
KEP / floor and KEP / softmax, and the number of operators a step runs (``--count-ops``, from the profiler).

Run ``python benchmarks/attention_scaling.py --help`` for the options; results go to
``benchmarks/results/attention_scaling.{json,png}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's start/stop lines out of the output
import torch  # noqa: E402

from gpattn.attention import attention_names, build_attention  # noqa: E402

VARIANTS = {
    "softmax": ("softmax", {}),
    "floor": ("floor", {}),
    "kep_svgp": ("kep_svgp", {}),
    "kep_svgp_marginal": ("kep_svgp", {"sampling": "marginal"}),
    # the official code's configuration (the registry's kep_svgp_paper where it exists; max_len = N, d_out = s)
    "kep_svgp_official_style": (
        "kep_svgp",
        {"features": "primal_tokens", "sampling": "marginal", "shared_posterior": True},
    ),
    "kep_svgp_exact": ("kep_svgp", {"features": "exact"}),
    "kep_svgp_sym": ("kep_svgp_sym", {}),
    "primal": ("primal", {}),
    "svgp": ("svgp", {}),
    "sgpa": ("sgpa", {}),
    "cgpt": ("cgpt", {}),
}
RANKED = {"kep_svgp", "kep_svgp_sym", "primal"}
#: the variants timed in the rank sweep (softmax as the reference)
RANK_VARIANTS = ("softmax", "kep_svgp", "kep_svgp_marginal", "kep_svgp_sym", "primal")
#: the official KEP-SVGP layer, timed with --official-path
OFFICIAL = "official_kep"
#: where kep_svgp.py may lie in a checkout of the official repository (or in the folder itself)
OFFICIAL_FILES = ("kep_svgp.py", "CIFAR/model/kep_svgp.py", "model/kep_svgp.py")


def load_official(directory: str | os.PathLike) -> type:
    """The official ``KEP_SVGPAttention`` class, imported from ``kep_svgp.py`` in a user's checkout of
    https://github.com/yingyichen-cyy/KEP-SVGP (``DIR/kep_svgp.py``, ``DIR/CIFAR/model/kep_svgp.py`` or
    ``DIR/model/kep_svgp.py``); nothing is copied.

    :raises FileNotFoundError: ``directory`` does not exist or holds no ``kep_svgp.py``.
    :raises ValueError: the file defines no ``KEP_SVGPAttention``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(
            f"--official-path {str(directory)!r} is not a directory: expected a checkout of "
            "https://github.com/yingyichen-cyy/KEP-SVGP (or a folder holding its kep_svgp.py)"
        )
    candidates = [root / name for name in OFFICIAL_FILES if (root / name).is_file()]
    if not candidates:
        raise FileNotFoundError(
            f"--official-path {str(directory)!r} holds no official layer: looked for " + ", ".join(OFFICIAL_FILES)
        )
    spec = importlib.util.spec_from_file_location("official_kep_svgp", candidates[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layer_class = getattr(module, "KEP_SVGPAttention", None)
    if layer_class is None:
        raise ValueError(f"--official-path: {candidates[0]} defines no KEP_SVGPAttention class")
    return layer_class


class Floor(torch.nn.Module):
    r"""The matrix products of a KEP-SVGP layer with amortised features, and nothing else: the query and key
    projections :math:`P = W g(X)^\top` (``(B, H, p, N)``), the value maps :math:`A_e(Z)^\top, A_r(X)^\top`
    (``(B, H, s, N)``), the weights :math:`W_e^\top = A_e^\top P_k^\top`, :math:`W_r^\top = A_r^\top P_q^\top`
    (``(s, p)``), the scores :math:`e^\top = W_e^\top P_q`, :math:`r^\top = W_r^\top P_k` and the output GEMM of inner
    dimension :math:`2 H s`; no normalisation, KSVD penalty, KL or sampling. A lower bound for the layer's time."""

    def __init__(self, embed_dim: int, num_heads: int, rank: int, feature_dim: int | None = None):
        super().__init__()
        self.heads, self.rank = num_heads, rank
        self.features = embed_dim // num_heads if feature_dim is None else feature_dim
        bound = embed_dim**-0.5

        def weight(rows: int, columns: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(rows, columns).uniform_(-bound, bound))

        self.query = weight(num_heads * self.features, embed_dim)
        self.key = weight(num_heads * self.features, embed_dim)
        self.left_map = weight(num_heads * rank, embed_dim)
        self.right_map = weight(num_heads * rank, embed_dim)
        self.coefficients = weight(2 * num_heads * rank, embed_dim)
        self.bias = torch.nn.Parameter(torch.zeros(embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]

        def project(weight: torch.Tensor, width: int) -> torch.Tensor:  # (B, H, width, N)
            return torch.bmm(weight.expand(batch, -1, -1), x.mT).unflatten(1, (self.heads, width))

        queries, keys = project(self.query, self.features), project(self.key, self.features)
        left_values, right_values = project(self.left_map, self.rank), project(self.right_map, self.rank)
        left = (left_values @ keys.mT) @ queries  # e^T: (B, H, s, N)
        right = (right_values @ queries.mT) @ keys  # r^T
        scores = torch.cat([left, right], dim=1).flatten(1, 2)  # (B, 2 H s, N)
        return torch.baddbmm(self.bias, scores.mT, self.coefficients.expand(batch, -1, -1))

    def kl_divergence(self) -> torch.Tensor:
        return torch.zeros(())


class OfficialStep:
    r"""One training step of the official layer: ``out.sum() + kl + J^2`` with the paper's KSVD objective
    :math:`J = \tfrac12 \overline{\|e \Lambda^{-1}\|^2} + \tfrac12 \overline{\|r \Lambda^{-1}\|^2} -
    \operatorname{tr} \overline{W_e^\top W_r}` (means over sequences, heads and tokens; the trace of the head mean),
    written here from the paper, as the official training script adds it to the loss."""

    def __init__(self, layer_class: type, embed_dim: int, num_heads: int, length: int, rank: int, device):
        self.layer = layer_class(dim=embed_dim, num_heads=num_heads, embed_len=length, low_rank=rank)
        self.layer = self.layer.to(device).train()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Run the step; returns the (detached) loss."""
        layer = self.layer
        layer.zero_grad(set_to_none=True)
        output, (left, right, left_weights, right_weights), inverse_lambda, kl = layer(x)
        left_term = (left @ inverse_lambda).pow(2).sum(-1).mean() / 2
        right_term = (right @ inverse_lambda).pow(2).sum(-1).mean() / 2
        trace = torch.einsum("hps,hpt->hst", left_weights, right_weights).mean(0).trace()
        loss = output.sum() + kl + (left_term + right_term - trace) ** 2
        loss.backward()
        return loss.detach()


def _build(
    variant: str,
    embed_dim: int,
    num_heads: int,
    rank: int,
    device: torch.device,
    compile_layers: bool = False,
    length: int | None = None,
) -> torch.nn.Module:
    name, kwargs = VARIANTS[variant]
    feature_dim = rank if rank > embed_dim // num_heads else None  # the cosine kernel's rank is at most p
    if name == "floor":
        return Floor(embed_dim, num_heads, rank, feature_dim).to(device).train()
    if name in RANKED:
        kwargs = {"num_inducing": rank, **kwargs}
        if feature_dim is not None:
            kwargs["feature_dim"] = feature_dim
    if variant == "kep_svgp_official_style":
        if "kep_svgp_paper" in attention_names():  # the registry's row of the papers' configuration
            name, kwargs = "kep_svgp_paper", {"num_inducing": rank}
        kwargs = {**kwargs, "max_len": length, "num_outputs": rank}
    layer = build_attention(name, embed_dim, num_heads, **kwargs).to(device).train()
    return compiled_or_eager(layer) if compile_layers and name != "softmax" else layer


def compiled_or_eager(layer: torch.nn.Module, example: torch.Tensor | None = None) -> torch.nn.Module:
    """``torch.compile(layer)``, or the eager layer where compilation is unavailable or fails (no C compiler, an
    unsupported backend): the fallback is announced, never silent. With ``example`` the compiled layer is run once
    here, so that a failure of the compiler itself falls back too."""
    try:
        compiled = torch.compile(layer)
        if example is not None:
            compiled(example)
        return compiled
    except Exception as error:  # noqa: BLE001 (any compiler failure: time the eager layer instead)
        print(
            f"torch.compile failed for {type(layer).__name__} ({type(error).__name__}: {error}); timing eager",
            flush=True,
        )
        return layer


def step_loss(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss of one training step: the output's sum, the KL and the added loss terms."""
    loss = layer(x).sum() + layer.kl_divergence()
    for term in getattr(layer, "added_loss_terms", tuple)():  # computed by the forward pass in training mode
        loss = loss + term.loss()
    return loss


def _step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    step_loss(layer, x).backward()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(layer: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """The peak (MiB) of the tensors one step of ``layer`` allocates above those alive before it (the input, the
    layers' parameters and gradients): on CUDA from the allocator's peak, on a CPU from the profiler's events."""
    if device.type == "cuda":
        _synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(layer, x)
        _synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        _step(layer, x)
    # running sum of each op's *self* allocations minus frees, in start order (a parent op's total would count its
    # children's allocations twice); its maximum is the peak of live tensors allocated during the step
    events = sorted(
        (event for event in profiler.events() if event.self_cpu_memory_usage != 0),
        key=lambda event: event.time_range.start,
    )
    live, peak = 0, 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak / 2**20


def _interleaved_medians(
    steps: dict, args: argparse.Namespace, device: torch.device, errors: dict[str, str] | None = None
) -> dict[str, float]:
    """Median time (ms) of each zero-argument step, repetitions interleaved across steps.

    :param errors: Where given, a step that raises (in its warm-up or while timed: out of memory) is left out of the
        result and its error recorded here under its name, and the other steps go on; otherwise the error propagates.
    """
    steps = dict(steps)

    def run(name: str, step) -> bool:
        try:
            step()
            return True
        except Exception as error:
            if errors is None:
                raise
            errors[name] = f"{type(error).__name__}: {error}"
            del steps[name]
            return False

    for name, step in list(steps.items()):
        for _ in range(args.warmup):
            if not run(name, step):
                break
    samples: dict[str, list[float]] = {name: [] for name in steps}
    deadline = time.perf_counter() + args.budget_s
    for repetition in range(args.max_reps):
        for name, step in list(steps.items()):
            _synchronize(device)
            start = time.perf_counter()
            if run(name, step):
                _synchronize(device)
                samples[name].append(1e3 * (time.perf_counter() - start))
        if repetition + 1 >= args.min_reps and time.perf_counter() > deadline:
            break
    return {name: statistics.median(samples[name]) for name in steps}


def _kl_step(layer: torch.nn.Module) -> None:
    layer.zero_grad(set_to_none=True)
    layer.kl_divergence().backward()


def _format_row(label: str, row: dict[str, float]) -> str:
    reference = row.get("softmax")
    cells = ", ".join(
        f"{variant} {ms:.1f} ms" + (f" ({ms / reference:.2f}x)" if reference else "") for variant, ms in row.items()
    )
    return f"{label}: {cells}"


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def count_ops(step, leaves: bool = False) -> int:
    """The number of operators one call of ``step`` runs, forward and backward: the profiler's ``aten::`` events
    that are not nested in another ``aten::`` event (views included).

    With ``leaves`` instead the innermost operators: of each such event, its innermost ``aten::`` events, less those
    that move no data (views, metadata, allocations, reads of a number). A copy inside a composite operator (``einsum``
    copying an operand, ``reshape`` of a non-contiguous view) counts, a view does not; an operator with nested
    operators counts as those alone (``baddbmm`` as its copy of the bias, not its GEMM; ``sum`` on CPU as the
    ``fill_`` of its output): on CPU a proxy of the kernel launches of the step on a GPU, not a count of its work. It
    is close for the KEP rows (at commit e2ebea5, 163 for ``kep_svgp``'s PyTorch path and 238 for the official-style
    row, whose code the H200 ran at commit 9bc61b0 with 165 and 246 launches), not for every row: CPU and CUDA kernels
    decompose some operators differently (``isfinite`` is four leaves on CPU; softmax's fused attention and the
    floor's linear layers launch other kernels: 34 and 69 leaves against 43 and 41 launches)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    count = 0
    for event in profiler.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            count += _working_leaves(event) if leaves else 1
    return count


#: operators that move no data: views, metadata, allocations, reads of a number, and composites whose work is nested
NO_WORK = frozenset(
    f"aten::{name}"
    for name in (
        "view _unsafe_view reshape _reshape_alias expand expand_as transpose t mT permute select slice unsqueeze "
        "squeeze as_strided alias unbind split chunk diagonal narrow detach lift_fresh empty empty_like "
        "empty_strided new_empty new_empty_strided result_type to view_as movedim unflatten flatten resolve_conj "
        "resolve_neg contiguous is_nonzero item _local_scalar_dense sum_to_size resize_ matmul einsum linalg_vecdot "
        "clone _to_copy zeros zeros_like ones_like new_zeros"
    ).split()
)


def _working_leaves(event) -> int:
    children = [child for child in event.cpu_children if child.name.startswith("aten::")]
    nested = sum(_working_leaves(child) for child in children)
    return nested if nested else int(event.name not in NO_WORK)


#: the ratios printed with every length: (label, numerator, denominator)
RATIOS = (
    ("official-style / official", "kep_svgp_official_style", OFFICIAL),
    ("kep_svgp / official", "kep_svgp", OFFICIAL),
    ("kep_svgp / floor", "kep_svgp", "floor"),
    ("kep_svgp / softmax", "kep_svgp", "softmax"),
    ("official-style / softmax", "kep_svgp_official_style", "softmax"),
)


def _format_ratios(row: dict[str, float]) -> str:
    cells = [f"{label} {row[a] / row[b]:.2f}" for label, a, b in RATIOS if a in row and b in row]
    return "    ratios: " + ", ".join(cells) if cells else ""


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load = _load()
    print(f"threads {args.threads}, load average {load:.2f} on {os.cpu_count()} cores, device {device}", flush=True)
    if load > (os.cpu_count() or 1):
        print("warning: the machine is oversubscribed; timings are noisy (see benchmarks/README.md)", flush=True)
    official = load_official(args.official_path) if args.official_path else None
    results: dict = {
        "config": vars(args),
        "times_ms": {},
        "peak_mb": {},
        "rank_times_ms": {},
        "kl_times_ms": {},
        "load": {},
        "ops": {},
        "leaf_ops": {},
    }
    for length in args.lengths:
        x = torch.randn(args.batch, length, args.embed_dim, device=device)
        steps = {}
        layers = {}
        for variant in args.attentions:
            if variant == "sgpa" and length > args.max_sgpa_length:
                continue
            if variant == "kep_svgp_exact" and length > args.max_exact_length:
                continue
            if variant == "cgpt" and length > args.max_cgpt_length:
                continue
            if variant == "kep_svgp_official_style" and length > args.max_official_style_length:
                continue
            layer = _build(variant, args.embed_dim, args.num_heads, args.rank, device, args.compile, length)
            layers[variant] = layer
            steps[variant] = lambda layer=layer, x=x: _step(layer, x)
        if official is not None:
            official_step = OfficialStep(official, args.embed_dim, args.num_heads, length, args.rank, device)
            steps[OFFICIAL] = lambda step=official_step, x=x: step(x)
        load_before = _load()
        results["times_ms"][length] = _interleaved_medians(steps, args, device)
        results["load"][length] = (load_before, _load())
        if args.memory:
            results["peak_mb"][length] = {v: _peak_memory_mb(layer, x, device) for v, layer in layers.items()}
        print(
            _format_row(
                f"N={length} (load {load_before:.2f}-{_load():.2f}, {args.threads} threads)",
                results["times_ms"][length],
            ),
            flush=True,
        )
        print(_format_ratios(results["times_ms"][length]), flush=True)
        if args.count_ops:
            results["ops"][length] = {variant: count_ops(step) for variant, step in steps.items()}
            results["leaf_ops"][length] = {variant: count_ops(step, leaves=True) for variant, step in steps.items()}
            print(
                "    operators per step: " + ", ".join(f"{v} {n}" for v, n in results["ops"][length].items()),
                flush=True,
            )
            print(
                "    working leaf operators (a proxy of GPU kernel launches): "
                + ", ".join(f"{v} {n}" for v, n in results["leaf_ops"][length].items()),
                flush=True,
            )
    if args.ranks:
        x = torch.randn(args.batch, args.rank_length, args.embed_dim, device=device)
        for rank in args.ranks:
            variants = [v for v in RANK_VARIANTS if v in args.attentions]
            layers = {v: _build(v, args.embed_dim, args.num_heads, rank, device, args.compile) for v in variants}
            steps = {variant: (lambda layer=layer, x=x: _step(layer, x)) for variant, layer in layers.items()}
            results["rank_times_ms"][rank] = _interleaved_medians(steps, args, device)
            kl_steps = {v: (lambda layer=layer: _kl_step(layer)) for v, layer in layers.items() if v.startswith("kep")}
            results["kl_times_ms"][rank] = _interleaved_medians(kl_steps, args, device)
            label = f"s={rank} (N={args.rank_length}, load {_load():.2f}, {args.threads} threads)"
            print(_format_row(label, results["rank_times_ms"][rank]), flush=True)
            kl = ", ".join(f"{v} {ms:.3f} ms" for v, ms in results["kl_times_ms"][rank].items())
            print(f"    KL alone: {kl}", flush=True)
    results["summary"] = _summary(results)
    return results


def _ratio(table: dict, key, numerator: str, denominator: str) -> float | None:
    row = table.get(key, {})
    if numerator in row and denominator in row:
        return row[numerator] / row[denominator]
    return None


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(x)."""
    points = [(math.log(x), math.log(y)) for x, y in points if x > 0 and y > 0]
    if len(points) < 2:
        return None
    return statistics.linear_regression(*zip(*points, strict=True)).slope


def _summary(results: dict) -> dict:
    """The issue's targets as measured ratios and log-log slopes; ``None`` where not measured."""
    times, memory = results["times_ms"], results["peak_mb"]
    summary = {f"kep/softmax@{n}": _ratio(times, n, "kep_svgp", "softmax") for n in (256, 1024, 4096) if n in times}
    for n in (256, 1024, 4096):
        if n in times:
            summary[f"official-style/official@{n}"] = _ratio(times, n, "kep_svgp_official_style", OFFICIAL)
            summary[f"kep/official@{n}"] = _ratio(times, n, "kep_svgp", OFFICIAL)
            summary[f"kep/floor@{n}"] = _ratio(times, n, "kep_svgp", "floor")
    summary["sgpa/kep@1024"] = _ratio(times, 1024, "sgpa", "kep_svgp")
    summary["marginal/joint@1024"] = _ratio(times, 1024, "kep_svgp_marginal", "kep_svgp")
    for variant in ("kep_svgp", "softmax"):
        summary[f"time slope in N ({variant}, N>=256)"] = _slope(
            [(n, row[variant]) for n, row in times.items() if n >= 256 and variant in row]
        )
        summary[f"memory slope in N ({variant})"] = _slope(
            [(n, row[variant]) for n, row in memory.items() if variant in row]
        )
    summary["KL time slope in s (kep_svgp)"] = _slope(
        [(s, row["kep_svgp"]) for s, row in results["kl_times_ms"].items() if "kep_svgp" in row]
    )
    return summary


def plot(results: dict, path: Path) -> None:
    """Log-log figure: time against N, peak memory against N (when measured), time against the rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("times_ms", "sequence length N", "forward+backward time (ms)", "time per training step")]
    if results["peak_mb"]:
        panels.append(("peak_mb", "sequence length N", "peak memory (MiB)", "peak memory of a step"))
    if results["rank_times_ms"]:
        length = results["config"]["rank_length"]
        panels.append(("rank_times_ms", "rank s", "forward+backward time (ms)", f"time against the rank (N={length})"))
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for axis, (key, xlabel, ylabel, title) in zip(axes[0], panels, strict=True):
        table = results[key]
        order = [*VARIANTS, OFFICIAL]
        variants = sorted({v for row in table.values() for v in row}, key=order.index)
        for variant in variants:
            points = sorted((int(x), row[variant]) for x, row in table.items() if variant in row)
            color = f"C{order.index(variant) % 10}"  # one colour per variant in every panel
            axis.plot(*zip(*points, strict=True), marker="o", color=color, label=variant)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    config = results["config"]
    figure.suptitle(
        f"B={config['batch']}, C={config['embed_dim']}, H={config['num_heads']}, s={config['rank']}, "
        f"{config['threads']} threads, {config['device']}"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096], help="sequence lengths N"
    )
    parser.add_argument("--ranks", type=int, nargs="*", default=[5, 10, 20, 50], help="ranks s of the rank sweep")
    parser.add_argument("--rank-length", type=int, default=256, help="N of the rank sweep (default %(default)s)")
    parser.add_argument("--attentions", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--official-path",
        metavar="DIR",
        help="a checkout of https://github.com/yingyichen-cyy/KEP-SVGP (or a folder with its kep_svgp.py): time the "
        "official layer beside gpattn's (imported from there, never copied)",
    )
    parser.add_argument("--count-ops", action="store_true", help="count the operators of one step (profiler)")
    parser.add_argument(
        "--max-official-style-length",
        type=int,
        default=4096,
        help="skip the official-style KEP layer above this N (default %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=16, help="batch size B (default %(default)s)")
    parser.add_argument("--embed-dim", type=int, default=128, help="token width C (default %(default)s)")
    parser.add_argument("--num-heads", type=int, default=4, help="heads (default %(default)s)")
    parser.add_argument("--rank", type=int, default=10, help="KSVD rank s (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--min-reps", type=int, default=3)
    parser.add_argument("--max-reps", type=int, default=15)
    parser.add_argument("--budget-s", type=float, default=20.0, help="time budget per length for the repetitions")
    parser.add_argument("--max-sgpa-length", type=int, default=1024, help="skip SGPA above this N (O(N^2) memory)")
    parser.add_argument("--max-exact-length", type=int, default=1024, help="skip exact-feature KEP above this N")
    parser.add_argument("--max-cgpt-length", type=int, default=512, help="skip CGPT above this N (O(N^3) time)")
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (slower)")
    parser.add_argument("--compile", action="store_true", help="wrap the gpattn layers in torch.compile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/attention_scaling.json")
    args = parser.parse_args(argv)
    if args.official_path:
        try:
            load_official(args.official_path)
        except (FileNotFoundError, ValueError) as error:
            parser.error(str(error))
    results = run(args)
    for key, value in results["summary"].items():
        print(f"{key}: " + ("not measured" if value is None else f"{value:.3f}"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
