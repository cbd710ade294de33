"""timm conversion: ``attention="softmax"`` reproduces a config-built ViT (float64, with and without padding masks),
``kep_svgp`` changes only the converted block (each block checked on the inputs it received), a converted model
trains with :class:`~gpattn.mlls.AttentionELBO` and predicts with :func:`~gpattn.models.predict_probabilities`, masks
are honoured, and bad input gets a clear error."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

from gpattn.attention import (
    KEPSVGPAttention,
    SoftmaxAttention,
    register_attention,
    sample_attention,
    unregister_attention,
)
from gpattn.integrations.timm import TimmAttentionAdapter, convert_attention
from gpattn.mlls import AttentionELBO
from gpattn.models import predict_probabilities

WIDTH, HEADS, DEPTH, CLASSES = 16, 2, 3, 3
IMAGE, PATCH = 16, 4
TOKENS = (IMAGE // PATCH) ** 2 + 1  # patches and the class token
ATOL = 1e-12  # the acceptance is 1e-5; float64 gives ~1e-16


def _vit(seed: int = 0, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = dict(img_size=IMAGE, patch_size=PATCH, embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS, num_classes=CLASSES)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**config, **options}).double().eval()


def _images(batch: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, IMAGE, IMAGE, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _real_tokens(batch: int = 4) -> torch.Tensor:
    """The class token and the first patches are real; sequence 1 hides its last 4 patches, sequence 2 its last 9
    (the bottom patch rows)."""
    real = torch.ones(batch, TOKENS, dtype=torch.bool)
    real[1, -4:] = False
    real[2, -9:] = False
    return real


def _masks() -> dict[str, torch.Tensor | None]:
    real = _real_tokens()
    additive = torch.zeros(real.shape, dtype=torch.float64).masked_fill(~real, -torch.inf)
    return {"none": None, "boolean": real[:, None, None, :], "additive": additive[:, None, None, :]}


# -- equivalence ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["none", "boolean", "additive"])
@pytest.mark.parametrize("blocks", [(-1,), (0, 1, 2)])
def test_softmax_conversion_reproduces_the_model(blocks, mask):
    model = _vit()
    attn_mask = _masks()[mask]
    expected = model(_images(), attn_mask=attn_mask)
    converted = convert_attention(copy.deepcopy(model), "softmax", blocks=blocks)
    assert sum(isinstance(block.attn, TimmAttentionAdapter) for block in converted.blocks) == len(blocks)
    torch.testing.assert_close(converted(_images(), attn_mask=attn_mask), expected, rtol=0, atol=ATOL)
    if mask != "none":  # the mask matters: without it the outputs differ
        assert not torch.allclose(model(_images()), expected, rtol=0, atol=1e-3)


def test_softmax_conversion_reproduces_causal_attention():
    model = _vit(qkv_bias=False)
    tokens = torch.randn(2, TOKENS, WIDTH, dtype=torch.float64)
    expected = model.blocks[0].attn(tokens, is_causal=True)
    converted = convert_attention(copy.deepcopy(model), "softmax", blocks=(0,))
    assert "q_proj.bias" in converted.blocks[0].attn.copied  # zeroed: the module has no qkv bias
    torch.testing.assert_close(converted.blocks[0].attn(tokens, is_causal=True), expected, rtol=0, atol=ATOL)


def _block_calls(model: torch.nn.Module, images: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every block in one forward pass."""
    calls = []
    handles = [
        block.register_forward_hook(lambda module, args, output: calls.append((args[0], output)))
        for block in model.blocks
    ]
    model(images)
    for handle in handles:
        handle.remove()
    return calls


def test_kep_conversion_changes_only_the_converted_block():
    model = _vit()
    converted = convert_attention(copy.deepcopy(model), "kep_svgp", blocks=(1,), num_inducing=4)
    assert isinstance(converted.blocks[1].attn.layer, KEPSVGPAttention)
    with torch.no_grad():
        calls = _block_calls(converted, _images())
        for index, (inputs, output) in enumerate(calls):
            original = model.blocks[index](inputs)  # the original block on the input the converted one received
            if index == 1:
                assert (output - original).abs().max() > 1e-3
            else:
                torch.testing.assert_close(output, original, rtol=0, atol=0)


def test_replacements_take_the_training_mode_of_the_replaced_module():
    model = _vit()
    model.blocks[0].train()
    converted = convert_attention(model, "kep_svgp", blocks=(0, 1), num_inducing=4)
    assert converted.blocks[0].attn.training and converted.blocks[0].attn.layer.training
    assert not converted.blocks[1].attn.training and not converted.blocks[1].attn.layer.training


