"""The benchmark's own logic (not its timings): ``--official-path`` loading and its errors, the floor's products, the
operator count, and ``torch.compile`` of a layer against eager (with its fallback)."""

from __future__ import annotations

import pytest
import torch
from torch.torch_version import TorchVersion

from gpattn.attention import build_attention


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("attention_scaling", "attention_scaling_under_test")


def test_missing_official_path_is_a_clear_error(bench, tmp_path, capsys):
    missing = tmp_path / "no-such-checkout"
    with pytest.raises(FileNotFoundError, match="--official-path .*no-such-checkout.* is not a directory"):
        bench.load_official(missing)
    with pytest.raises(SystemExit) as exit_info:  # the command line reports it as a usage error, before any timing
        bench.main(["--official-path", str(missing), "--lengths", "8", "--ranks"])
    assert exit_info.value.code == 2
    assert "no-such-checkout" in capsys.readouterr().err


def test_official_path_without_the_layer_is_a_clear_error(bench, tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no official layer: looked for kep_svgp.py"):
        bench.load_official(tmp_path)
    (tmp_path / "kep_svgp.py").write_text("VALUE = 1\n")
    with pytest.raises(ValueError, match="defines no KEP_SVGPAttention"):
        bench.load_official(tmp_path)


def test_official_layer_is_imported_from_the_checkout(bench, tmp_path):
    # a stand-in with the official interface (no official code here): found under CIFAR/model/ and stepped
    folder = tmp_path / "CIFAR" / "model"
    folder.mkdir(parents=True)
    (folder / "kep_svgp.py").write_text(
        "import torch\n"
        "class KEP_SVGPAttention(torch.nn.Module):\n"
        "    def __init__(self, dim, num_heads, embed_len, low_rank):\n"
        "        super().__init__()\n"
        "        self.we = torch.nn.Parameter(torch.ones(num_heads, embed_len, low_rank))\n"
        "        self.wr = torch.nn.Parameter(torch.ones(num_heads, embed_len, low_rank))\n"
        "        self.weight = torch.nn.Parameter(torch.ones(dim, low_rank))\n"
        "    def forward(self, x):\n"
        "        e = (x @ self.weight).unsqueeze(1)\n"
        "        eye = torch.eye(self.weight.shape[1])\n"
        "        return x, [e, e, self.we, self.wr], eye, (self.weight ** 2).sum()\n"
    )
    layer_class = bench.load_official(tmp_path)
    assert layer_class.__name__ == "KEP_SVGPAttention"
    step = bench.OfficialStep(layer_class, 4, 2, 3, 2, torch.device("cpu"))
    loss = step(torch.ones(1, 3, 4))
    # out.sum() = 12, kl = 8; e = r = 4 per entry: 0.5 mean ||e||^2 = 16 per side; tr(mean_h W_e^T W_r) = 2 * 3
    assert loss.item() == 12 + 8 + (16 + 16 - 6) ** 2
    assert step.layer.weight.grad is not None and torch.isfinite(step.layer.weight.grad).all()


def test_floor_computes_the_kep_products(bench):
    torch.manual_seed(0)
    floor = bench.Floor(8, 2, 3).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    queries = torch.einsum("hpc,bnc->bhpn", floor.query.unflatten(0, (2, 4)), x)
    keys = torch.einsum("hpc,bnc->bhpn", floor.key.unflatten(0, (2, 4)), x)
    left_values = torch.einsum("hsc,bnc->bhsn", floor.left_map.unflatten(0, (2, 3)), x)
    right_values = torch.einsum("hsc,bnc->bhsn", floor.right_map.unflatten(0, (2, 3)), x)
    left = torch.einsum("bhsm,bhpm,bhpn->bhns", left_values, keys, queries)  # e = Phi_q W_e, W_e = Phi_k^T a_e
    right = torch.einsum("bhsn,bhpn,bhpm->bhms", right_values, queries, keys)
    scores = torch.cat([left, right], dim=1).permute(0, 2, 1, 3).flatten(2)  # (B, N, 2 H s), branch-major
    expected = scores @ floor.coefficients + floor.bias
    torch.testing.assert_close(floor(x), expected)


def test_count_ops_counts_top_level_operators(bench):
    x = torch.ones(3)
    assert bench.count_ops(lambda: torch.add(x, 1)) == 1
    assert bench.count_ops(lambda: (x * 2).sum()) == 2  # sum's internals are nested in it


def test_count_ops_with_leaves_counts_the_operators_that_move_data(bench):
    x = torch.ones(3, 4)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    assert bench.count_ops(lambda: x.view(4, 3).mT, leaves=True) == 0  # views
    assert bench.count_ops(lambda: torch.add(x, 1), leaves=True) == 1
    assert bench.count_ops(lambda: x.mT.contiguous(), leaves=True) == 1  # the copy inside contiguous
    assert bench.count_ops(lambda: x.mT.reshape(12), leaves=True) == 1  # a reshape that copies
    assert bench.count_ops(lambda: torch.matmul(a, b), leaves=True) == 1  # the bmm inside matmul
    # einsum sums its summed dimensions in the alphabetical order of their letters: out of memory order it copies
    # both operands before its bmm, in order it runs the bmm alone
    scaled, coefficients = torch.randn(4, 8, 2, 3, 5), torch.randn(4, 2, 3, 5, 16)
    assert bench.count_ops(lambda: torch.einsum("hdijk,hijkc->hdc", scaled, coefficients), leaves=True) == 1
    assert bench.count_ops(lambda: torch.einsum("hdqsb,hqsbc->hdc", scaled, coefficients), leaves=True) == 3


@pytest.mark.slow  # a cold torch.compile of even a tiny layer takes about a minute on 2 cores
def test_compiled_layer_equals_eager_and_compiles_once(bench):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    layer = build_attention("kep_svgp", 16, 2).train()
    x = torch.randn(2, 8, 16)
    torch._dynamo.reset()
    counters.clear()
    compiled = bench.compiled_or_eager(layer)
    assert compiled is not layer  # compiled, not the fallback
    for _ in range(3):  # training steps: the KSVD term is stored every step; no recompilation after the first
        layer.zero_grad(set_to_none=True)
        loss = compiled(x).sum()
        for term in layer.added_loss_terms():
            loss = loss + term.loss()
        loss.backward()
    if TorchVersion(torch.__version__) >= (2, 11):  # one graph; older dynamo breaks it (4 graphs on torch 2.4)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    layer.eval()  # the predictive mean: deterministic, so compiled and eager must agree, output and gradients
    outputs, gradients = {}, {}
    for name, module in (("compiled", compiled), ("eager", layer)):
        layer.zero_grad(set_to_none=True)
        outputs[name] = module(x)
        outputs[name].square().sum().backward()
        gradients[name] = {key: value.grad.clone() for key, value in layer.named_parameters() if value.grad is not None}
    torch.testing.assert_close(outputs["compiled"], outputs["eager"], rtol=1e-5, atol=1e-5)
    assert gradients["compiled"].keys() == gradients["eager"].keys() and gradients["eager"]
    for key, value in gradients["eager"].items():
        torch.testing.assert_close(gradients["compiled"][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_compile_falls_back_to_eager(bench, monkeypatch, capsys):
    layer = build_attention("kep_svgp", 16, 2)

    def failing_compile(module, *args, **kwargs):
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(torch, "compile", failing_compile)
    assert bench.compiled_or_eager(layer) is layer
    assert (
        "torch.compile failed for KEPSVGPAttention (RuntimeError: no C compiler); timing eager"
        in capsys.readouterr().out
    )


def test_a_step_that_fails_while_timed_is_left_out_and_recorded(bench):
    """With ``errors``, a step that raises in a later repetition (out of memory on a GPU) is left out and its error
    recorded, the other steps keep their medians; without it the error propagates."""
    import argparse

    calls = {"good": 0, "bad": 0}

    def good():
        calls["good"] += 1

    def bad():
        calls["bad"] += 1
        if calls["bad"] == 3:
            raise RuntimeError("CUDA out of memory")

    args = argparse.Namespace(warmup=1, min_reps=4, max_reps=4, budget_s=0.0)
    errors: dict = {}
    medians = bench._interleaved_medians({"good": good, "bad": bad}, args, torch.device("cpu"), errors=errors)
    assert set(medians) == {"good"} and medians["good"] > 0
    assert errors == {"bad": "RuntimeError: CUDA out of memory"} and calls == {"good": 5, "bad": 3}
    calls.update(good=0, bad=0)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        bench._interleaved_medians({"good": good, "bad": bad}, args, torch.device("cpu"))


def test_the_peak_memory_on_cuda_counts_what_the_step_allocates(bench, monkeypatch):
    """On CUDA the peak is the allocator's peak during the step less what was allocated before it (the input, the
    layers' parameters and gradients), as on the CPU: torch.cuda's counters stand in here (120 MiB before the step,
    a peak of 200 MiB during it)."""
    mib = 2**20
    state = {"allocated": 120 * mib, "peak": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"])
    )
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    layer = bench.Floor(8, 2, 3)
    original = layer.forward

    def forward(x):
        state["peak"] = 200 * mib  # the step's own tensors on top of the 120 MiB
        return original(x)

    monkeypatch.setattr(layer, "forward", forward)
    assert bench._peak_memory_mb(layer, torch.ones(1, 4, 8), torch.device("cuda")) == 80.0
