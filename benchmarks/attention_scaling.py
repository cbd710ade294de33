"""Forward+backward time and peak memory of every attention layer against sequence length.

Each layer of the registry (plus the marginal-sampling and exact-feature KEP variants) runs a training step,
``(layer(x).sum() + layer.kl_divergence()).backward()``, on a batch ``x`` of shape ``(B, N, C)``. Repetitions are
interleaved across layers (layer 1, layer 2, ..., layer 1, ...) and the median is reported, so that drifts in the
machine's load hit every layer alike; ratios against softmax attention come from the same run. With ``--memory``,
the peak of live tensors during one step is measured in a separate pass: from the PyTorch profiler's allocation
events on CPU, ``torch.cuda.max_memory_allocated`` on GPU.

Run ``python benchmarks/attention_scaling.py --help`` for the options; results go to
``benchmarks/results/attention_scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpattn.attention import build_attention

VARIANTS = {
    "softmax": ("softmax", {}),
    "kep_svgp": ("kep_svgp", {}),
    "kep_svgp_marginal": ("kep_svgp", {"sampling": "marginal"}),
    "kep_svgp_exact": ("kep_svgp", {"features": "exact"}),
    "kep_svgp_sym": ("kep_svgp_sym", {}),
    "primal": ("primal", {}),
    "svgp": ("svgp", {}),
    "sgpa": ("sgpa", {}),
}
RANKED = {"kep_svgp", "kep_svgp_sym", "primal"}


def _build(variant: str, embed_dim: int, num_heads: int, rank: int, device: torch.device) -> torch.nn.Module:
    name, kwargs = VARIANTS[variant]
    if name in RANKED:
        kwargs = {"rank": rank, **kwargs}
    return build_attention(name, embed_dim, num_heads, **kwargs).to(device).train()


def _step(layer: torch.nn.Module, x: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    loss = layer(x).sum() + layer.kl_divergence()
    loss.backward()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(layer: torch.nn.Module, x: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        _step(layer, x)
        _synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
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


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    results: dict = {"config": vars(args), "times_ms": {}, "peak_mb": {}}
    variants = args.attentions
    for length in args.lengths:
        x = torch.randn(args.batch, length, args.embed_dim, device=device)
        layers = {}
        for variant in variants:
            if variant == "sgpa" and length > args.max_sgpa_length:
                continue
            if variant == "kep_svgp_exact" and length > args.max_exact_length:
                continue
            layers[variant] = _build(variant, args.embed_dim, args.num_heads, args.rank, device)
        for layer in layers.values():
            for _ in range(args.warmup):
                _step(layer, x)
        samples: dict[str, list[float]] = {variant: [] for variant in layers}
        deadline = time.perf_counter() + args.budget_s
        for repetition in range(args.max_reps):
            for variant, layer in layers.items():
                _synchronize(device)
                start = time.perf_counter()
                _step(layer, x)
                _synchronize(device)
                samples[variant].append(1e3 * (time.perf_counter() - start))
            if repetition + 1 >= args.min_reps and time.perf_counter() > deadline:
                break
        results["times_ms"][length] = {variant: statistics.median(times) for variant, times in samples.items()}
        if args.memory:
            results["peak_mb"][length] = {v: _peak_memory_mb(layer, x, device) for v, layer in layers.items()}
        row = results["times_ms"][length]
        reference = row.get("softmax")
        cells = ", ".join(
            f"{variant} {ms:.1f} ms" + (f" ({ms / reference:.2f}x)" if reference else "") for variant, ms in row.items()
        )
        print(f"N={length}: {cells}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="sequence lengths N")
    parser.add_argument("--attentions", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
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
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (slower)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/attention_scaling.json")
    args = parser.parse_args()
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