def test_kep_conversion_copies_the_kernel_and_output_weights():
    model = _vit()
    source = model.blocks[-1].attn
    layer = convert_attention(copy.deepcopy(model), "kep_svgp", num_inducing=4).blocks[-1].attn.layer
    query, key, _ = source.qkv.weight.chunk(3)
    kernel = layer.features.kernel
    torch.testing.assert_close(kernel.query_weight, query.reshape(HEADS, WIDTH // HEADS, WIDTH), rtol=0, atol=0)
    torch.testing.assert_close(kernel.key_weight, key.reshape(HEADS, WIDTH // HEADS, WIDTH), rtol=0, atol=0)
    torch.testing.assert_close(layer.out_proj.weight, source.proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(layer.out_proj.bias, source.proj.bias, rtol=0, atol=0)
    assert layer.out_proj.weight.dtype == torch.float64


def test_output_dropout_carries_over_unless_set():
    model = _vit(proj_drop_rate=0.25)
    assert convert_attention(copy.deepcopy(model), "softmax").blocks[-1].attn.layer.dropout.p == 0.25
    assert convert_attention(copy.deepcopy(model), "softmax", dropout=0.0).blocks[-1].attn.layer.dropout.p == 0.0
    # a registered layer taking **kwargs (the form register_attention asks for) gets it too
    register_attention("keywords", _KeywordsOnly)
    try:
        assert convert_attention(copy.deepcopy(model), "keywords").blocks[-1].attn.layer.dropout.p == 0.25
    finally:
        unregister_attention("keywords")


class _KeywordsOnly(SoftmaxAttention):
    def __init__(self, embed_dim: int, num_heads: int, **kwargs):
        super().__init__(embed_dim, num_heads, **kwargs)


# -- training, prediction, masks -----------------------------------------------------------------------------------
def test_converted_model_trains_with_attention_elbo():
    model = convert_attention(_vit(), "kep_svgp", blocks=(-1,), num_inducing=4).train()
    layer = model.blocks[-1].attn.layer
    elbo = AttentionELBO(model, num_data=64, combine_terms=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    images, targets = _images(8), torch.arange(8) % CLASSES
    mean_before = layer.strategy._variational_distribution.variational_mean.detach().clone()
    for _ in range(3):
        optimizer.zero_grad()
        parts = elbo(model(images), targets)
        parts["loss"].backward()
        # the KL is the layer's (the only GP layer), the KSVD term the layer's added loss term
        torch.testing.assert_close(parts["kl"], layer.kl_divergence() / 64, rtol=1e-12, atol=0)
        torch.testing.assert_close(parts["ksvd"], next(layer.added_loss_terms()).loss(), rtol=1e-12, atol=0)
        assert parts["kl"] > 0 and parts["ksvd"] > 0
        q_u = layer.strategy._variational_distribution
        for parameter in (q_u.variational_mean, layer.features.raw_singular_values):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0
        optimizer.step()
    assert torch.isfinite(parts["loss"])
    assert not torch.equal(layer.strategy._variational_distribution.variational_mean, mean_before)


def test_predict_probabilities_averages_samples_of_a_converted_model():
    model = convert_attention(_vit(), "kep_svgp", num_inducing=4)
    images = _images()
    torch.manual_seed(3)
    probabilities = predict_probabilities(model, images, num_samples=5)
    torch.manual_seed(3)
    with sample_attention(model), torch.no_grad():
        expected = torch.stack([model(images).softmax(-1) for _ in range(5)]).mean(0)
    torch.testing.assert_close(probabilities, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((probabilities >= 0).all())
    assert not torch.allclose(predict_probabilities(model, images, num_samples=1), probabilities)


@pytest.mark.parametrize("attention", ["kep_svgp", "sgpa", "svgp", "primal"])
def test_padding_does_not_change_the_real_tokens(attention):
    """Pixels of the hidden patches change; the class token, and so the logits, do not (eval mode)."""
    model = convert_attention(_vit(), attention, blocks=(0, -1), num_inducing=4)
    real = _real_tokens()
    images = _images()
    changed = images.clone()
    changed[2, :, -2 * PATCH :] = 100.0  # sequence 2 hides its last 9 patches: the two bottom rows are hidden
    attn_mask = real[:, None, None, :]
    with torch.no_grad():
        torch.testing.assert_close(model(changed, attn_mask=attn_mask), model(images, attn_mask=attn_mask))
        assert not torch.allclose(model(changed), model(images))


# -- errors --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "attention", "options", "error", "match"),
    [
        (torch.nn.Sequential(torch.nn.Linear(4, 4)), "softmax", {}, ValueError, "no attention module"),
        (_vit(), "softmax", {"blocks": (3,)}, ValueError, r"blocks\[0\] to be an integer in \[-3, 2\], got 3"),
        (_vit(), "performer", {}, ValueError, "expected attention to be one of"),
        (_vit(), "kep_svgp", {"num_inducing": 9}, ValueError, r"blocks.2.attn.*head width 8.*num_inducing"),
        (_vit(), "sgpa", {"num_heads": 4}, TypeError, "come from the converted model"),
        (_vit(qk_norm=True), "softmax", {}, ValueError, r"uses \['qk_norm'\]"),
    ],
)
def test_convert_attention_rejects(model, attention, options, error, match):
    with pytest.raises(error, match=match):
        convert_attention(model, attention, **options)


def test_a_module_whose_attention_width_differs_is_rejected():
    model = _vit()
    model.blocks[-1].attn = timm.layers.Attention(WIDTH, num_heads=HEADS, attn_head_dim=4).double()  # 2 x 4 != 16
    with pytest.raises(ValueError, match=r"'attention width': 8"):
        convert_attention(model, "softmax")


def test_a_converted_block_cannot_be_converted_again():
    model = convert_attention(_vit(), "softmax")
    with pytest.raises(ValueError, match=r"\['blocks.2.attn'\] are already converted"):
        convert_attention(model, "kep_svgp", blocks=(2,))
    convert_attention(model, "kep_svgp", blocks=(0,), num_inducing=4)  # the others still can
    assert isinstance(model.blocks[0].attn.layer, KEPSVGPAttention)


def test_softmax_conversion_reproduces_a_padded_naflex_vit():
    # NaFlexViT masks padding patches symmetrically (valid[q] & valid[k]); such masks were refused as "differs between
    # queries"; the pooled output excludes the padding, so it is the same
    from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg

    torch.manual_seed(0)
    config = NaFlexVitCfg(patch_size=PATCH, embed_dim=WIDTH, depth=2, num_heads=HEADS, global_pool="avg", fc_norm=True)
    model = NaFlexVit(config, num_classes=CLASSES).double().eval()
    generator = torch.Generator().manual_seed(1)
    patches = torch.randn(2, 9, PATCH * PATCH * 3, dtype=torch.float64, generator=generator)
    grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(3), indexing="ij"), -1).reshape(1, 9, 2)
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 5:] = False
    inputs = {"patches": patches, "patch_coord": grid.expand(2, -1, -1), "patch_valid": valid}
    converted = convert_attention(copy.deepcopy(model), "softmax", blocks=(0, 1))
    with torch.no_grad():
        expected = model(inputs)
        torch.testing.assert_close(converted(inputs), expected, rtol=0, atol=ATOL)
        changed = dict(inputs, patches=patches.clone().index_fill(1, torch.tensor([7]), 100.0))
        torch.testing.assert_close(converted(changed)[1], expected[1], rtol=0, atol=ATOL)  # padding is ignored
        assert not torch.allclose(converted(changed)[0], expected[0], rtol=0, atol=1e-3)  # a real patch is not


def test_a_mask_the_layer_cannot_take_is_rejected_at_call_time():
    model = convert_attention(_vit(), "softmax")
    causal = torch.ones(TOKENS, TOKENS, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="differs between queries"):
        model(_images(), attn_mask=causal)


def test_a_causal_call_with_a_padding_mask_is_refused():
    """timm's default (fused) path applies both masks, which no gpattn layer can; the causal mask alone (what the
    adapter computed before, silently) differs from it."""
    model = _vit()
    tokens = torch.randn(2, TOKENS, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    attn_mask = _real_tokens()[:2, None, None, :]  # sequence 1 hides its last 4 patches
    original = model.blocks[0].attn
    original.fused_attn = True  # the default wherever torch has SDPA (TIMM_FUSED_ATTN may turn it off)
    with torch.no_grad():
        both = original(tokens, attn_mask=attn_mask, is_causal=True)
        assert (both - original(tokens, is_causal=True)).abs().max() > 1e-3  # the padding mask matters to timm
    converted = convert_attention(copy.deepcopy(model), "softmax", blocks=(0,)).blocks[0].attn
    with pytest.raises(ValueError, match="is_causal=True and an attn_mask"):
        converted(tokens, attn_mask=attn_mask, is_causal=True)
