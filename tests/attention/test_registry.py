"""The attention registry: names in order, accepted arguments, shared settings, registration of a new layer."""

from __future__ import annotations

import pytest
import torch

from gpattn.attention import (
    ATTENTIONS,
    AttentionLayer,
    SoftmaxAttention,
    accepts_argument,
    attention_arguments,
    attention_names,
    build_attention,
    register_attention,
    select_arguments,
    unregister_attention,
)
from gpattn.models import Transformer

BUILT_IN = ["kep_svgp", "kep_svgp_sym", "sgpa", "svgp", "softmax", "primal", "cgpt", "kep_svgp_paper", "primal_paper"]


class ScaledSoftmax(SoftmaxAttention):
    """Softmax attention whose output is multiplied by ``scale``: a layer defined outside the package."""

    def __init__(self, embed_dim: int, num_heads: int, scale: float = 1.0, dropout: float = 0.0):
        super().__init__(embed_dim, num_heads, dropout)
        self.scale = scale

    def forward(self, x, mask=None, context=None):
        return self.scale * super().forward(x, mask=mask, context=context)


class WidthOnly(SoftmaxAttention):
    """A layer whose constructor takes the width alone: build_attention could never build it."""

    def __init__(self, embed_dim: int):
        super().__init__(embed_dim, 1)


class KeywordsOnly(SoftmaxAttention):
    """A layer that passes ``**kwargs`` on to its base, the signature :func:`register_attention` asks for."""

    def __init__(self, embed_dim: int, num_heads: int, *args, **kwargs):
        super().__init__(embed_dim, num_heads, *args, **kwargs)


class NoDropout(SoftmaxAttention):
    """A layer without a dropout argument."""

    def __init__(self, embed_dim: int, num_heads: int, scale: float = 1.0):
        super().__init__(embed_dim, num_heads)
        self.scale = scale


@pytest.fixture
def registered():
    register_attention("scaled", ScaledSoftmax, {"scale": 2.0})
    yield "scaled"
    unregister_attention("scaled")


def test_built_in_names_and_order() -> None:
    assert attention_names() == BUILT_IN
    assert attention_arguments("kep_svgp_sym") == attention_arguments("kep_svgp")


def test_select_arguments_keeps_what_the_layer_takes() -> None:
    settings = {"num_inducing": 8, "ksvd_weight": 0.5}
    assert select_arguments("softmax", **settings) == {}
    assert select_arguments("sgpa", **settings) == {"num_inducing": 8}
    assert select_arguments("svgp", **settings) == {"num_inducing": 8}
    assert select_arguments("kep_svgp", **settings) == settings
    assert select_arguments("primal", num_inducing=None, ksvd_weight=0.5) == {"ksvd_weight": 0.5}  # None: own default
    with pytest.raises(ValueError, match="unknown attention 'nope'"):
        select_arguments("nope", num_inducing=8)


def test_a_registered_layer_is_built_with_its_defaults(registered) -> None:
    assert attention_names() == [*BUILT_IN, registered]
    assert attention_arguments(registered) == ["scale", "dropout"]
    torch.manual_seed(0)
    layer = build_attention(registered, 8, 2)
    torch.manual_seed(0)
    reference = SoftmaxAttention(8, 2)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), 2.0 * reference(x), rtol=0, atol=0)
    assert build_attention(registered, 8, 2, scale=3.0).scale == 3.0  # the caller's arguments win
    model = Transformer(2, embed_dim=8, depth=1, num_heads=2, attention=registered, vocab_size=5, max_len=4)
    assert isinstance(model.attention_layers()[0], ScaledSoftmax)


def test_unregister_removes_the_name(registered) -> None:
    unregister_attention(registered)
    assert registered not in ATTENTIONS and attention_names() == BUILT_IN
    register_attention(registered, ScaledSoftmax)  # the fixture unregisters it again
    with pytest.raises(ValueError, match="unknown attention 'never'"):
        unregister_attention("never")


@pytest.mark.parametrize(
    ("name", "layer_cls", "defaults", "error", "match"),
    [
        ("softmax", SoftmaxAttention, None, ValueError, "already registered"),
        ("", SoftmaxAttention, None, ValueError, "non-empty string"),
        ("two words", SoftmaxAttention, None, ValueError, "without spaces"),
        ("linear", torch.nn.Linear, None, TypeError, "subclass of AttentionLayer"),
        ("bad", SoftmaxAttention, {"num_inducing": 4}, ValueError, r"defaults \['num_inducing'\] are not arguments"),
        # accepted by a **kwargs class, after which every build raised "got multiple values for argument 'embed_dim'"
        ("width", KeywordsOnly, {"embed_dim": 8}, ValueError, r"defaults \['embed_dim'\] are build_attention's own"),
        ("heads", KeywordsOnly, {"num_heads": 2}, ValueError, r"defaults \['num_heads'\] are build_attention's own"),
        (
            "one",
            WidthOnly,
            None,
            TypeError,
            r"take \(embed_dim, num_heads, \*\*kwargs\), but WidthOnly\(embed_dim.*two positional",
        ),
    ],
)
def test_bad_registrations_are_refused(name, layer_cls, defaults, error, match) -> None:
    before = dict(ATTENTIONS)
    with pytest.raises(error, match=match):
        register_attention(name, layer_cls, defaults)
    assert ATTENTIONS == before


