"""Hugging Face conversion, for BERT, RoBERTa, DistilBERT and ViT built from tiny configs, with the ``eager``
(additive masks) and ``sdpa`` (boolean masks) attention implementations: ``attention="softmax"`` reproduces the model
(float64, with and without padding), ``kep_svgp`` changes only the converted layer, a converted model trains with
:class:`~gpattn.mlls.AttentionELBO` (fed the ``ModelOutput``) and predicts with
:func:`~gpattn.models.predict_probabilities` (fed a mapping of inputs), padding is honoured, and bad input gets a
clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from gpattn.attention import SoftmaxAttention, sample_attention
from gpattn.integrations.huggingface import HuggingFaceAttentionAdapter, convert_attention
from gpattn.mlls import AttentionELBO
from gpattn.models import predict_probabilities

WIDTH, HEADS, LAYERS, CLASSES = 16, 2, 2, 3
BATCH, LENGTH, VOCAB = 4, 9, 40
IMAGE, PATCH = 12, 4
PATCH_TOKENS = (IMAGE // PATCH) ** 2 + 1  # patches and the class token
FAMILIES = ("bert", "roberta", "distilbert", "vit")
IMPLEMENTATIONS = ("eager", "sdpa")
# the acceptance is 1e-5; float64 gives ~1e-17, except ViT's eager attention, whose softmax runs in float32 (~1e-8)
ATOL, VIT_EAGER_ATOL = 1e-12, 1e-6


TEXT = {
    "hidden_size": WIDTH,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": 2 * WIDTH,
    "vocab_size": VOCAB,
    "max_position_embeddings": LENGTH + 4,
}
#: family -> (config class, model class, configuration)
FAMILY_MODELS = {
    "bert": (transformers.BertConfig, transformers.BertForSequenceClassification, TEXT),
    "roberta": (transformers.RobertaConfig, transformers.RobertaForSequenceClassification, TEXT),
    "distilbert": (
        transformers.DistilBertConfig,
        transformers.DistilBertForSequenceClassification,
        {"dim": WIDTH, "n_layers": LAYERS, "n_heads": HEADS, "hidden_dim": 2 * WIDTH, "vocab_size": VOCAB},
    ),
    "vit": (
        transformers.ViTConfig,
        transformers.ViTForImageClassification,
        {
            "hidden_size": WIDTH,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "intermediate_size": 2 * WIDTH,
            "image_size": IMAGE,
            "patch_size": PATCH,
        },
    ),
}


def _model(family: str, implementation: str = "sdpa", seed: int = 0, **options) -> torch.nn.Module:
    config_cls, model_cls, config = FAMILY_MODELS[family]
    torch.manual_seed(seed)
    config = config_cls(**config, num_labels=CLASSES, attn_implementation=implementation, **options)
    return model_cls(config).double().eval()


def _real_tokens(length: int) -> torch.Tensor:
    """Sequence 1 hides its last 3 tokens, sequence 2 all but the first 2."""
    real = torch.ones(BATCH, length, dtype=torch.long)
    real[1, -3:] = 0
    real[2, 2:] = 0
    return real


def _inputs(family: str, masked: bool, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    if family == "vit":
        inputs = {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, dtype=torch.float64, generator=generator)}
        length = PATCH_TOKENS
    else:  # ids from 2 on: RoBERTa's padding id is 1 and its positions count the other ids
        inputs = {"input_ids": torch.randint(2, VOCAB, (BATCH, LENGTH), generator=generator)}
        length = LENGTH
    if masked:
        inputs["attention_mask"] = _real_tokens(length)
    return inputs


def _encoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = model.base_model
    return (
        base.layers
        if hasattr(base, "layers")
        else (base.encoder if hasattr(base, "encoder") else base.transformer).layer
    )


def _hidden(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.base_model(**inputs).last_hidden_state


# -- equivalence ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "padding"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_conversion_reproduces_the_model(family, implementation, masked):
    model = _model(family, implementation)
    inputs = _inputs(family, masked)
    atol = VIT_EAGER_ATOL if (family, implementation) == ("vit", "eager") else ATOL
    converted = convert_attention(copy.deepcopy(model), "softmax", blocks=(0, 1))
    adapters = [module for module in converted.modules() if isinstance(module, HuggingFaceAttentionAdapter)]
    assert len(adapters) == LAYERS
    with torch.no_grad():
        torch.testing.assert_close(converted(**inputs).logits, model(**inputs).logits, rtol=0, atol=atol)
        torch.testing.assert_close(_hidden(converted, inputs), _hidden(model, inputs), rtol=0, atol=atol)
        if masked:  # the mask matters: without it the outputs differ
            unmasked = {key: value for key, value in inputs.items() if key != "attention_mask"}
            assert not torch.allclose(_hidden(model, unmasked), _hidden(model, inputs), rtol=0, atol=1e-3)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_the_output_projection_moves_into_the_layer(family):
    model = _model(family)
    dense = _encoder_layers(model)[-1].attention.output.dense
    converted = convert_attention(copy.deepcopy(model), "kep_svgp", num_inducing=4)
    attention = _encoder_layers(converted)[-1].attention
    assert isinstance(attention.output.dense, torch.nn.Identity)
    torch.testing.assert_close(attention.self.layer.out_proj.weight, dense.weight, rtol=0, atol=0)
    torch.testing.assert_close(attention.self.layer.out_proj.bias, dense.bias, rtol=0, atol=0)
    assert "out_proj.weight" in attention.self.copied
    assert not isinstance(_encoder_layers(converted)[0].attention.output.dense, torch.nn.Identity)


@pytest.mark.parametrize("family", FAMILIES)
def test_kep_conversion_changes_only_the_converted_layer(family):
    model = _model(family)
    converted = convert_attention(copy.deepcopy(model), "kep_svgp", blocks=(0,), num_inducing=4)
    calls = []
    handles = [
        layer.register_forward_hook(
            lambda module, args, kwargs, output: calls.append((args, kwargs, output)), with_kwargs=True
        )
        for layer in _encoder_layers(converted)
    ]
    with torch.no_grad():
        converted(**_inputs(family, masked=True))
        for handle in handles:
            handle.remove()
        for index, (args, kwargs, output) in enumerate(calls):
            original = _encoder_layers(model)[index](*args, **kwargs)  # the original layer on the same input
            if index == 0:
                assert (output - original).abs().max() > 1e-3
            else:
                torch.testing.assert_close(output, original, rtol=0, atol=0)
    assert len(calls) == LAYERS


# -- training, prediction, masks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_trains_with_attention_elbo(family):
    model = convert_attention(_model(family), "kep_svgp", blocks=(-1,), num_inducing=4).train()
    layer = next(module.layer for module in model.modules() if isinstance(module, HuggingFaceAttentionAdapter))
    elbo = AttentionELBO(model, num_data=64, combine_terms=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs, targets = _inputs(family, masked=True), torch.arange(BATCH) % CLASSES
    for _ in range(3):
        optimizer.zero_grad()
        output = model(**inputs)  # a ModelOutput: AttentionELBO reads its logits
        parts = elbo(output, targets)
        torch.testing.assert_close(parts["nll"], torch.nn.functional.cross_entropy(output.logits, targets))
        torch.testing.assert_close(parts["kl"], layer.kl_divergence() / 64, rtol=1e-12, atol=0)
        assert parts["kl"] > 0 and parts["ksvd"] > 0
        parts["loss"].backward()
        q_u = layer.strategy._variational_distribution
        for parameter in (q_u.variational_mean, layer.features.raw_singular_values):
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0
        optimizer.step()
    assert torch.isfinite(parts["loss"])


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_predict_probabilities_takes_a_mapping_of_inputs(family):
    model = convert_attention(_model(family), "kep_svgp", num_inducing=4)
    inputs = _inputs(family, masked=True)
    torch.manual_seed(3)
    probabilities = predict_probabilities(model, inputs, num_samples=5)
    torch.manual_seed(3)
    with sample_attention(model), torch.no_grad():
        expected = torch.stack([model(**inputs).logits.softmax(-1) for _ in range(5)]).mean(0)
    torch.testing.assert_close(probabilities, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(BATCH, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((probabilities >= 0).all())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_does_not_change_the_real_tokens(family, implementation):
    """Hidden tokens change (ids, or the pixels of hidden patches); the real tokens' outputs do not (eval mode)."""
    model = convert_attention(_model(family, implementation), "kep_svgp", blocks=(0, 1), num_inducing=4)
    inputs = _inputs(family, masked=True)
    changed = dict(inputs)
    if family == "vit":
        changed["pixel_values"] = inputs["pixel_values"].clone()
        changed["pixel_values"][2, :, PATCH:] = 100.0  # sequence 2 keeps the class token and the first patch only
    else:
        changed["input_ids"] = torch.where(inputs["attention_mask"].bool(), inputs["input_ids"], VOCAB - 1)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        torch.testing.assert_close(_hidden(model, changed)[real], _hidden(model, inputs)[real])
        unmasked = {key: value for key, value in changed.items() if key != "attention_mask"}
        original = {key: value for key, value in inputs.items() if key != "attention_mask"}
        assert not torch.allclose(_hidden(model, unmasked)[real], _hidden(model, original)[real])


