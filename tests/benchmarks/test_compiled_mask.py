"""The compiled-mask benchmark's own logic (not its timings): the mask it pads with, and one tiny run whose record
holds what it printed: one graph per row (from torch 2.9 the layers check their masks without a data-dependent branch
while compiling) and the ratio of the two medians."""

from __future__ import annotations

import json

import pytest
import torch
from torch.torch_version import TorchVersion

from gpattn._torch_compat import COMPILES_ASSERTS, TRACES_FUNCTIONS


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("compiled_mask", "compiled_mask_under_test")


def test_every_sequence_keeps_a_prefix_of_at_least_half_its_tokens(bench):
    mask = bench.padding_mask(4, 16)
    assert mask.sum(-1).tolist() == [16, 14, 12, 10]  # N - b * N // (2 B)
    assert torch.equal(mask, torch.arange(16) < mask.sum(-1, keepdim=True))  # prefixes
    assert bench.padding_mask(40, 4).sum(-1).unique().tolist() == [3, 4]  # at least half, as many batches as asked
    assert bench.padding_mask(1, 1).tolist() == [[True]]


def test_a_tiny_run_records_one_graph_per_row_and_the_ratio_it_printed(bench, tmp_path, capsys):
    out = tmp_path / "mask.json"
    argv = ["--batch", "3", "--length", "8", "--embed-dim", "16", "--num-heads", "2", "--rank", "2"]
    argv += ["--backend", "aot_eager", "--warmup", "1", "--min-reps", "2", "--max-reps", "3", "--budget-s", "0"]
    results = bench.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results, default=str))
    assert list(results["rows"]) == ["softmax", "kep_svgp", "kep_svgp_paper"]
    printed = capsys.readouterr().out
    for name, row in results["rows"].items():
        assert row["eager_ms"] > 0 and row["compiled_ms"] > 0
        assert row["compiled_over_eager"] == pytest.approx(row["compiled_ms"] / row["eager_ms"])
        # before torch 2.4 the autograd functions run eagerly (a graph break each), before 2.9 the mask check
        # breaks, and 2.9's dynamo breaks in gpytorch's added-loss-term walk (mask or not)
        if TRACES_FUNCTIONS and COMPILES_ASSERTS and TorchVersion(torch.__version__) >= (2, 11):
            assert (row["graphs"], row["breaks"]) == (1, 0), name
        assert f"{name}: {row['graphs']} graph(s)" in printed and f"({row['compiled_over_eager']:.2f}x)" in printed
    assert "load" in printed.splitlines()[0]
