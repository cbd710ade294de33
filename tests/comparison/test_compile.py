"""``gpattn compare --compile``: the option reaches every run's model, the compile mode follows the device (CUDA graphs
on CUDA), and a compiled model trains to the numbers of the eager one (slow: a cold torch.compile)."""

from __future__ import annotations

import pytest
import torch

from gpattn.cli import main
from gpattn.comparison import CompareConfig, build_model
from gpattn.comparison import runner as runner_module
from gpattn.comparison.runs import compile_model
from gpattn.methods import get_method


@pytest.mark.parametrize(
    ("device", "mode"), [("cpu", "default"), ("cuda", "reduce-overhead"), ("cuda:1", "reduce-overhead")]
)
def test_compile_mode_follows_the_device(monkeypatch, device: str, mode: str):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **options: calls.append(options) or model)
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, device) is model  # in place: the same module, parameters and state dict
    assert calls == [{"mode": mode}]


def test_the_option_reaches_the_runs(monkeypatch, tmp_path):
    """``--compile`` sets ``CompareConfig.compile`` (a result setting: resume checks it) and each run's model is
    compiled once."""
    seen = {}

    def execute(config, runs, out=None, resume=False, executor=None):
        seen["config"] = config
        raise KeyboardInterrupt  # stop before training: the command reports the interruption

    monkeypatch.setattr(runner_module, "execute_runs", execute)
    status = main(["compare", "--compile", "--quick", "--attentions", "softmax", "--out", str(tmp_path / "run")])
    assert status != 0 and seen["config"].compile is True
    assert "compile" in runner_module.result_settings(seen["config"])
    assert CompareConfig().compile is False


@pytest.mark.slow  # a cold torch.compile of a small model takes a minute or more on 2 cores
def test_compiled_model_trains_to_the_eager_numbers():
    """Three AdamW steps of a small KEP-SVGP Transformer (joint draws, the KSVD penalty, the KL) from the same
    initialisation and seeds: the compiled model's losses and parameters equal the eager model's up to float32
    rounding of reordered sums."""
    method = get_method("kep_svgp")
    config = CompareConfig(embed_dim=16, depth=1, num_heads=2)
    hyperparameters = config.hyperparameters("mnist1d", method, {"num_inducing": 4})
    tokens = torch.randn(8, 16, 1, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(method, hyperparameters, 10, {"input": "vectors", "input_dim": 1, "max_len": 16})
        model = compile_model(model, "cpu") if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        torch.manual_seed(3)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            for layer in model.attention_layers():
                loss = loss + 1e-2 * layer.kl_divergence()
                for term in layer.added_loss_terms():
                    loss = loss + term.loss()
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        results[compiled] = (torch.stack(losses), {k: v.detach().clone() for k, v in model.state_dict().items()})
    (eager_losses, eager_state), (compiled_losses, compiled_state) = results[False], results[True]
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-6)
    assert compiled_state.keys() == eager_state.keys()
    for key, value in eager_state.items():
        torch.testing.assert_close(compiled_state[key], value, rtol=1e-4, atol=1e-5, msg=key)