def test_the_adapter_reads_two_dimensional_masks_and_refuses_cross_attention():
    adapter = next(
        module
        for module in convert_attention(_model("distilbert"), "softmax").modules()
        if isinstance(module, HuggingFaceAttentionAdapter)
    )
    tokens = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64)
    real = _real_tokens(LENGTH)
    output, weights = adapter(tokens, real)
    assert weights is None
    torch.testing.assert_close(output, adapter(tokens, real.bool()[:, None, None, :])[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"self-attention only, got \['encoder_hidden_states'\]"):
        adapter(tokens, real, encoder_hidden_states=tokens)


@pytest.mark.parametrize("hidden", [float("-inf"), torch.finfo(torch.float64).min, -1e4], ids=["-inf", "min", "-1e4"])
def test_the_adapter_reads_two_dimensional_additive_masks(hidden):
    """A 2-D additive mask (0 = real token) hides the padding as the keep-mask does, and as the replaced module does
    with the 4-D additive mask of its eager path; rows 0 and 3 are all zeros (nothing hidden)."""
    model = _model("distilbert", "eager")
    original = _encoder_layers(model)[-1].attention  # DistilBertSelfAttention, its output projection inside
    adapter = _encoder_layers(convert_attention(copy.deepcopy(model), "softmax"))[-1].attention
    tokens = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    real = _real_tokens(LENGTH)
    zero, lowest = torch.tensor(0.0, dtype=torch.float64), torch.finfo(torch.float64).min
    additive = torch.where(real.bool(), zero, torch.tensor(hidden, dtype=torch.float64))
    with torch.no_grad():
        output, weights = adapter(tokens, additive)
        assert weights is None
        eager_mask = torch.where(real.bool(), zero, torch.tensor(lowest, dtype=torch.float64))[:, None, None, :]
        reference = original(tokens, attention_mask=eager_mask)[0]
        torch.testing.assert_close(output, reference, rtol=0, atol=ATOL)
        torch.testing.assert_close(output, adapter.layer(tokens, mask=real.bool()), rtol=0, atol=0)
        for keep in (real, real.bool(), real.double()):  # the model's 0/1 argument, the flash path's, 0/1 floats
            torch.testing.assert_close(output, adapter(tokens, keep)[0], rtol=0, atol=0)
        unmasked = adapter(tokens)[0]
        torch.testing.assert_close(output[[0, 3]], unmasked[[0, 3]], rtol=0, atol=0)  # all-zero rows hide nothing
        assert (output[[1, 2]] - unmasked[[1, 2]]).abs().max() > 1e-3  # the padding was hidden


@pytest.mark.parametrize(
    "values",
    [[1.0, 0.5], [1.0, float("-inf")], [0.0, -5.0], [1.0, float("nan")], [1, 2]],
    ids=["half", "keep-and-additive", "bias", "nan", "integer-2"],
)
def test_the_adapter_refuses_two_dimensional_masks_of_neither_form(values):
    adapter = HuggingFaceAttentionAdapter(SoftmaxAttention(WIDTH, HEADS).double().eval())
    tokens = torch.randn(1, 4, WIDTH, dtype=torch.float64)
    mask = torch.tensor([[values[0], values[0], values[0], values[1]]])
    mask = mask.double() if mask.is_floating_point() else mask
    with pytest.raises(ValueError, match=r"HuggingFaceAttentionAdapter: a 2-D attention_mask must be a keep-mask"):
        adapter(tokens, mask)
    # a NaN is named as such (the range read "[nan, nan]")
    low, high = float(min(values)), float(max(values))
    tail = r"with NaN entries$" if values[1] != values[1] else rf"with values in \[{low}, {high}\]$"
    with pytest.raises(ValueError, match=tail):
        adapter(tokens, mask)


def test_a_floating_mask_of_zeros_only_is_refused_as_ambiguous():
    # a keep-mask hiding every token, or an additive mask hiding none: neither is guessed (a long all-zero mask is the
    # model's argument hiding every token, refused as such)
    adapter = HuggingFaceAttentionAdapter(SoftmaxAttention(WIDTH, HEADS).double().eval())
    tokens = torch.randn(2, 4, WIDTH, dtype=torch.float64)
    with pytest.raises(ValueError, match="of zeros only is ambiguous"):
        adapter(tokens, torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="hides every token"):
        adapter(tokens, torch.zeros(2, 4, dtype=torch.long))


# -- errors --------------------------------------------------------------------------------------------------------
class BertSelfAttention(torch.nn.Module):  # a module of another layout under a registered class name
    num_attention_heads = 2

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)


