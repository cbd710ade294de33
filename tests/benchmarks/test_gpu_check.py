"""benchmarks/gpu_check.py end to end on CPU at tiny sizes (``--device cpu --smoke``): every section runs, the JSON
holds the environment, the float64 equivalence of every layer, the counts, the scaling table with its ratios and
the MNIST-1D runs with the identity of their records. What it measures on a GPU is not tested here (CI has none)."""

from __future__ import annotations

import contextlib
import json

import pytest
from torch.torch_version import TorchVersion

from gpattn._torch_compat import TRACES_FUNCTIONS


@pytest.fixture(scope="module")
def check(load_benchmark):
    return load_benchmark("gpu_check", "gpu_check_under_test")


def test_smoke_run_on_cpu(check, tmp_path, capsys, monkeypatch):
    from gpattn.fused import triton_scores

    monkeypatch.setattr(triton_scores, "TRITON_MAX_TOKENS", 16)  # N = 32 is then "long": a forced-kernels row

    entered = []

    @contextlib.contextmanager
    def failing():  # a row that cannot run: recorded, and the others of its length still timed
        entered.append(1)
        if len(entered) != 2:  # the 1st: the split check; the 2nd: the row's first step at N = 32, then its warm-up
            raise RuntimeError("the kernels do not compile here")  # (an error while timed, as out of memory)
        yield

    monkeypatch.setattr(check, "triton_kernels", failing)
    out = tmp_path / "gpu_check.json"
    check.main(["--device", "cpu", "--smoke", "--out", str(out)])
    results = json.loads(out.read_text())
    sections = {"config", "environment", "equivalence", "counts", "scaling", "kernels", "train_step", "mnist1d"}
    sections.add("seconds")
    assert sections <= results.keys()
    assert results["environment"]["torch"] and results["environment"]["device"] == "cpu"
    equivalence = results["equivalence"]
    compiled = [name for name in equivalence if name.endswith("_compiled_vs_eager")]
    assert set(compiled) == {f"{name}_compiled_vs_eager" for name in check.COMPILED_CHECK_ROWS}
    for name in compiled:  # compiled against eager: the same numbers up to float64 rounding of reordered sums
        assert equivalence[name]["ok"] and equivalence[name]["float64_difference"] < 1e-12, (name, equivalence[name])
    others = {"kep_svgp_triton_vs_pytorch", "kep_svgp_split_triton_vs_pytorch", *compiled}
    layers = [name for name in equivalence if name not in others and "bfloat16" not in name]
    assert {"kep_svgp", "softmax", "sgpa", "kep_svgp_exact", "kep_svgp_official_style"} <= set(layers)
    for name in layers:  # CPU against CPU: identical, and finite float32 and bfloat16 training steps
        assert equivalence[name]["ok"] and equivalence[name]["float64_difference"] == 0.0, (name, equivalence[name])
        steps = equivalence[name]["steps_finite"]
        assert (steps["float32"], steps["bfloat16"]) == (True, True), name
        # a bfloat16 layer without autocast: finite, or refused by the layers whose GPyTorch strategy needs float32
        refused = name in ("svgp",)
        assert steps["bfloat16_layer"] is True or (refused and steps["bfloat16_layer"].startswith("refused: ")), name
    assert equivalence["kep_svgp_triton_vs_pytorch"]["ok"]
    # the split kernels forced: the failing stand-in above is recorded, the check goes on
    assert equivalence["kep_svgp_split_triton_vs_pytorch"] == {"error": "RuntimeError: the kernels do not compile here"}
    for name in ("softmax", "kep_svgp"):  # bfloat16 autocast against float32: small, but not zero (it did cast)
        error = equivalence[f"{name}_bfloat16_error"]
        assert error["ok"] and 0.0 < error["norm"] < 2e-2 and 0.0 < error["largest_entry"] < 2e-2
    if TRACES_FUNCTIONS:  # counted on torch 2.4+ (torch 2.1 records 229)
        assert results["counts"]["kep_svgp"]["operators"] <= 201  # half of the 402 before issue 25
    table = results["scaling"]["table"]
    assert set(table) == {"16", "32"} and "kep_svgp_bf16" in table["16"]["times_ms"]
    assert table["32"]["row_errors"] == {"kep_svgp_triton": "RuntimeError: the kernels do not compile here"}
    assert len(entered) == 3  # the first step ran, the warm-up failed: the row left out of the timed ones
    assert "row_errors" not in table["16"]
    assert {"kep_svgp", "kep_svgp_pytorch", "floor"} <= table["32"]["times_ms"].keys()
    assert "kep_svgp / floor" in results["scaling"]["ratios"]["32"]
    assert "kep_svgp / floor" in results["scaling"]["ratios"]["16"]
    kernels = results["kernels"]  # on a CPU without compiled rows: the eager steps' operators
    assert kernels["length"] == 16 and set(kernels["rows"]) == {"floor_eager", "kep_svgp_eager"}
    for entry in kernels["rows"].values():
        top = [kernel["us_per_step"] for kernel in entry["top"]]
        assert len(top) == 12 and top == sorted(top, reverse=True) and sum(top) <= entry["busy_us_per_step"]
    assert kernels["rows"]["kep_svgp_eager"]["kernels_per_step"] > kernels["rows"]["floor_eager"]["kernels_per_step"]
    steps = results["train_step"]["rows"]  # at smoke size: the eager step on the CPU
    assert set(steps) == {"kep_svgp"} and set(steps["kep_svgp"]) == {"cpu"}
    assert steps["kep_svgp"]["cpu"]["steps"] == 3 and steps["kep_svgp"]["cpu"]["step_ms"] > 0
    mnist1d = results["mnist1d"]
    assert mnist1d["runs"]["kep_svgp"]["cpu"]["seconds"] > 0
    assert mnist1d["jobs_identity"]["identical_records"] is True
    printed = capsys.readouterr().out
    assert "jobs identity" in printed and "N=32: kep_svgp_triton did not run (RuntimeError" in printed


