"""The shared conversion pieces: masks against hand-built masks, block indices, the projection copies of every
registered layer against the source weights, layer building errors, and all-or-nothing replacement."""

from __future__ import annotations

import pytest
import torch

from gpattn.attention import SoftmaxAttention, attention_names, build_attention, select_arguments
from gpattn.integrations import (
    AttentionAdapter,
    build_layer,
    convert_modules,
    copy_projections,
    padding_mask,
    resolve_blocks,
)

WIDTH, HEADS = 8, 2
HEAD_WIDTH = WIDTH // HEADS


# -- padding_mask --------------------------------------------------------------------------------------------------
def _real_tokens() -> torch.Tensor:
    real = torch.ones(3, 5, dtype=torch.bool)
    real[1, 3:] = False
    real[2, 1:] = False
    return real


@pytest.mark.parametrize("shape", ["(B, 1, 1, N)", "(B, 1, N, N)", "(B, H, N, N)"])
def test_padding_mask_reads_boolean_masks(shape):
    real = _real_tokens()
    batch, length = real.shape
    sizes = {"B": batch, "H": 2, "N": length, "1": 1}
    target = [sizes[size] for size in shape.strip("()").split(", ")]
    mask = real[:, None, None, :].expand(batch, target[1], target[2], length)  # every query row is the key mask
    result = padding_mask(mask, batch, length)
    assert result.dtype == torch.bool and torch.equal(result, real)


@pytest.mark.parametrize("hidden", [torch.finfo(torch.float64).min, -torch.inf, -10000.0])
def test_padding_mask_reads_additive_masks(hidden):
    real = _real_tokens()
    batch, length = real.shape
    mask = torch.zeros(batch, 1, length, length, dtype=torch.float64).masked_fill(~real[:, None, None, :], hidden)
    result = padding_mask(mask, batch, length)
    assert result.dtype == torch.bool and torch.equal(result, real)


@pytest.mark.parametrize("form", ["boolean", "additive"])
def test_padding_mask_reads_symmetric_masks(form):
    # valid[q] & valid[k], timm's NaFlexViT mask: the padding queries' rows hide every key (refused before)
    real = _real_tokens()
    batch, length = real.shape
    symmetric = (real[:, None, :, None] & real[:, None, None, :]).expand(batch, 2, length, length)
    if form == "additive":
        symmetric = torch.zeros(symmetric.shape).masked_fill(~symmetric, torch.finfo(torch.float32).min)
    assert torch.equal(padding_mask(symmetric, batch, length), real)


def test_padding_mask_refuses_a_real_query_that_sees_no_key():
    # query 0 of sequence 0 hides every key, yet the other queries see key 0: not a padding query
    mask = _real_tokens()[:, None, None, :].expand(3, 1, 5, 5).clone()
    mask[0, 0, 0, :] = False
    with pytest.raises(ValueError, match="differs between queries or heads"):
        padding_mask(mask, 3, 5)
    mask[0, 0, :, 0] = False  # now token 0 is padding in every row: its own row hiding every key is allowed
    expected = _real_tokens()
    expected[0, 0] = False
    assert torch.equal(padding_mask(mask, 3, 5), expected)


def test_padding_mask_broadcasts_a_shared_mask_over_the_batch():
    keys = torch.tensor([True, True, False, True])
    mask = keys.expand(4, 4)  # SDPA's (L, S) form, the same for every sequence
    assert torch.equal(padding_mask(mask, 3, 4), keys.expand(3, 4))
    assert padding_mask(None, 3, 4) is None


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(3, 5, 5, dtype=torch.bool).tril(), ValueError, "differs between queries"),
        (torch.zeros(3, 1, 5, 5).index_fill(-1, torch.tensor([1]), -0.5), ValueError, "attention bias"),
        # the message read "values in [nan, nan]" (transformers builds NaN masks from a torch.finfo.min extended mask)
        (
            torch.zeros(3, 1, 1, 5).index_fill(-1, torch.tensor([1]), torch.nan),
            ValueError,
            "hidden ones, got NaN entries$",
        ),
        (torch.ones(3, 4, dtype=torch.bool), ValueError, "broadcastable"),
        (torch.ones(5, dtype=torch.bool), ValueError, r"shape \(B, H, N, N\)"),
        (torch.ones(3, 1, 5, 5, dtype=torch.long), TypeError, "boolean or additive"),
        ([[True] * 5] * 3, TypeError, "torch.Tensor"),
    ],
)
def test_padding_mask_rejects(mask, error, match):
    with pytest.raises(error, match=match):
        padding_mask(mask, 3, 5)