def _bert_self_attention() -> torch.nn.Module:
    config = transformers.BertConfig(hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=32)
    return transformers.models.bert.modeling_bert.BertSelfAttention(config)


@pytest.mark.parametrize(
    ("model", "attention", "options", "error", "match"),
    [
        (
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            "softmax",
            {},
            ValueError,
            r"no attention module.*BertSelfAttention",
        ),
        (_model("bert"), "softmax", {"blocks": (2,)}, ValueError, r"blocks\[0\] to be an integer in \[-2, 1\], got 2"),
        (_model("bert"), "performer", {}, ValueError, "expected attention to be one of"),
        (_model("roberta"), "kep_svgp", {"num_inducing": 9}, ValueError, r"layer.1.attention.self.*head width 8"),
        (_model("distilbert"), "sgpa", {"embed_dim": 8}, TypeError, "come from the converted model"),
        (_model("vit", head_dim=4), "softmax", {}, ValueError, r"'attention width': 8"),
        (torch.nn.Sequential(BertSelfAttention()), "softmax", {}, ValueError, "lays the module out differently"),
        (
            torch.nn.Sequential(_bert_self_attention()),  # outside its BertAttention: no output projection beside it
            "softmax",
            {},
            ValueError,
            r"\(0\): the output projection of a BertSelfAttention is its parent's output.dense .*its parent "
            r"Sequential has none",
        ),
    ],
)
def test_convert_attention_rejects(model, attention, options, error, match):
    with pytest.raises(error, match=match):
        convert_attention(model, attention, **options)