@pytest.mark.parametrize("name", ["kep_svgp", "floor"])
def test_the_compiled_loss_is_the_eager_step(check, name):
    """CompiledLoss compiles the layer's forward pass with its KL and KSVD penalty: one step through it (aot_eager:
    dynamo and AOT autograd without kernel generation) gives the eager step's gradients, float64 (the floor's class
    lives in the benchmark module that gpu_check loads from its file, which dynamo must be able to import); the
    table's compiled rows name both compiled forms."""
    import argparse

    import torch

    torch.manual_seed(0)
    layer = check.BENCH._build(name, 16, 2, 3, torch.device("cpu"), length=8).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)

    def step(module):
        torch.manual_seed(1)  # the same draws of the layer's samples
        check.BENCH._step(module, x)
        return [p.grad.clone() for p in layer.parameters() if p.grad is not None]

    eager = step(layer)
    torch._dynamo.reset()
    compiled = check.CompiledLoss(layer, backend="aot_eager")
    assert list(compiled.parameters()) == list(layer.parameters())
    got = step(compiled)
    assert len(got) == len(eager) > (5 if name == "kep_svgp" else 1)
    for want, have in zip(eager, got, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-10, atol=1e-12)
    if TorchVersion(torch.__version__) >= (2, 11):  # one graph: the KL and the penalty inside (2.9 breaks in gpytorch)
        explained = torch._dynamo.explain(check.BENCH.step_loss)(layer, x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    args = argparse.Namespace(embed_dim=16, num_heads=2, rank=3, max_sgpa_length=8)
    names = [row for row, _, _ in check._rows(torch.device("cpu"), args, 8, compiled=True)]
    assert {"floor_compiled", "floor_compiled_loss", "kep_svgp_compiled", "kep_svgp_compiled_loss"} <= set(names)


def test_the_kernels_section_with_a_compiled_loss(check, monkeypatch):
    """With compiled rows the kernels section profiles the compiled loss beside the eager step (aot_eager here, for
    speed: the same graph without generated kernels), and a row past the deadline is recorded as skipped."""
    import argparse
    import time

    import torch

    compiled = check.CompiledLoss
    monkeypatch.setattr(check, "CompiledLoss", lambda layer, mode: compiled(layer, backend="aot_eager"))
    args = argparse.Namespace(
        compile_lengths=[8], lengths=[16], batch=2, embed_dim=16, num_heads=2, rank=3, max_sgpa_length=8
    )
    torch._dynamo.reset()
    results = check.kernels(torch.device("cpu"), args, time.perf_counter() + 600)
    assert results["length"] == 8
    assert set(results["rows"]) == {"floor_eager", "floor_compiled_loss", "kep_svgp_eager", "kep_svgp_compiled_loss"}
    for row, entry in results["rows"].items():
        assert entry["busy_us_per_step"] > 0 and entry["top"], row
    late = check.kernels(torch.device("cpu"), args, time.perf_counter() - 1)
    assert set(late["rows"].values()) == {"skipped: time budget"}


def test_the_train_step_section_times_the_compiled_model(check, monkeypatch):
    """The compiled variant compiles the comparison's model as ``gpattn compare --compile`` does (dynamo's eager
    backend here, for speed), stops after its timed steps, and is compared with the eager step; past the deadline
    every variant is recorded as skipped."""
    import argparse
    import time

    import torch

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda function, **options: real_compile(function, backend="eager"))
    args = argparse.Namespace(smoke=False, train_step_rows=["kep_svgp"], train_step_warmup=2, train_step_steps=3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    entry = check.train_step(torch.device("cpu"), args, time.perf_counter() + 600)["rows"]["kep_svgp"]
    assert set(entry) == {"cpu", "cpu compiled", "compiled / eager"}
    for variant in ("cpu", "cpu compiled"):
        assert entry[variant]["steps"] == 3 and entry[variant]["batch_size"] == 64 and entry[variant]["step_ms"] > 0
    assert entry["compiled / eager"] == entry["cpu compiled"]["step_ms"] / entry["cpu"]["step_ms"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled variant compiled
    late = check.train_step(torch.device("cpu"), args, time.perf_counter() - 1)["rows"]["kep_svgp"]
    assert late == {"cpu": "skipped: time budget", "cpu compiled": "skipped: time budget"}


SPLIT_SCRIPT = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("gpu_check_split", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
check.triton_scores.TOKENS_PER_PROGRAM = 128  # 327 tokens: chunks of 128, 128 and 71 (its last tile partial)
print(json.dumps(check._triton_against_pytorch(torch.device("cpu"), smoke=True, split=True)))
"""


def test_the_split_check_under_the_interpreter(tmp_path):
    """The split check's own path on the CPU: under Triton's interpreter (a fresh process) with TOKENS_PER_PROGRAM
    128, the forced kernels run (observed: calls of the forward kernel) at 327 tokens, three programs per sequence and
    head, and agree with the PyTorch path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    from gpattn.fused import triton_scores

    if not triton_scores.triton_available():
        pytest.skip(f"Triton {triton.__version__} is older than the kernels' {triton_scores.TRITON_MINIMUM}")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    environment.pop(triton_scores.TRITON_VARIABLE, None)
    result = subprocess.run(
        [sys.executable, "-c", SPLIT_SCRIPT, str(script)], env=environment, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0 and "0-dimensional arrays can be converted" in result.stderr:
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run kernel loops with this NumPy")
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["kernels_ran"] and found["ok"], found
    assert found["tokens"] == 327 and found["programs_per_head"] == 3
    assert 0.0 < found["relative_difference"] < 1e-4  # float32 sums in another order: close, not equal


@pytest.mark.parametrize("name", ["softmax", "floor", "kep_svgp"])
def test_the_graphed_step_check_with_the_cpu_stand_in(check, name):
    """The CUDA-graph check of the equivalence section, run on the CPU with the training loop's stand-in graph (which
    replays by running the step again into the captured tensors): the graphed step equals the eager one in eval mode on
    two inputs, its gradients stay in the captured tensors, and a stochastic layer's training replays differ."""
    import torch

    from gpattn.training.graphs import EmulatedGraph

    result = check._graphed_against_eager(name, torch.device("cpu"), smoke=True, graph=EmulatedGraph)
    assert result["ok"], result
    assert result["eval_difference_0"] <= 1e-6 and result["eval_difference_1"] <= 1e-6
    assert result["train_replays_differ"] is (True if name == "kep_svgp" else None)


@pytest.mark.parametrize("name", ["softmax", "kep_svgp"])
def test_the_bfloat16_graphed_step_check_with_the_cpu_stand_in(check, name):
    """The bfloat16 rows of the CUDA-graph check on the CPU stand-in, under the CPU's bfloat16 autocast: the graphed
    step equals the eager autocast step (forward pass under autocast, backward pass outside) in eval mode."""
    import torch

    from gpattn.training.graphs import EmulatedGraph

    result = check._graphed_against_eager(name, torch.device("cpu"), True, graph=EmulatedGraph, bfloat16=True)
    assert result["ok"], result
    assert result["eval_difference_0"] <= 1e-6 and result["eval_difference_1"] <= 1e-6
    assert result["train_replays_differ"] is (True if name == "kep_svgp" else None)


@pytest.mark.parametrize("name", ["softmax", "kep_svgp"])
def test_a_graphed_step_runs_its_forward_pass_in_its_context(check, name):
    """GraphedStep's context reaches the captured forward pass: under bfloat16 autocast the graphed loss is the eager
    autocast loss to the last bit, and not the float32 loss."""
    import copy

    import torch

    from gpattn.training.graphs import EmulatedGraph

    torch.manual_seed(0)
    layer = check.BENCH._build(name, 16, 2, 4, torch.device("cpu"), length=16).eval()
    eager = copy.deepcopy(layer)
    x = torch.randn(2, 16, 16)
    autocast = check._autocast(torch.device("cpu"))
    graphed = check.GraphedStep(layer, x, graph=EmulatedGraph, context=autocast)
    with torch.no_grad():
        with autocast():
            low = check.BENCH.step_loss(eager, x)
        full = check.BENCH.step_loss(eager, x)
    assert graphed(x).item() == low.item()
    assert abs(low.item() - full.item()) > 1e-6 * abs(full.item())  # bfloat16 is visible in the loss


def test_the_bfloat16_graphed_rows_come_with_the_autocast_rows_on_cuda_only(check):
    import torch

    cuda = torch.device("cuda")
    rows = list(check._graphed_rows(cuda, ("softmax", "floor", "kep_svgp")))
    assert [(row, name) for row, name, _ in rows] == [
        ("softmax_graphed", "softmax"), ("softmax_bf16_graphed", "softmax"), ("floor_graphed", "floor"),
        ("kep_svgp_graphed", "kep_svgp"), ("kep_svgp_bf16_graphed", "kep_svgp"),
    ]  # fmt: skip
    for row, _, bfloat16 in rows:  # float32 rows without a context, the bf16 rows under bfloat16 autocast on CUDA
        context = check._forward_context(cuda, bfloat16)
        if "bf16" in row:
            entered = context()
            assert isinstance(entered, torch.autocast), row
            assert (entered.device, entered.fast_dtype) == ("cuda", torch.bfloat16), row
        else:
            assert context is contextlib.nullcontext, row
    assert list(check._graphed_rows(torch.device("cpu"), ("softmax", "kep_svgp"))) == []


def test_the_captured_forward_check_with_the_cpu_stand_in(check):
    """The evaluation-graph check of the equivalence section with the CPU's stand-in graph: the mean equals the eager
    pass (before and after the parameters change in place), the Monte Carlo passes differ, every capture was taken."""
    import torch

    from gpattn.training.graphs import EmulatedGraph

    result = check._captured_forward_against_eager(torch.device("cpu"), graph=EmulatedGraph)
    assert result["ok"], result
    assert result["graphs"] == 2 and result["warnings"] == []  # the mean's signature and the sampled one
    assert max(result[key] for key in result if key.startswith("mean_difference")) == 0.0


def _stub_sections(check, monkeypatch, calls: list, **replacements) -> None:
    """Every section of ``check.main`` replaced by a stub that records its name (``replacements``: other stubs)."""

    def stub(name):
        def section(*arguments, into=None):
            calls.append(name)
            return {"ran": name} if into is None else {**into, "ran": name}

        return section

    for name in ("equivalence", "counts", "scaling", "train_step", "kernels", "mnist1d"):
        monkeypatch.setattr(check, name, replacements.get(name, stub(name)))


def test_the_results_are_written_after_every_section_and_on_sigterm(check, tmp_path, monkeypatch):
    """A run stopped by SIGTERM (a job's time limit) writes the sections done so far, and what the stopped section had
    measured; each section finds the earlier ones already on disk (a SIGKILL loses at most the section under way)."""
    import signal

    out = tmp_path / "gpu_check.json"
    calls: list = []

    def counts(*arguments):
        calls.append("counts")
        assert json.loads(out.read_text())["equivalence"] == {"ran": "equivalence"}  # on disk before the next
        return {"ran": "counts"}

    def scaling(device, args, deadline, into=None):
        calls.append("scaling")
        into["table"] = {16: {"times_ms": {"softmax": 1.5}}}  # one length measured, then the job's limit
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), handler  # the default handler would end the process, writing nothing
        handler(signal.SIGTERM, None)

    _stub_sections(check, monkeypatch, calls, counts=counts, scaling=scaling)
    results = check.main(["--device", "cpu", "--smoke", "--out", str(out)])
    assert calls == ["equivalence", "counts", "scaling"]  # the sections after the stop do not run
    written = json.loads(out.read_text())
    assert written["counts"] == {"ran": "counts"} and written["stopped"].startswith("Stopped: signal")
    assert written["scaling"]["table"] == {"16": {"times_ms": {"softmax": 1.5}}}
    assert written["scaling"]["stopped"].startswith("Stopped") and "train_step" not in written
    assert results["scaling"]["table"][16] == {"times_ms": {"softmax": 1.5}}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the caller's handler restored


def test_a_failing_section_keeps_what_it_measured(check, tmp_path, monkeypatch, capsys):
    """A timed section that raises keeps the rows it measured beside its error, and the summary names the error
    instead of counting the error's text as passed checks."""
    out = tmp_path / "gpu_check.json"
    calls: list = []

    def train_step(device, args, deadline, into=None):
        into["rows"] = {"kep_svgp": {"cpu": {"step_ms": 2.0}}}
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def equivalence(*arguments):
        raise RuntimeError("Triton compilation failed")

    _stub_sections(check, monkeypatch, calls, train_step=train_step, equivalence=equivalence)
    check.main(["--device", "cpu", "--smoke", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["train_step"]["rows"] == {"kep_svgp": {"cpu": {"step_ms": 2.0}}}
    assert written["train_step"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert calls == ["counts", "scaling", "kernels", "mnist1d"]  # the later sections still ran
    printed = capsys.readouterr().out
    assert "equivalence: 0 ok, not ok: none" in printed
    assert "equivalence error: RuntimeError: Triton compilation failed" in printed


def test_cuda_without_a_device_is_a_usage_error(check, tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--device", "cuda", "--out", str(tmp_path / "gpu_check.json")])
    assert exit_info.value.code == 2 and "--device cuda: this torch" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_mnist1d_section_keeps_the_runs_before_a_failing_one(check, monkeypatch):
    """A run that fails (e.g. on the device) is recorded and the other runs and the identity check still run; the
    identity check is skipped when the runs one by one, as timed, would end past the deadline."""
    import argparse
    import time
    import types

    import torch

    import gpattn.comparison
    import gpattn.comparison.runner

    trained, seconds = [], {"kep_svgp": 0.0}

    def train_and_evaluate(config, task, row, seed, data):
        trained.append((row, config.device))
        if row == "sgpa":
            raise RuntimeError("out of memory")
        time.sleep(seconds.get(row, 0.0))
        test = types.SimpleNamespace(accuracy=0.75)
        return types.SimpleNamespace(metrics=types.SimpleNamespace(test=test))

    class Record:
        def __init__(self, run):
            self.run = run

        def to_dict(self):
            return {"train": {"seconds": time.perf_counter()}, "run": list(self.run)}

    executed = []

    def execute_runs(config, plan):
        executed.append((config.jobs, list(plan)))
        return [Record(run) for run in plan]

    monkeypatch.setattr(gpattn.comparison, "load_task", lambda name: None)
    monkeypatch.setattr(gpattn.comparison, "train_and_evaluate", train_and_evaluate)
    monkeypatch.setattr(gpattn.comparison.runner, "execute_runs", execute_runs)
    args = argparse.Namespace(mnist1d_epochs=1, mnist1d_rows=["sgpa", "kep_svgp", "softmax"], smoke=True, jobs=2)
    cpu = torch.device("cpu")
    results = check.mnist1d(cpu, args, time.perf_counter() + 600)
    assert trained == [("sgpa", "cpu"), ("kep_svgp", "cpu"), ("softmax", "cpu")]
    assert results["runs"]["sgpa"] == {"cpu": {"error": "RuntimeError: out of memory"}}
    assert results["runs"]["softmax"]["cpu"]["test_accuracy"] == 0.75
    plan = [("mnist1d", "sgpa", 0), ("mnist1d", "kep_svgp", 0)]
    assert executed == [(1, plan), (2, plan)] and results["jobs_identity"]["identical_records"] is True
    # the runs one by one would take 0.2 s (kep_svgp's time), with about 0.1 s left: the identity check is skipped
    executed.clear()
    seconds["kep_svgp"] = 0.2
    results = check.mnist1d(cpu, args, time.perf_counter() + 0.3)
    assert results["runs"]["kep_svgp"]["cpu"]["seconds"] >= 0.2
    assert executed == [] and results["jobs_identity"].startswith("skipped: time budget (0.2 s of runs one by one")


def test_a_failing_triton_check_is_recorded_and_the_equivalence_goes_on(check, monkeypatch):
    """The Triton kernels against the PyTorch path at the benchmark's sizes: an error (a kernel that does not compile
    on the device) is recorded under its name and the next checks run, as for the split check."""
    import torch

    def triton_check(device, smoke, split=False):
        if not split:
            raise RuntimeError("PassManager::run failed")
        return {"ok": True}

    for name in ("VARIANT_ROWS", "COMPILED_CHECK_ROWS", "AUTOCAST_ROWS"):  # the other checks left out, for speed
        monkeypatch.setattr(check, name, ())
    monkeypatch.setattr(check, "attention_names", lambda: ())
    monkeypatch.setattr(check, "_triton_against_pytorch", triton_check)
    results = check.equivalence(torch.device("cpu"), smoke=True)
    assert results == {
        "kep_svgp_triton_vs_pytorch": {"error": "RuntimeError: PassManager::run failed"},
        "kep_svgp_split_triton_vs_pytorch": {"ok": True},
    }