def test_padding_mask_rejects_masks_that_differ_between_heads():
    mask = torch.ones(3, 2, 5, 5, dtype=torch.bool)
    mask[:, 1, :, 0] = False
    with pytest.raises(ValueError, match="differs between queries or heads"):
        padding_mask(mask, 3, 5)


# -- resolve_blocks ------------------------------------------------------------------------------------------------
def test_resolve_blocks_counts_negative_indices_from_the_end():
    assert resolve_blocks((-1,), 4, "here") == [3]
    assert resolve_blocks([0, -2], 4, "here") == [0, 2]


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        ((4,), ValueError, r"blocks\[0\] to be an integer in \[-4, 3\], got 4"),
        ((0, -5), ValueError, r"blocks\[1\]"),
        ((1, -3), ValueError, "same attention module twice"),
        ((), ValueError, "at least one"),
        (-1, TypeError, "sequence of integers"),
        ((1.0,), TypeError, r"blocks\[0\]"),
    ],
)
def test_resolve_blocks_rejects(blocks, error, match):
    with pytest.raises(error, match=match):
        resolve_blocks(blocks, 4, "here")


# -- build_layer and copy_projections ------------------------------------------------------------------------------
def _projections(bias: bool = True) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    generator = torch.Generator().manual_seed(0)
    return {
        role: (
            torch.randn(WIDTH, WIDTH, generator=generator, dtype=torch.float64),
            torch.randn(WIDTH, generator=generator, dtype=torch.float64) if bias else None,
        )
        for role in ("query", "key", "value", "output")
    }


def _layer(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    options = select_arguments(name, num_inducing=2)
    return build_layer(name, WIDTH, HEADS, options, torch.zeros((), dtype=torch.float64), "test")


# role -> the layer parameter (weight, bias) expected to hold it, per registered layer
EXPECTED_LINEAR = {
    "softmax": {"query": "q_proj", "key": "k_proj", "value": "v_proj", "output": "out_proj"},
    "svgp": {"query": "query_proj", "key": "key_proj", "output": "out_proj"},
    "sgpa": {"key": "key_proj", "value": "value_proj", "output": "out_proj"},
    "kep_svgp": {"output": "out_proj"},
    "kep_svgp_sym": {"output": "out_proj"},
    "primal": {"output": "out_proj"},
    "cgpt": {"query": "query_proj", "key": "key_proj", "value": "value_proj", "output": "out_proj"},
    "kep_svgp_paper": {"output": "out_proj"},
    "primal_paper": {"output": "out_proj"},
}
EXPECTED_HEADS = {
    "kep_svgp": {"query": "features.kernel.query_weight", "key": "features.kernel.key_weight"},
    "kep_svgp_sym": {"query": "features.kernel.query_weight"},
    "primal": {"query": "features.kernel.query_weight", "key": "features.kernel.key_weight"},
    "kep_svgp_paper": {"query": "features.kernel.query_weight", "key": "features.kernel.key_weight"},
    "primal_paper": {"query": "features.kernel.query_weight", "key": "features.kernel.key_weight"},
}


def test_every_registered_layer_has_an_expected_copy():
    assert set(EXPECTED_LINEAR) == set(attention_names())


@pytest.mark.parametrize("name", attention_names())
def test_copy_projections_copies_each_role_into_its_parameter(name):
    layer = _layer(name)
    projections = _projections()
    copied = copy_projections(layer, projections)
    expected_names = []
    for role, attribute in EXPECTED_LINEAR[name].items():
        weight, bias = projections[role]
        linear = getattr(layer, attribute)
        torch.testing.assert_close(linear.weight, weight, rtol=0, atol=0)
        expected_names.append(f"{attribute}.weight")
        if linear.bias is not None:
            torch.testing.assert_close(linear.bias, bias, rtol=0, atol=0)
            expected_names.append(f"{attribute}.bias")
    for role, path in EXPECTED_HEADS.get(name, {}).items():
        weight = projections[role][0]
        heads = layer.get_parameter(path)
        for head in range(HEADS):  # head h takes rows h p .. (h + 1) p - 1 of the weight
            rows = weight[head * HEAD_WIDTH : (head + 1) * HEAD_WIDTH]
            torch.testing.assert_close(heads[head], rows, rtol=0, atol=0)
        expected_names.append(path)
    assert sorted(copied) == sorted(expected_names)


def test_copy_projections_zeroes_a_target_bias_without_a_source_bias():
    layer = _layer("softmax")
    copy_projections(layer, _projections(bias=False))
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert torch.count_nonzero(getattr(layer, name).bias) == 0


def test_copy_projections_skips_kernel_weights_of_another_feature_dimension():
    torch.manual_seed(0)
    layer = build_attention("kep_svgp", WIDTH, HEADS, num_inducing=2, feature_dim=3).double()
    before = layer.features.kernel.query_weight.detach().clone()
    copied = copy_projections(layer, _projections())
    assert "features.kernel.query_weight" not in copied
    torch.testing.assert_close(layer.features.kernel.query_weight, before, rtol=0, atol=0)


def test_build_layer_places_the_layer_on_the_reference_dtype():
    layer = build_layer("softmax", WIDTH, HEADS, {}, torch.zeros((), dtype=torch.float64), "test")
    assert isinstance(layer, SoftmaxAttention) and layer.q_proj.weight.dtype == torch.float64


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"num_inducing": 9}, ValueError, r"embed_dim=8, num_heads=2 \(head width 4\).*num_inducing"),
        ({"num_heads": 4}, TypeError, "come from the converted model"),
        ({"rank": 2}, TypeError, "unexpected arguments"),
    ],
)
def test_build_layer_names_the_module_in_its_errors(options, error, match):
    with pytest.raises(error, match=match):
        build_layer("kep_svgp", WIDTH, HEADS, options, torch.zeros(()), "block 3")