def test_causal_self_attention_is_rejected():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=HEADS, intermediate_size=32, is_decoder=True
    )
    with pytest.raises(ValueError, match="causal"):
        convert_attention(transformers.BertModel(config), "softmax")


def test_a_converted_layer_cannot_be_converted_again():
    model = convert_attention(_model("vit"), "softmax", blocks=(0,))
    with pytest.raises(ValueError, match=r"\['vit.layers.0.attention'\] are already converted"):
        convert_attention(model, "kep_svgp", blocks=(0,))


def test_a_cache_is_refused():
    # transformers 5 passes the cache as ``cache`` (formerly ``past_key_values``); it used to be ignored silently
    adapter = HuggingFaceAttentionAdapter(SoftmaxAttention(WIDTH, HEADS).double().eval())
    tokens = torch.randn(2, 4, WIDTH, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"self-attention only, got \['cache'\]"):
        adapter(tokens, cache=transformers.DynamicCache())


def test_flex_attention_masks_are_refused_by_name():
    # an encoder built with attn_implementation="flex_attention" passes its layers a BlockMask, padding or not (an
    # AttributeError before); the model's own flex path compiles on first call, too slow here, so the mask is built
    # directly
    create_block_mask = pytest.importorskip("torch.nn.attention.flex_attention").create_block_mask
    adapter = HuggingFaceAttentionAdapter(SoftmaxAttention(WIDTH, HEADS).double().eval())
    tokens = torch.randn(2, 4, WIDTH, dtype=torch.float64)
    block_mask = create_block_mask(lambda batch, head, query, key: key < 3, 2, None, 4, 4, device="cpu")
    with pytest.raises(TypeError, match=r"got BlockMask.*set_attn_implementation\('sdpa'\)"):
        adapter(tokens, block_mask)


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_output_attentions_is_refused(family):
    # the recorded attentions came from the unconverted layers only: with layer 0 converted, attentions[0] was layer
    # 1's weights and the tuple one entry short, silently
    model = _model(family, "eager")
    inputs = _inputs(family, masked=family != "vit")
    with torch.no_grad():
        assert len(model(**inputs, output_attentions=True).attentions) == LAYERS
        converted = convert_attention(copy.deepcopy(model), "softmax", blocks=(0,))
        with pytest.raises(ValueError, match="got output_attentions=True, but a gpattn layer has no attention weights"):
            converted(**inputs, output_attentions=True)
        converted(**inputs, output_attentions=False)  # asking for none is fine


def test_a_causal_call_is_refused():
    # the sdpa path of the replaced module honours is_causal=True (its output changes); the layer ignored it
    model = _model("bert", "sdpa")
    inputs = _inputs("bert", masked=False)
    converted = convert_attention(copy.deepcopy(model), "softmax", blocks=(0, 1))
    with torch.no_grad():
        assert not torch.allclose(_hidden(model, {**inputs, "is_causal": True}), _hidden(model, inputs), atol=1e-3)
        with pytest.raises(ValueError, match="got is_causal=True"):
            _hidden(converted, {**inputs, "is_causal": True})
        torch.testing.assert_close(_hidden(converted, {**inputs, "is_causal": False}), _hidden(model, inputs))


def test_packed_sequences_are_refused():
    adapter = HuggingFaceAttentionAdapter(SoftmaxAttention(WIDTH, HEADS).double().eval())
    tokens = torch.randn(1, 4, WIDTH, dtype=torch.float64)
    lengths = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"got \['cu_seq_lens_q', 'cu_seq_lens_k'\] \(sequences packed"):
        adapter(tokens, cu_seq_lens_q=lengths, cu_seq_lens_k=lengths, max_length_q=2, max_length_k=2)
