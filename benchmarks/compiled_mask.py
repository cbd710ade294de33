"""A compiled training step with a padding mask against the same step in eager mode (issue 25).

Each row is a registry attention in training mode, stepped on ``(layer(x, mask) * mask).square().mean() + KL + added
loss terms`` for a batch ``x`` of shape ``(B, N, C)`` whose sequence ``b`` keeps its first ``N - b * N // (2 B)``
tokens (from all of them down to about half). For every row the script reports:

* ``graphs`` / ``breaks``: what ``torch._dynamo.explain`` finds in the loss (the compiled part; its backward pass
  follows the graphs of the forward pass). A data-dependent branch in the layer (a check of the mask's values)
  splits it into several graphs, each with its own guards and Python in between (with ``--mode reduce-overhead``,
  each graph a CUDA graph of its own);
* the median time of the eager and of the compiled step (``torch.compile`` with ``--backend``, repetitions
  interleaved) and their ratio, with the load average before and after.

Run ``python benchmarks/compiled_mask.py --help`` for the options; results go to
``benchmarks/results/compiled_mask.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")
import torch  # noqa: E402

from gpattn.attention import attention_names, build_attention  # noqa: E402

SCALING_SCRIPT = Path(__file__).resolve().with_name("attention_scaling.py")
ROWS = ("softmax", "kep_svgp", "kep_svgp_paper")


def _scaling():
    spec = importlib.util.spec_from_file_location("attention_scaling_for_compiled_mask", SCALING_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def padding_mask(batch: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(B, N)``: sequence ``b`` keeps its first ``N - b * N // (2 B)`` tokens (all of them down to about half)."""
    kept = length - torch.arange(batch, device=device) * length // (2 * batch)
    return torch.arange(length, device=device) < kept[:, None]


def build(name: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    options = {"max_len": args.length} if name == "kep_svgp_paper" else {}
    if name != "softmax":
        options["num_inducing"] = args.rank
    return build_attention(name, args.embed_dim, args.num_heads, **options).to(device).train()


def training_loss(layer: torch.nn.Module):
    """The loss of one row's training step, ``loss(x, mask)`` (what is compiled; the backward pass runs outside)."""

    def loss(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        value = (layer(x, mask=mask) * mask[..., None]).square().mean() + layer.kl_divergence()
        for term in layer.added_loss_terms():  # the KSVD penalty of this call
            value = value + term.loss()
        return value

    return loss


def timed_step(layer: torch.nn.Module, loss, x: torch.Tensor, mask: torch.Tensor):
    """One training step, forward and backward, of ``loss`` (eager or compiled)."""

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        loss(x, mask).backward()

    return step


def run(args: argparse.Namespace) -> dict:
    scaling = _scaling()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    x = torch.randn(args.batch, args.length, args.embed_dim, device=device)
    mask = padding_mask(args.batch, args.length, device)
    size = f"B={args.batch}, N={args.length}, C={args.embed_dim}, H={args.num_heads}, s={args.rank}"
    compiler = f"backend {args.backend}" + (f", mode {args.mode}" if args.mode else "")
    print(f"{size}, {args.threads} thread(s), {device}, {compiler}; load {scaling._load():.2f}", flush=True)
    results = {"settings": vars(args), "torch": torch.__version__, "load_before": scaling._load(), "rows": {}}
    for name in args.attentions:
        layer = build(name, args, device)
        loss = training_loss(layer)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(loss)(x, mask)
        torch._dynamo.reset()
        compiled = torch.compile(loss, backend=args.backend, mode=args.mode)
        steps = {"eager": timed_step(layer, loss, x, mask), "compiled": timed_step(layer, compiled, x, mask)}
        medians = scaling._interleaved_medians(steps, args, device)
        row = {
            "graphs": explained.graph_count,
            "breaks": explained.graph_break_count,
            "eager_ms": medians["eager"],
            "compiled_ms": medians["compiled"],
            "compiled_over_eager": medians["compiled"] / medians["eager"],
        }
        results["rows"][name] = row
        print(
            f"{name}: {row['graphs']} graph(s), {row['breaks']} break(s); eager {row['eager_ms']:.2f} ms, compiled "
            f"{row['compiled_ms']:.2f} ms ({row['compiled_over_eager']:.2f}x); load {scaling._load():.2f}",
            flush=True,
        )
    results["load_after"] = scaling._load()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attentions", nargs="+", default=list(ROWS), choices=attention_names(), metavar="NAME")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--embed-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--rank", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (default inductor)")
    parser.add_argument("--mode", default=None, help="torch.compile's mode, e.g. reduce-overhead (CUDA graphs)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each (the first compiles)")
    parser.add_argument("--min-reps", type=int, default=20)
    parser.add_argument("--max-reps", type=int, default=200)
    parser.add_argument("--budget-s", type=float, default=10.0, help="time budget per row for the repetitions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled_mask.json"))
    args = parser.parse_args(argv)
    if args.batch < 1 or args.length < 1:
        parser.error("--batch and --length must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
