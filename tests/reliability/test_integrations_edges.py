"""The timm and Hugging Face conversions (:mod:`gpattn.integrations`) at their edges, on models built from tiny configs
(no downloads): every registered attention's parameters get gradients through :class:`~gpattn.mlls.AttentionELBO`
in a converted ViT and BERT, ``attention="softmax"`` reproduces the model in train mode too (dropout rates 0),
gradient checkpointing replays the sampled attention exactly, bfloat16 models get bfloat16 layers, shared and
cross-attention modules, decoder-only models, and the all-or-nothing replacement when a later block fails.

The defects these tests recorded (attentions asked for through the config, a shared attention module converted in
one place only, a bare ``BertAttention``, key/value widths reported without the module path) are fixed."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import gpattn.integrations  # noqa: F401  (makes torchvision importable before timm and transformers)
from gpattn.attention import attention_names, select_arguments
from gpattn.integrations.conversion import build_layer, convert_modules
from gpattn.integrations.huggingface import HuggingFaceAttentionAdapter
from gpattn.integrations.huggingface import convert_attention as convert_huggingface
from gpattn.integrations.timm import TimmAttentionAdapter
from gpattn.integrations.timm import convert_attention as convert_timm
from gpattn.mlls import AttentionELBO

timm = importlib.import_module("timm")
transformers = importlib.import_module("transformers")
Attention = importlib.import_module("timm.models.vision_transformer").Attention

WIDTH, HEADS, CLASSES = 16, 2, 3
IMAGE, PATCH = 8, 4
BATCH, LENGTH, VOCAB = 3, 7, 30
ATOL = 1e-12  # float64 gives ~1e-16


# -- helpers -----------------------------------------------------------------------------------------------------------
def _vit(depth: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = dict(img_size=IMAGE, patch_size=PATCH, embed_dim=WIDTH, depth=depth, num_heads=HEADS, num_classes=CLASSES)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**config, **options}).to(dtype).eval()


def _images(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)


def _bert_config(layers: int = 2, **options) -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
        vocab_size=VOCAB, max_position_embeddings=LENGTH + 4, num_labels=CLASSES, **options,
    )  # fmt: skip


def _bert(seed: int = 0, **options) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.BertForSequenceClassification(_bert_config(**options)).double().eval()


def _text() -> dict[str, torch.Tensor]:
    """Sequence 1 hides its last 3 tokens (ids from 2 on)."""
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, -3:] = 0
    ids = torch.randint(2, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "attention_mask": mask}


def _adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    adapters = (TimmAttentionAdapter, HuggingFaceAttentionAdapter)
    names = [name for name, module in model.named_modules() if isinstance(module, adapters)]
    assert names
    return {
        name: parameter
        for name, parameter in model.named_parameters()
        if any(name.startswith(f"{prefix}.") for prefix in names)
    }


# -- gradients -----------------------------------------------------------------------------------------------------
def _assert_every_parameter_learns(model: torch.nn.Module, output, targets: torch.Tensor) -> None:
    """One ELBO backward pass: every trainable parameter gets a finite gradient, every parameter of the converted
    layers (copied or fresh) a non-zero one."""
    AttentionELBO(model, num_data=10)(output, targets).backward()
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
    converted = _adapter_parameters(model)
    zero = [name for name, parameter in converted.items() if not bool(parameter.grad.abs().sum() > 0)]
    assert zero == []


@pytest.mark.parametrize("name", attention_names())
def test_every_parameter_of_a_converted_vit_gets_a_gradient(name):
    model = convert_timm(_vit().train(), name, blocks=(0, 1), **select_arguments(name, num_inducing=4))
    torch.manual_seed(3)
    _assert_every_parameter_learns(model, model(_images()), torch.tensor([0, 2]))


@pytest.mark.parametrize("name", attention_names())
def test_every_parameter_of_a_converted_bert_gets_a_gradient(name):
    # the output projection moved from BertSelfOutput.dense into the layer: it must still learn
    model = convert_huggingface(_bert().train(), name, blocks=(0, 1), **select_arguments(name, num_inducing=4))
    assert [name for name, _ in model.named_parameters() if ".attention.output.dense." in name] == []
    torch.manual_seed(3)
    _assert_every_parameter_learns(model, model(**_text()), torch.tensor([0, 1, 2]))


# -- modes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["timm", "bert"])
def test_softmax_conversion_reproduces_the_model_in_train_mode(family):
    # with every dropout rate 0, train mode changes nothing in the replaced modules: nor may it in the layers
    if family == "timm":
        model = _vit().train()
        converted = convert_timm(copy.deepcopy(model), "softmax", blocks=(0, 1))
        expected, output = model(_images()), converted(_images())
    else:
        model = _bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
        converted = convert_huggingface(copy.deepcopy(model), "softmax", blocks=(0, 1))
        expected, output = model(**_text()).logits, converted(**_text()).logits
    assert all(module.training for module in converted.modules())
    torch.testing.assert_close(output, expected, rtol=0, atol=ATOL)


def test_gradient_checkpointing_replays_the_sampled_attention():
    """In train mode the KEP-SVGP layer samples its attention; the checkpointed layer's recomputation must draw the
    same sample, so that logits and gradients equal those of the plain pass from the same seed."""
    targets = torch.tensor([0, 1, 2])

    def run(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = convert_huggingface(_bert().train(), "kep_svgp", blocks=(0, 1), num_inducing=4)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(3)
        output = model(**_text())
        AttentionELBO(model, num_data=10)(output, targets).backward()
        return output.logits.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    logits, gradients = run(checkpointing=False)
    checkpointed_logits, checkpointed_gradients = run(checkpointing=True)
    torch.testing.assert_close(checkpointed_logits, logits, rtol=0, atol=0)
    assert checkpointed_gradients.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(checkpointed_gradients[name], gradient, rtol=0, atol=ATOL, msg=name)


# -- dtype ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["softmax", "kep_svgp"])
def test_a_bfloat16_vit_gets_bfloat16_layers(name):
    model = _vit(dtype=torch.bfloat16)
    reference = model(_images(torch.bfloat16)).double()
    converted = convert_timm(copy.deepcopy(model), name, blocks=(0,), **select_arguments(name, num_inducing=4))
    adapter = converted.blocks[0].attn
    floating = [t for t in [*adapter.parameters(), *adapter.buffers()] if t.is_floating_point()]
    assert floating and {t.dtype for t in floating} == {torch.bfloat16}
    output = converted(_images(torch.bfloat16))
    assert output.dtype == torch.bfloat16 and bool(output.isfinite().all())
    if name == "softmax":  # the same weights: the same logits up to bfloat16 rounding (the logits are O(1))
        torch.testing.assert_close(output.double(), reference, rtol=0, atol=0.1)


# -- structure: sharing, cross-attention, other models ---------------------------------------------------------------
def test_a_shared_encoder_layer_stays_shared_after_conversion():
    # one BertLayer in two places (a weight-shared encoder): its self-attention and its output move together
    torch.manual_seed(0)
    model = transformers.BertModel(_bert_config()).double().eval()
    model.encoder.layer[1] = model.encoder.layer[0]
    convert_huggingface(model, "kep_svgp", blocks=(-1,), num_inducing=4)
    first, second = model.encoder.layer
    assert first is second and isinstance(first.attention.self, HuggingFaceAttentionAdapter)
    assert isinstance(second.attention.output.dense, torch.nn.Identity)


def test_a_shared_attention_module_is_converted_everywhere():
    # one attention module in two blocks: one slot (named_modules lists it once), one adapter in both places
    model = _vit()
    model.blocks[1].attn = model.blocks[0].attn
    with torch.no_grad():
        expected = model(_images())
        convert_timm(model, "softmax", blocks=(0,))
        assert isinstance(model.blocks[0].attn, TimmAttentionAdapter)
        assert model.blocks[1].attn is model.blocks[0].attn, f"blocks.1.attn is a {type(model.blocks[1].attn).__name__}"
        torch.testing.assert_close(model(_images()), expected, rtol=0, atol=ATOL)


def test_a_shared_self_attention_with_two_output_projections_is_refused():
    # one BertSelfAttention under two BertAttentions with their own output projections: one adapter cannot take both
    model = _bert()
    layers = model.bert.encoder.layer
    layers[1].attention.self = layers[0].attention.self
    before = dict(model.named_modules(remove_duplicate=False))
    with pytest.raises(ValueError, match=r"layer\.0\.attention\.self', '.*layer\.1\.attention\.self'.*output\.dense"):
        convert_huggingface(model, "softmax", blocks=(0,))
    after = dict(model.named_modules(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[name] is module for name, module in before.items())


def test_an_output_projection_shared_with_a_kept_layer_stays_there():
    # BertSelfOutput.dense shared by two layers, only layer 0 converted: layer 1 still applies it
    model = _bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    layers = model.bert.encoder.layer
    layers[1].attention.output.dense = layers[0].attention.output.dense
    dense = layers[0].attention.output.dense
    with torch.no_grad():
        expected = model(**_text()).logits
        convert_huggingface(model, "softmax", blocks=(0,))
        assert isinstance(layers[0].attention.output.dense, torch.nn.Identity)
        assert layers[1].attention.output.dense is dense
        torch.testing.assert_close(model(**_text()).logits, expected, rtol=0, atol=ATOL)


def test_cross_attention_modules_are_not_conversion_slots():
    # a BERT decoder with cross-attention: only the (causal) self-attention modules are slots, and they are refused
    # by path; the cross-attention modules neither count for the indices nor get converted
    torch.manual_seed(0)
    model = transformers.BertModel(_bert_config(is_decoder=True, add_cross_attention=True)).double()
    with pytest.raises(ValueError, match=r"blocks\[0\] to be an integer in \[-2, 1\], got 2"):
        convert_huggingface(model, "softmax", blocks=(2,))
    with pytest.raises(ValueError, match=r"\(encoder\.layer\.1\.attention\.self\): causal \(decoder\) self-attention"):
        convert_huggingface(model, "softmax", blocks=(-1,))
    assert not any(isinstance(module, HuggingFaceAttentionAdapter) for module in model.modules())


def test_a_decoder_only_model_is_refused_by_name():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=WIDTH, n_layer=1, n_head=HEADS, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0
    )
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no attention module to convert \(expected a self-"):
        convert_huggingface(transformers.GPT2LMHeadModel(config), "softmax")


def _bert_with_a_narrow_value(layer: int) -> torch.nn.Module:
    model = _bert()
    model.bert.encoder.layer[layer].attention.self.value = torch.nn.Linear(WIDTH, WIDTH // 2).double()
    return model


def test_a_failing_later_block_leaves_the_model_as_it_was():
    # block 0 converts; block 1 (its value projection narrower than the tokens) fails when its weights are copied:
    # nothing may be replaced, block 0's output projection included
    model = _bert_with_a_narrow_value(1)
    before = dict(model.named_modules())
    with pytest.raises(ValueError, match="value"):
        convert_huggingface(model, "softmax", blocks=(0, 1))
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[name] is module for name, module in before.items())


def test_a_projection_of_another_width_is_reported_with_the_module_path():
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.1\.attention\.self.*value"):
        convert_huggingface(_bert_with_a_narrow_value(1), "softmax", blocks=(-1,))


def test_a_replacement_path_that_does_not_exist_leaves_the_model_as_it_was():
    # every path is resolved before the first module is replaced (the adapter's path comes first here)
    model = _vit()
    before = dict(model.named_modules())

    def make_adapter(name, module):
        layer = build_layer("softmax", WIDTH, HEADS, {}, module.qkv.weight, "test")
        return {name: TimmAttentionAdapter(layer), "blocks.0.missing.dense": torch.nn.Identity()}

    with pytest.raises(ValueError, match=r"no module at 'blocks\.0\.missing\.dense' to replace"):
        convert_modules(model, lambda module: isinstance(module, Attention), (0,), "softmax", make_adapter, "", "test")
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[name] is module for name, module in before.items())


def test_a_bare_bert_attention_module_converts():
    torch.manual_seed(0)
    attention = transformers.models.bert.modeling_bert.BertAttention(_bert_config()).double().eval()
    attention.self.config._attn_implementation = "eager"
    tokens = torch.randn(2, 5, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = attention(tokens)[0]
        convert_huggingface(attention, "softmax")
        assert isinstance(attention.self, HuggingFaceAttentionAdapter)
        assert isinstance(attention.output.dense, torch.nn.Identity)
        torch.testing.assert_close(attention(tokens)[0], expected, rtol=0, atol=ATOL)


# -- attentions requested through the config -----------------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "vit"])
def test_attentions_requested_through_the_config_are_refused(family):
    torch.manual_seed(0)
    if family == "bert":
        model = transformers.BertModel(_bert_config(attn_implementation="eager"))
        inputs = {"input_ids": _text()["input_ids"]}
    else:
        config = transformers.ViTConfig(
            hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=2 * WIDTH,
            image_size=IMAGE, patch_size=PATCH, attn_implementation="eager",
        )  # fmt: skip
        model = transformers.ViTModel(config)
        inputs = {"pixel_values": _images()}
    model = model.double().eval()
    model.config.output_attentions = True
    with torch.no_grad():
        assert len(model(**inputs).attentions) == 2  # the replaced modules' weights, one per layer
        converted = convert_huggingface(copy.deepcopy(model), "softmax", blocks=(0,))
        with pytest.raises(ValueError, match=r"got config\.output_attentions=True.*output_attentions = False"):
            converted(**inputs)
        # the call's flag overrides the config's, in transformers and in the adapter: no weights asked for, none refused
        assert converted(**inputs, output_attentions=False).attentions is None
        converted.config.output_attentions = False  # the config the adapter holds is the model's
        assert converted(**inputs).attentions is None


def test_the_converted_layer_is_trainable_where_the_source_weights_were_frozen():
    # as documented (copy_projections): only values are copied; the new layer's parameters all train
    model = _bert().requires_grad_(False)
    convert_huggingface(model, "kep_svgp", blocks=(0,), num_inducing=4)
    adapter = model.bert.encoder.layer[0].attention.self
    assert "out_proj.weight" in adapter.copied
    assert all(parameter.requires_grad for parameter in adapter.parameters())
    assert not any(parameter.requires_grad for parameter in model.bert.encoder.layer[1].parameters())


def test_a_registered_layout_with_its_output_beside_under_another_name_converts(monkeypatch):
    """A layout registered with ``output_in_parent`` and its output projection under another name than ``output``
    (here ``proj.dense``) converts: the check for a projection beside the module reads the layout's first name."""
    from gpattn.integrations import huggingface

    class MySelfAttention(torch.nn.Module):
        num_attention_heads = HEADS

        def __init__(self):
            super().__init__()
            self.query, self.key, self.value = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MySelfAttention()
            self.proj = torch.nn.Module()
            self.proj.dense = torch.nn.Linear(WIDTH, WIDTH)

    layout = huggingface.SelfAttentionLayout(
        "query", "key", "value", "num_attention_heads", "proj.dense", output_in_parent=True
    )
    monkeypatch.setitem(huggingface.LAYOUTS, "MySelfAttention", layout)
    model = torch.nn.Sequential(Block())
    convert_huggingface(model, "softmax")
    assert isinstance(model[0].attn, HuggingFaceAttentionAdapter) and isinstance(model[0].proj.dense, torch.nn.Identity)


def test_a_converted_layers_call_errors_name_where_it_sits():
    """An error of a converted layer's call names the path of the module it replaced (in a deep encoder the class
    alone does not say which block refused)."""
    model = convert_huggingface(_bert(), "softmax", blocks=(1,))
    adapter = model.bert.encoder.layer[1].attention.self
    assert adapter.path == "bert.encoder.layer.1.attention.self"
    tokens = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"^HuggingFaceAttentionAdapter \(bert\.encoder\.layer\.1\.attention\.self\): "
    ):
        adapter(tokens, torch.full((BATCH, LENGTH), 0.5, dtype=torch.float64))
    vit = convert_timm(_vit(), "softmax", blocks=(0,))
    with pytest.raises(ValueError, match=r"^TimmAttentionAdapter \(blocks\.0\.attn\): got is_causal=True and an"):
        vit.blocks[0].attn(torch.randn(2, 5, WIDTH, dtype=torch.float64), torch.ones(2, 1, 5, 5), is_causal=True)