def test_layers_without_a_spectrum_say_none() -> None:
    assert AttentionLayer.learned_spectrum(SoftmaxAttention(8, 2)) is None


@pytest.mark.parametrize("name", ["kep_svgp_paper", "primal_paper"])
def test_paper_rows_run_the_official_configuration(name: str):
    layer = build_attention(name, 32, 2, **select_arguments(name, num_inducing=None, ksvd_weight=1.0))
    features = layer.features
    assert features.mode == "primal_tokens" and features.ksvd_form == "official"
    assert features.left_token_weights.shape == (2, 100, 10)  # N' = 10 s evenly spaced tokens under max_len 512
    if name == "kep_svgp_paper":
        assert layer.shared_posterior and layer.sampling_mode == "marginal" and layer.num_outputs == 10
    # in a Transformer the row gets the model's length: 16 patches of an 8x8 image, every token a weight row
    model = Transformer(
        3, embed_dim=32, num_heads=2, attention=name, input="patches", image_size=8, patch_size=2, in_channels=1
    )
    assert model.blocks[-1].attention.features.left_token_weights.shape == (2, 16, 10)
    assert model(torch.randn(4, 1, 8, 8)).shape == (4, 3)
    # the variants keep gpattn's amortised features and the sum form
    variant = build_attention(name.removesuffix("_paper"), 32, 2)
    assert variant.features.mode == "amortized" and variant.features.ksvd_form == "sum"


def test_a_layer_taking_kwargs_accepts_any_keyword():
    """``*args`` and ``**kwargs`` are not argument names; a class with ``**kwargs`` is built with any keyword (its base
    refuses what it does not take), also as a registry default, but select_arguments passes it only named ones."""
    register_attention("keywords", KeywordsOnly, {"dropout": 0.2})
    try:
        assert attention_arguments("keywords") == []
        assert accepts_argument("keywords", "dropout") and accepts_argument("keywords", "anything")
        assert build_attention("keywords", 8, 2).dropout.p == 0.2
        layer = build_attention("keywords", 8, 2, dropout=0.1)
        assert isinstance(layer, KeywordsOnly) and layer.dropout.p == 0.1
        with pytest.raises(TypeError, match="num_inducing"):  # refused by SoftmaxAttention itself
            build_attention("keywords", 8, 2, num_inducing=4)
        assert select_arguments("keywords", dropout=0.1, num_inducing=4) == {}
    finally:
        unregister_attention("keywords")
    assert accepts_argument("softmax", "dropout") and not accepts_argument("softmax", "num_inducing")


def test_a_layer_without_dropout_builds_in_a_transformer_without_dropout():
    """The model passes its dropout only to a layer that takes one; a positive dropout that such a layer could not
    apply is refused, naming the layer (with gp_layers=0 the layer is not built, and nothing is refused)."""
    register_attention("no_dropout", NoDropout)
    register_attention("keywords", KeywordsOnly)
    try:
        assert attention_arguments("no_dropout") == ["scale"] and not accepts_argument("no_dropout", "dropout")
        sizes = {"embed_dim": 8, "depth": 2, "num_heads": 2, "vocab_size": 5, "max_len": 4}
        model = Transformer(2, attention="no_dropout", scale=2.0, **sizes)
        layer = model.attention_layers()[-1]
        assert isinstance(layer, NoDropout) and layer.scale == 2.0 and layer.dropout.p == 0.0
        with pytest.raises(ValueError, match=r"^Transformer: the attention 'no_dropout' takes no dropout argument"):
            Transformer(2, attention="no_dropout", dropout=0.1, **sizes)
        model = Transformer(2, attention="no_dropout", gp_layers=0, dropout=0.1, **sizes)
        assert [type(layer) for layer in model.attention_layers()] == [SoftmaxAttention, SoftmaxAttention]
        model = Transformer(2, attention="keywords", dropout=0.1, **sizes)  # **kwargs: the model's dropout reaches it
        assert [(type(layer), layer.dropout.p) for layer in model.attention_layers()] == [
            (SoftmaxAttention, 0.1),
            (KeywordsOnly, 0.1),
        ]
        assert Transformer(2, attention="softmax", dropout=0.1, **sizes).attention_layers()[-1].dropout.p == 0.1
    finally:
        unregister_attention("no_dropout")
        unregister_attention("keywords")
