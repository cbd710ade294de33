"""Shapes, layer placement, KL bookkeeping, mask invariance and argument checks of
:class:`~gpattn.models.Transformer` (float64, small sizes)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from gpattn.attention import (
    ATTENTIONS,
    KEPSVGPAttention,
    SGPAAttention,
    SoftmaxAttention,
    attention_arguments,
    attention_names,
)
from gpattn.models import Transformer
from gpattn.models.presets import VIT_CIFAR_PRESET

SIZE_ARGUMENTS = ("num_inducing",)
VOCAB, LENGTH, BATCH, CLASSES = 11, 9, 4, 3


def small_model(attention: str = "kep_svgp", seed: int = 0, **kwargs) -> Transformer:
    sizes = {key: 4 for key in SIZE_ARGUMENTS if key in attention_arguments(attention)}
    arguments = {"embed_dim": 16, "num_heads": 2, "depth": 2, "input": "tokens", "vocab_size": VOCAB, "max_len": 16}
    torch.manual_seed(seed)
    return Transformer(CLASSES, attention=attention, **{**arguments, **sizes, **kwargs}).double()


def token_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = torch.arange(LENGTH) < torch.tensor([LENGTH, 3, 6, 1])[:, None]
    return torch.where(mask, ids, 0), mask


def test_token_input_shapes():
    model = small_model()
    ids, mask = token_batch()
    for model_mask in (None, mask, "causal"):
        logits = model(ids, mask=model_mask)
        assert logits.shape == (BATCH, CLASSES) and logits.dtype == torch.float64
        assert torch.isfinite(logits).all()


def test_vector_input_shapes():
    model = small_model(input="vectors", vocab_size=None, input_dim=5)
    vectors = torch.randn(BATCH, LENGTH, 5, dtype=torch.float64)
    assert model(vectors).shape == (BATCH, CLASSES)
    assert model(vectors, mask=token_batch()[1]).shape == (BATCH, CLASSES)


def test_patch_input_shapes():
    model = small_model(input="patches", vocab_size=None, max_len=512, image_size=(8, 12), patch_size=4, in_channels=3)
    assert model.max_len == 6 and model.position_embedding.shape == (1, 6, 16)
    assert model(torch.randn(BATCH, 3, 8, 12, dtype=torch.float64)).shape == (BATCH, CLASSES)


def test_numpy_integer_sizes_build_the_model_of_python_ones():
    # image_size=np.int64(8) raised "'numpy.int64' object is not iterable"; NumPy sizes were kept as attributes
    sizes = {"image_size": np.int64(8), "patch_size": np.int64(4), "in_channels": np.int64(3)}
    model = small_model(input="patches", vocab_size=None, **sizes)
    assert model.image_size == (8, 8) and model.max_len == 4 and model.in_channels == 3
    assert all(type(value) is int for value in (*model.image_size, model.max_len, model.in_channels))
    assert model(torch.randn(BATCH, 3, 8, 8, dtype=torch.float64)).shape == (BATCH, CLASSES)
    model = Transformer(np.int64(3), embed_dim=np.int64(8), depth=1, num_heads=np.int32(2), vocab_size=5, max_len=4)
    assert type(model.num_classes) is int and type(model.embed_dim) is int and model.head.out_features == 3


def windowed_convolution(signal: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int) -> torch.Tensor:
    """Reference of a zero-padded ``Conv1d`` by explicit windows: ``(B, D, L) -> (B, C, N)``, output ``n`` the
    weighted sum of the window of ``k`` positions centred on position ``n * stride``."""
    k = weight.shape[-1]
    padded = torch.nn.functional.pad(signal, ((k - 1) // 2, (k - 1) // 2))
    windows = torch.stack([padded[..., start : start + k] for start in range(0, signal.shape[-1], stride)], dim=1)
    return torch.einsum("bndk,cdk->bcn", windows, weight) + bias[:, None]  # windows: (B, N, D, k)


@pytest.mark.parametrize(("layers", "kernel", "stride", "length"), [(1, 5, 2, 11), (2, 3, 2, 12), (3, 5, 1, 7)])
def test_signal_stem_is_windowed_convolutions(layers, kernel, stride, length):
    model = small_model(
        input="signal",
        vocab_size=None,
        input_dim=2,
        max_len=12,
        stem_layers=layers,
        stem_kernel_size=kernel,
        stem_stride=stride,
    ).eval()
    signal = torch.randn(BATCH, length, 2, dtype=torch.float64)
    convolutions = [module for module in model.embedding if isinstance(module, torch.nn.Conv1d)]
    assert len(convolutions) == layers
    hidden = signal.transpose(1, 2)
    for index, convolution in enumerate(convolutions):
        last = index == layers - 1
        hidden = windowed_convolution(hidden, convolution.weight, convolution.bias, stride if last else 1)
        hidden = hidden if last else torch.nn.functional.gelu(hidden)
    tokens = -(-length // stride)  # ceil(L / s)
    assert model.max_len == -(-12 // stride) and model.position_embedding.shape == (1, model.max_len, 16)
    expected = hidden.transpose(1, 2) + model.position_embedding[:, :tokens]
    torch.testing.assert_close(model.embed(signal), expected, rtol=1e-12, atol=1e-12)
    assert model(signal).shape == (BATCH, CLASSES)


def test_signal_input_defaults_and_gp_layer_length():
    model = small_model(input="signal", vocab_size=None, input_dim=1, max_len=40, merge="concat_tokens")
    assert (model.stem_kernel_size, model.stem_stride, model.stem_layers) == (5, 2, 2)
    assert model.max_len == 20 and model.attention_layers()[-1].max_len == 20  # the tokens, not the signal length
    logits = model.train()(torch.randn(BATCH, 40, 1, dtype=torch.float64))
    (logits.sum() + model.kl_divergence()).backward()
    assert logits.shape == (BATCH, CLASSES) and torch.count_nonzero(model.embedding[0].weight.grad) > 0


@pytest.mark.parametrize("gp_layers", [0, 1, 2, 3])
def test_gp_layers_are_the_last_blocks(gp_layers):
    model = small_model("sgpa", depth=3, gp_layers=gp_layers)
    kinds = [type(layer) for layer in model.attention_layers()]
    assert kinds == [SoftmaxAttention] * (3 - gp_layers) + [SGPAAttention] * gp_layers


def test_attention_kwargs_reach_the_gp_layers_only():
    model = small_model("kep_svgp", depth=3, gp_layers=2, num_inducing=3, dropout=0.25, tie_qk=True)
    first, *gp = model.attention_layers()
    assert isinstance(first, SoftmaxAttention) and first.dropout.p == 0.25
    assert all(isinstance(layer, KEPSVGPAttention) and layer.num_inducing == 3 and layer.tie_qk for layer in gp)
    assert all(layer.max_len == 16 for layer in gp)  # the model's max_len is passed to layers that take one


def test_kl_divergence_sums_every_layer():
    model = small_model("kep_svgp", depth=3, gp_layers=2).train()
    model(*token_batch())
    layer_kls = [layer.kl_divergence() for layer in model.attention_layers()]
    assert layer_kls[0] == 0 and all(kl > 0 for kl in layer_kls[1:])
    torch.testing.assert_close(model.kl_divergence(), sum(layer_kls), rtol=1e-12, atol=0)
    assert small_model("softmax").kl_divergence() == 0


@pytest.mark.parametrize("name", attention_names())
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_padding_has_no_influence_on_the_logits(name, mode):
    model = small_model(name).train(mode == "train")
    ids, mask = token_batch()
    other = torch.where(mask, ids, torch.randint(1, VOCAB, ids.shape, generator=torch.Generator().manual_seed(5)))
    torch.manual_seed(3)
    logits = model(ids, mask=mask)
    torch.manual_seed(3)
    torch.testing.assert_close(model(other, mask=mask), logits, rtol=0, atol=1e-6)
    # the same sequences without their padding: a shorter batch gives the same logits
    torch.manual_seed(3)
    short = model(ids[3:, :1])
    if not model.attention_layers()[-1].sampling:  # noise shapes differ with the batch size
        torch.testing.assert_close(short, logits[3:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", attention_names())
def test_every_registry_name_builds_and_trains(name):
    model = small_model(name).train()
    ids, mask = token_batch()
    logits = model(ids, mask=mask)
    (logits.sum() + model.kl_divergence()).backward()
    assert isinstance(model.attention_layers()[-1], ATTENTIONS[name][0])
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.count_nonzero(model.embedding.weight.grad) > 0


@pytest.mark.parametrize("name", attention_names())
def test_a_model_is_copied_after_a_training_step(name):
    """``copy.deepcopy`` after a training step (before and after its backward pass): the copy predicts as the
    original in eval mode, and has the same KL."""
    model = small_model(name).train()
    ids, mask = token_batch()
    torch.manual_seed(2)
    loss = model(ids, mask=mask).sum() + model.kl_divergence()
    before = copy.deepcopy(model)
    loss.backward()
    after = copy.deepcopy(model)
    expected = model.eval()(ids, mask=mask)
    for duplicate in (before, after):
        torch.testing.assert_close(duplicate.kl_divergence(), model.kl_divergence().detach(), rtol=0, atol=0)
        torch.testing.assert_close(duplicate.eval()(ids, mask=mask), expected, rtol=0, atol=0)


def test_vit_cifar_preset_builds():
    torch.manual_seed(0)
    model = Transformer(num_classes=10, **VIT_CIFAR_PRESET).eval()
    layers = model.attention_layers()
    assert len(layers) == 7 and all(isinstance(layer, SoftmaxAttention) for layer in layers[:-1])
    assert isinstance(layers[-1], KEPSVGPAttention) and layers[-1].num_inducing == 10 and layers[-1].num_heads == 12
    assert model.max_len == 64 and model.blocks[0].mlp[0].out_features == 384
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gp_layers": 3}, "gp_layers"),
        ({"gp_layers": -1}, "gp_layers"),
        ({"depth": 0}, "depth"),
        ({"input": "pixels"}, "input"),
        ({"vocab_size": None}, "Transformer: input='tokens' needs vocab_size"),
        ({"input": "vectors", "vocab_size": None}, "needs input_dim"),
        (
            {"input": "patches", "vocab_size": None, "image_size": 8, "patch_size": 3, "in_channels": 1},
            r"Transformer: patch_size 3 must divide the image size \(8, 8\)",
        ),
        ({"input": "patches", "vocab_size": None, "image_size": 8, "patch_size": 2}, "needs in_channels"),
        ({"input": "signal", "vocab_size": None}, "needs input_dim"),
        ({"input": "signal", "vocab_size": None, "input_dim": 1, "stem_kernel_size": 4}, "odd stem_kernel_size"),
        ({"input": "signal", "vocab_size": None, "input_dim": 1, "stem_layers": 0}, "stem_layers"),
        ({"stem_stride": 2}, "stem_stride is only used with input='signal'"),
        ({"input_dim": 4}, "input_dim is only used with input='vectors' or 'signal'"),
        ({"attention": "nope"}, "expected one of"),
        ({"mlp_ratio": 0.0}, "mlp_ratio"),
        ({"dropout": 1.0}, "dropout"),
        ({"num_heads": 3}, r"^Transformer: embed_dim \(16\) must be divisible by num_heads \(3\)"),
        ({"num_heads": 3, "gp_layers": 0}, r"^Transformer: embed_dim \(16\) must be divisible"),
        ({"num_heads": 0}, "^Transformer: expected num_heads to be a positive integer"),
        (
            {"input": "patches", "vocab_size": None, "image_size": "88", "patch_size": 2, "in_channels": 1},
            r"^Transformer: expected image_size to be an int or \(H, W\), got '88'",
        ),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_model(**kwargs)


def test_one_class_is_refused():  # a softmax over one logit is 1 whatever the input: nothing to learn or predict
    with pytest.raises(ValueError, match="^Transformer: expected num_classes to be an integer >= 2, got 1"):
        Transformer(1, embed_dim=16, depth=1, num_heads=2, attention="softmax", vocab_size=VOCAB, max_len=16)


def test_invalid_inputs():
    model = small_model()
    ids, mask = token_batch()
    with pytest.raises(TypeError, match="integer token ids"):
        model(ids.double())
    with pytest.raises(ValueError, match="shape"):
        model(ids[0])
    with pytest.raises(ValueError, match=r"^Transformer: token ids must lie in \[0, "):
        model(ids + VOCAB)
    with pytest.raises(ValueError, match="^Transformer: sequence length 17 exceeds max_len"):
        model(torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="padding mask"):
        model(ids, mask=mask[:, :-1])
    with pytest.raises(ValueError, match="every token"):
        model(ids, mask=torch.zeros_like(mask))
    vectors = small_model(input="vectors", vocab_size=None, input_dim=5)
    with pytest.raises(ValueError, match=r"\(B, N, 5\)"):
        vectors(torch.randn(2, 3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        vectors(torch.ones(2, 3, 5, dtype=torch.long))
    signal = small_model(input="signal", vocab_size=None, input_dim=1, max_len=12)
    with pytest.raises(ValueError, match="max_len=12"):
        signal(torch.randn(2, 13, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(B, L, 1\)"):
        signal(torch.randn(2, 12, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="takes no mask"):
        signal(torch.randn(2, 12, 1, dtype=torch.float64), mask=torch.ones(2, 6, dtype=torch.bool))


def test_numpy_float_rates_become_python_floats():
    """``dropout=np.float64(0.1)`` reached the dropout modules as a NumPy float (their ``p``, the checkpoints'
    model description)."""
    model = Transformer(2, embed_dim=8, depth=1, num_heads=2, attention="softmax", vocab_size=4, max_len=4,
                        dropout=np.float64(0.1), mlp_ratio=np.float32(2.0))  # fmt: skip
    rates = {type(module.p) for module in model.modules() if isinstance(module, torch.nn.Dropout)}
    assert rates == {float} and model.embedding_dropout.p == 0.1
