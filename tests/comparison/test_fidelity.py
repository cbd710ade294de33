""":func:`~gpattn.comparison.model_fidelity`: :func:`~gpattn.features.ksvd_fidelity` on the tokens every KSVD layer
receives, for the trained model and the model at initialisation, and the initialisation a comparison run measures
(the first member exactly as the training loop received it)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import fields

import numpy as np
import pytest
import torch

from gpattn.comparison import CompareConfig, build_model, load_task, model_fidelity, train_and_evaluate
from gpattn.comparison.fidelity import INITIAL_FIELDS
from gpattn.features import KSVDFidelity, ksvd_fidelity
from gpattn.methods import get_method
from gpattn.models import Transformer
from gpattn.training import Callback

FIELDS = tuple(field.name for field in fields(KSVDFidelity))


def _model(seed: int, num_inducing: int = 4) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(3, embed_dim=16, depth=2, num_heads=2, attention="kep_svgp", input="vectors", input_dim=4,
                       max_len=10, num_inducing=num_inducing).double().eval()  # fmt: skip


def _data(sequences: int = 7):
    data = type("Inputs", (), {})()
    data.inputs = torch.randn(sequences, 10, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    data.labels = torch.zeros(sequences, dtype=torch.long)
    return data


def test_model_fidelity_is_ksvd_fidelity_on_the_tokens_the_layer_receives():
    model, data = _model(0), _data()
    fidelity = model_fidelity(model, data, max_sequences=5)
    assert list(fidelity) == ["layer_2"]  # the first block is softmax attention
    assert set(fidelity["layer_2"]) == {*FIELDS, "rank"}  # no initial model: no initial_* fields
    with torch.no_grad():  # the second block's attention input, by hand: LN(block_1(embed(x)))
        tokens = model.blocks[0](model.embed(data.inputs[:5]), None)
        expected = ksvd_fidelity(model.blocks[1].attention, model.blocks[1].attention_norm(tokens))
    for name in FIELDS:
        per_head = fidelity["layer_2"][name]
        assert len(per_head) == 2
        np.testing.assert_allclose(per_head, getattr(expected, name).mean(0).numpy(), rtol=1e-10, atol=1e-12)
    assert fidelity["layer_2"]["rank"] == [4.0, 4.0]
    assert fidelity["layer_2"]["relative_objective"][0] > 1e-3  # random weights: not a KSVD
    softmax = Transformer(3, embed_dim=16, depth=1, num_heads=2, attention="softmax", input="vectors", input_dim=4,
                          max_len=10)  # fmt: skip
    assert model_fidelity(softmax.double(), data) == {}


def test_the_initial_model_is_measured_on_its_own_tokens():
    trained, initial, data = _model(0), _model(1), _data()  # "trained": any other state of the same architecture
    fidelity = model_fidelity(trained, data, max_sequences=5, initial=initial)["layer_2"]
    alone = model_fidelity(initial, data, max_sequences=5)["layer_2"]
    assert set(fidelity) == {*FIELDS, *(f"initial_{name}" for name in INITIAL_FIELDS), "rank"}
    assert not any(name.startswith("random_") for name in INITIAL_FIELDS)
    for name in INITIAL_FIELDS:
        assert fidelity[f"initial_{name}"] == alone[name]
    assert fidelity["kernel_error"] != alone["kernel_error"]  # two models, two numbers
    with pytest.raises(ValueError, match=r"initial model has KSVD layers \(number, rank\) \[\(2, 3\)\]"):
        model_fidelity(trained, data, initial=_model(1, num_inducing=3))


def test_padded_sequences_shorter_than_the_rank_are_left_out():
    model = _model(0)
    data = type("Tokens", (), {})()
    data.tokens = torch.randn(3, 10, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    data.mask = torch.ones(3, 10, dtype=torch.bool)
    data.mask[1, 3:] = False  # 3 real tokens < s = 4
    data.labels = torch.zeros(3, dtype=torch.long)
    fidelity = model_fidelity(model, data)["layer_2"]
    kept = type("Tokens", (), {"tokens": data.tokens[[0, 2]], "mask": data.mask[[0, 2]], "labels": data.labels[:2]})
    expected = model_fidelity(model, kept)["layer_2"]
    # equal to float64 rounding: the GEMMs over a batch of 3 and of 2 sequences may round differently (1e-15 relative
    # on an AMD EPYC processor); with the short sequence counted the numbers would differ in their leading digits
    assert fidelity.keys() == expected.keys()
    for name, value in expected.items():
        assert fidelity[name] == pytest.approx(value, rel=1e-12, abs=1e-14), name


class _Snapshot(Callback):
    """Keeps the model's state as the training loop receives it."""

    def __init__(self) -> None:
        self.state: dict | None = None

    def on_train_begin(self, context) -> None:
        self.state = copy.deepcopy(context.model.state_dict())


def test_a_run_measures_the_first_member_as_it_was_before_training():
    digits = load_task("digits")
    small = dataclasses.replace(digits, defaults={**digits.defaults, "num_inducing": 5})  # s = 5 < 16 patches
    config = CompareConfig(attentions=("kep_svgp",), fidelity_sequences=16, tasks=("digits",), pointer_epochs=1,
                           digits_epochs=1, eval_samples=2, seeds=(0,), progress=False, tuned=False)  # fmt: skip
    snapshot = _Snapshot()
    record = train_and_evaluate(config, "digits", "kep_svgp", 0, data=small, callbacks=[snapshot])
    fidelity = record.fidelity["layer_2"]
    assert set(fidelity) == {*FIELDS, *(f"initial_{name}" for name in INITIAL_FIELDS), "rank"}
    # the run's model, built again and given the state the training loop received: the same numbers
    method = get_method("kep_svgp")
    initial = build_model(
        method, config.hyperparameters("digits", method, small.defaults), small.num_classes, small.model_kwargs
    )
    initial.load_state_dict(snapshot.state)
    expected = model_fidelity(initial, small.test, 16)["layer_2"]
    for name in INITIAL_FIELDS:
        np.testing.assert_allclose(fidelity[f"initial_{name}"], expected[name], rtol=1e-6, atol=1e-7)
    assert fidelity["rank"] == [5.0, 5.0]
    assert fidelity["kernel_error"] != fidelity["initial_kernel_error"]  # one epoch moved the layer


def test_the_settings_are_checked_before_the_forward_pass():
    # random_samples and seed were checked only inside ksvd_fidelity, after the forward pass and under its name, and
    # not at all when no layer was measured (every rank above the sequence length): random_samples=0 returned {}
    model, data = _model(0, num_inducing=4), _data()
    short = type("Inputs", (), {"inputs": data.inputs[:, :3], "labels": data.labels})()  # 3 tokens < s = 4
    assert model_fidelity(model, short) == {}
    for kwargs, match in (
        ({"random_samples": 0}, r"^model_fidelity: expected random_samples to be a positive integer, got 0$"),
        ({"random_samples": True}, r"^model_fidelity: expected random_samples to be a positive integer, got True$"),
        ({"seed": -1}, r"^model_fidelity: expected seed to be a non-negative integer, got -1$"),
    ):
        for dataset in (data, short):
            with pytest.raises(ValueError, match=match):
                model_fidelity(model, dataset, **kwargs)