# -- convert_modules -----------------------------------------------------------------------------------------------
class _Adapter(AttentionAdapter):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _stack() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Linear, _Adapter))


def _make_adapter(name: str, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: _Adapter(build_attention("softmax", WIDTH, HEADS))}


def test_convert_modules_replaces_the_chosen_modules():
    model = _stack()
    first = model[0]
    assert convert_modules(model, _is_linear, (-1,), "softmax", _make_adapter, "Linear", "test") is model
    assert model[0] is first and isinstance(model[1], _Adapter)
    with pytest.raises(ValueError, match=r"\['1'\] are already converted"):
        convert_modules(model, _is_linear, (1,), "softmax", _make_adapter, "Linear", "test")


def test_convert_modules_changes_nothing_when_a_block_fails():
    model = _stack()
    before = list(model)

    def failing(name: str, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        if name == "1":
            raise ValueError("cannot convert block 1")
        return _make_adapter(name, module)

    with pytest.raises(ValueError, match="cannot convert block 1"):
        convert_modules(model, _is_linear, (0, 1), "softmax", failing, "Linear", "test")
    assert list(model) == before


@pytest.mark.parametrize(
    ("model", "attention", "error", "match"),
    [
        (torch.nn.Sequential(torch.nn.ReLU()), "softmax", ValueError, r"no attention module.*expected Linear"),
        (_stack(), "performer", ValueError, "expected attention to be one of"),
        ("model", "softmax", TypeError, "expected a torch.nn.Module"),
        # the model itself is the slot: it cannot replace itself in place
        (torch.nn.Linear(WIDTH, WIDTH), "softmax", ValueError, r"is itself an attention module \(Linear\).*Sequential"),
    ],
)
def test_convert_modules_rejects(model, attention, error, match):
    with pytest.raises(error, match=match):
        convert_modules(model, _is_linear, (-1,), attention, _make_adapter, "Linear", "test")


def test_adapter_needs_a_gpattn_layer():
    with pytest.raises(TypeError, match="AttentionLayer"):
        _Adapter(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    "mask",
    [torch.ones(3, 1, 1, 0, dtype=torch.bool), torch.zeros(3, 2, 0, 0, dtype=torch.float64)],
    ids=["boolean", "additive"],
)
def test_padding_mask_of_an_empty_sequence_is_empty(mask):
    # an IndexError before; the layer then refuses the empty sequence by name
    result = padding_mask(mask, 3, 0)
    assert result.dtype == torch.bool and result.shape == (3, 0)
