"""The interface contract of every registered attention layer (one parametrised suite over ``attention_names()``).

Layers are built small (``embed_dim=16``, 2 heads, rank / inducing sizes 4 where the class takes them) in float64.
Stochastic layers are compared in eval mode (predictive mean) or, in training mode, with the global seed reset before
each call so that both calls draw the same noise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.attention import (
    ATTENTIONS,
    AttentionLayer,
    attention_arguments,
    attention_names,
    build_attention,
    sample_attention,
)

EMBED_DIM, NUM_HEADS = 16, 2
BATCH, LENGTH = 3, 7
SIZE_ARGUMENTS = ("num_inducing",)
NAMES = attention_names()
MODES = ["eval", "train"]


def small_sizes(name: str, size: int = 4) -> dict[str, int]:
    """``size`` for the rank / inducing-set arguments the layer has."""
    return {key: size for key in SIZE_ARGUMENTS if key in attention_arguments(name)}


def build(name: str, embed_dim: int = EMBED_DIM, num_heads: int = NUM_HEADS, seed: int = 0) -> AttentionLayer:
    torch.manual_seed(seed)
    return build_attention(name, embed_dim, num_heads, **small_sizes(name)).double()


def tokens(batch: int = BATCH, length: int = LENGTH, seed: int = 1, width: int = EMBED_DIM) -> torch.Tensor:
    return torch.randn(batch, length, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def padding(batch: int = BATCH, length: int = LENGTH) -> torch.Tensor:
    lengths = torch.tensor([length, 2, length - 2])[:batch]
    return torch.arange(length) < lengths[:, None]


def call(layer: AttentionLayer, x: torch.Tensor, seed: int = 7, **kwargs) -> torch.Tensor:
    """One forward pass with the global seed fixed, so that two training-mode calls draw the same noise."""
    torch.manual_seed(seed)
    return layer(x, **kwargs)


def set_mode(layer: AttentionLayer, mode: str) -> AttentionLayer:
    return layer.train(mode == "train")


def test_registry_names():
    assert NAMES == [
        "kep_svgp",
        "kep_svgp_sym",
        "sgpa",
        "svgp",
        "softmax",
        "primal",
        "cgpt",
        "kep_svgp_paper",
        "primal_paper",
    ]
    assert ATTENTIONS["kep_svgp_sym"][1] == {"tie_qk": True}
    with pytest.raises(ValueError, match="kep_svgp"):
        build_attention("not_an_attention", EMBED_DIM, NUM_HEADS)
    with pytest.raises(TypeError, match="not_an_argument"):
        build_attention("softmax", EMBED_DIM, NUM_HEADS, not_an_argument=1)
    assert attention_arguments("softmax") == ["dropout"]
    assert {"num_inducing", "ksvd_weight", "tie_qk", "dropout"} <= set(attention_arguments("kep_svgp"))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_output_shape(name, mode):
    layer = set_mode(build(name), mode)
    out = call(layer, tokens())
    assert isinstance(layer, AttentionLayer)
    assert out.shape == (BATCH, LENGTH, EMBED_DIM) and out.dtype == torch.float64
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_padded_keys_have_no_influence(name, mode):
    layer = set_mode(build(name), mode)
    x, mask = tokens(), padding()
    perturbed = torch.where(mask[..., None], x, 10.0 * tokens(seed=2))
    out, out_perturbed = call(layer, x, mask=mask), call(layer, perturbed, mask=mask)
    torch.testing.assert_close(out[mask], out_perturbed[mask], rtol=0, atol=1e-6)
    # not vacuous: a real key does influence the other real tokens
    moved = x.clone()
    moved[0, 1] += 3.0
    assert (call(layer, moved, mask=mask)[0, 0] - out[0, 0]).abs().max() > 1e-8


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_causal_mask_hides_the_future(name, mode):
    layer = set_mode(build(name), mode)
    if not layer.supports_causal:
        with pytest.raises(ValueError, match="causal"):
            layer(tokens(), mask="causal")
        pytest.skip(f"{type(layer).__name__} does not support causal masks")
    x = tokens()
    for last in (0, 3, LENGTH - 2):
        perturbed = x.clone()
        perturbed[:, last + 1 :] = 10.0 * tokens(seed=3)[:, last + 1 :]
        out, out_perturbed = call(layer, x, mask="causal"), call(layer, perturbed, mask="causal")
        torch.testing.assert_close(out[:, : last + 1], out_perturbed[:, : last + 1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_variable_length_across_calls(name):
    layer = build(name).eval()
    short = layer(tokens(length=5))
    assert layer(tokens(length=11, seed=2)).shape == (BATCH, 11, EMBED_DIM)
    assert layer(tokens(length=1, seed=3)).shape == (BATCH, 1, EMBED_DIM)
    torch.testing.assert_close(layer(tokens(length=5)), short, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_cross_attention(name, mode):
    layer = set_mode(build(name), mode)
    x, context = tokens(length=5), tokens(length=9, seed=2)
    if not layer.supports_cross_attention:
        with pytest.raises(ValueError, match="cross-attention"):
            layer(x, context=context)
        pytest.skip(f"{type(layer).__name__} does not support cross-attention")
    assert call(layer, x, context=context).shape == (BATCH, 5, EMBED_DIM)
    context_mask = padding(length=9)
    perturbed = torch.where(context_mask[..., None], context, 10.0 * tokens(length=9, seed=4))
    out = call(layer, x, mask=context_mask, context=context)
    out_perturbed = call(layer, x, mask=context_mask, context=perturbed)
    assert out.shape == (BATCH, 5, EMBED_DIM)
    torch.testing.assert_close(out, out_perturbed, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="causal"):
        layer(x, mask="causal", context=context)


@pytest.mark.parametrize("name", NAMES)
def test_eval_is_deterministic_and_sampling_is_not(name):
    layer = build(name).eval()
    x, mask = tokens(), padding()
    first = layer(x, mask=mask)
    torch.testing.assert_close(layer(x, mask=mask), first, rtol=0, atol=0)
    if not layer.is_stochastic:
        with sample_attention(layer):
            torch.testing.assert_close(layer(x, mask=mask), first, rtol=0, atol=0)
        return
    with sample_attention(layer):
        assert layer.sampling
        assert not torch.allclose(layer(x, mask=mask), layer(x, mask=mask))
    assert not layer.sampling
    torch.testing.assert_close(layer(x, mask=mask), first, rtol=0, atol=0)
    layer.train()
    assert not torch.allclose(layer(x, mask=mask), layer(x, mask=mask))


@pytest.mark.parametrize("name", NAMES)
def test_kl_and_posterior(name):
    layer = build(name).eval()
    x = tokens()
    layer(x)
    kl = layer.kl_divergence()
    assert kl.shape == () and torch.isfinite(kl) and kl >= 0
    if not layer.is_stochastic:
        assert kl == 0
    mean, variance = layer.posterior(x)
    assert mean.shape == variance.shape == (BATCH, LENGTH, EMBED_DIM)
    assert (variance >= 0).all()
    torch.testing.assert_close(mean, layer(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_a_finite_gradient(name):
    # the layer's whole training objective: the singular values of Primal-Attention enter only the KSVD term J^2
    # (the output uses the scores e, r alone), so the added loss terms are part of it
    layer = build(name).train()
    x = tokens().requires_grad_(True)
    out = call(layer, x, mask=padding())
    added = sum((term.loss() for term in layer.added_loss_terms()), torch.zeros((), dtype=torch.float64))
    (out.sum() + layer.kl_divergence() + added).backward()
    missing = [key for key, parameter in layer.named_parameters() if parameter.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    for key, parameter in layer.named_parameters():
        assert torch.isfinite(parameter.grad).all(), key
    zero = [key for key, parameter in layer.named_parameters() if torch.count_nonzero(parameter.grad) == 0]
    assert not zero, f"parameters with an all-zero gradient: {zero}"
    assert torch.isfinite(x.grad).all() and torch.count_nonzero(x.grad) > 0


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_on_the_input(name):
    torch.manual_seed(0)
    layer = build_attention(name, 8, 2, **small_sizes(name, 2)).double().eval()
    x = tokens(batch=2, length=3, width=8).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # check_undefined_grad=False: linear_operator's custom autograd functions (used by GPyTorch SVGPs) do not accept
    # undefined output gradients, a property of the backward implementation rather than of the derivative checked here
    assert torch.autograd.gradcheck(
        lambda inputs: layer(inputs, mask=mask), (x,), eps=1e-6, atol=1e-5, check_undefined_grad=False
    )


@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise(name):
    layer = build(name)
    x = tokens()
    with pytest.raises(ValueError, match=f"\\(B, N, {EMBED_DIM}\\)"):
        layer(tokens(width=EMBED_DIM + 1))
    with pytest.raises(ValueError):
        layer(x[0])
    with pytest.raises(TypeError, match="floating"):
        layer(x.long())
    with pytest.raises(ValueError, match="NaN"):
        layer(torch.where(torch.rand_like(x) < 0.1, torch.nan, x))
    empty = padding()
    empty[1] = False
    with pytest.raises(ValueError, match="every token"):
        layer(x, mask=empty)
    with pytest.raises(ValueError, match="shape"):
        layer(x, mask=padding()[:, :-1])
    with pytest.raises(TypeError, match="boolean"):
        layer(x, mask=padding().long())
    with pytest.raises(ValueError, match="causal"):
        layer(x, mask="anti-causal")


@pytest.mark.parametrize("name", NAMES)
def test_default_arguments_fit_small_heads(name):
    # head width 4 < the default KSVD rank 10: the KSVD layers' default is min(10, head width)
    layer = build_attention(name, 8, 2).double()
    assert layer(tokens(width=8)).shape == (BATCH, LENGTH, 8)
    if "feature_dim" in attention_arguments(name):
        assert layer.num_inducing == 4


@pytest.mark.parametrize("name", NAMES)
def test_forward_hooks_fire(name):
    layer = build(name).eval()
    seen = {}
    layer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(input=args[0]), with_kwargs=True)
    layer.register_forward_hook(lambda module, args, output: seen.update(output=output))
    x = tokens()
    output = layer(x, mask=torch.ones(BATCH, LENGTH, dtype=torch.bool))
    assert seen["input"] is x and seen["output"] is output


@pytest.mark.parametrize("name", NAMES)
def test_learned_spectrum_is_the_ksvd_singular_values_or_none(name):
    layer = build(name)
    spectrum = layer.learned_spectrum()
    if ATTENTIONS[name][0].__name__ in ("KEPSVGPAttention", "PrimalAttention"):
        # the learned KSVD singular values of every head, shape (H, s), detached from the graph
        assert spectrum.shape == (NUM_HEADS, 4) and not spectrum.requires_grad
        assert torch.equal(spectrum, layer.features.singular_values)
        if name.startswith("kep_svgp"):  # exact features are recomputed per sequence: nothing learned
            assert (
                build_attention(name, EMBED_DIM, NUM_HEADS, features="exact", ksvd_form="sum").learned_spectrum()
                is None
            )
    else:
        assert spectrum is None


@pytest.mark.parametrize("name", NAMES)
def test_numpy_integer_sizes_build_the_same_layer(name):
    # sizes read from NumPy (a config array, np.int64) are Python ints on the layer: GPyTorch's kernels fail on a NumPy
    # integer in their batch shape ("Expected bool, got numpy.bool")
    sizes = {key: np.int64(value) for key, value in small_sizes(name).items()}
    torch.manual_seed(0)
    layer = build_attention(name, np.int64(EMBED_DIM), np.int64(NUM_HEADS), **sizes).double().eval()
    assert all(type(getattr(layer, key)) is int for key in ("embed_dim", "num_heads", "head_dim", *sizes))
    x = tokens()
    torch.testing.assert_close(layer(x), build(name).eval()(x), rtol=0, atol=0)
