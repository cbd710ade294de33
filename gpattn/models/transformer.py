"""A small pre-norm Transformer encoder classifier with pluggable (GP) attention."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from gpytorch.module import Module
from torch import Tensor

from .._torch_compat import is_capturing
from ..attention import AttentionLayer, SoftmaxAttention, accepts_argument, attention_arguments, build_attention
from ..validation import InputTypeError, assert_indices_on_device, check_choice, check_float, check_int, check_tensor

INPUTS = ("tokens", "patches", "vectors", "signal")
#: The stem of ``input="signal"`` when its arguments are not given: two layers of kernel 5, the last of stride 2.
SIGNAL_STEM_DEFAULTS = {"stem_kernel_size": 5, "stem_stride": 2, "stem_layers": 2}


def _positive_int(name: str, value: Any) -> int:
    return check_int(name, value, where="Transformer")


class _EncoderBlock(torch.nn.Module):
    """``x + attn(LN(x))`` then ``x + MLP(LN(x))`` (pre-norm, as in ViT)."""

    def __init__(self, attention: AttentionLayer, embed_dim: int, hidden_dim: int, dropout: float):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(embed_dim)
        self.attention = attention
        self.mlp_norm = torch.nn.LayerNorm(embed_dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(embed_dim, hidden_dim),
            torch.nn.GELU(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden_dim, embed_dim),
            torch.nn.Dropout(dropout),
        )

    def forward(self, tokens: Tensor, mask: Tensor | str | None) -> Tensor:
        tokens = tokens + self.attention(self.attention_norm(tokens), mask=mask)
        return tokens + self.mlp(self.mlp_norm(tokens))


class Transformer(Module):
    r"""Pre-norm Transformer encoder for sequence or image classification, with GP attention in the last blocks.

    The input is embedded into tokens of width :math:`C` = ``embed_dim`` plus a learned positional embedding, then
    goes through ``depth`` blocks :math:`x \leftarrow x + \mathrm{Attn}(\mathrm{LN}(x))`,
    :math:`x \leftarrow x + \mathrm{MLP}(\mathrm{LN}(x))`, a final LayerNorm, a mean over the real tokens and a
    linear head. The last ``gp_layers`` blocks use the registry attention ``attention`` (built with
    ``**attention_kwargs``), the others :class:`~gpattn.attention.SoftmaxAttention`, as in the KEP-SVGP and SGPA
    papers, where only the last layer is a GP.

    Input kinds:

    * ``"tokens"``: integer ids ``(B, N)`` in ``[0, vocab_size)``, ``N <= max_len``; ``nn.Embedding``.
    * ``"vectors"``: float features ``(B, N, input_dim)``, ``N <= max_len``; a linear embedding.
    * ``"patches"``: images ``(B, in_channels, H, W)`` with ``(H, W)`` = ``image_size``; non-overlapping
      ``patch_size`` patches embedded by a convolution with kernel = stride = ``patch_size`` (ViT), giving
      ``N = (H / patch_size) (W / patch_size)`` tokens (``max_len`` is not used).
    * ``"signal"``: float signals ``(B, L, input_dim)`` (``input_dim`` values per position, channels last as for
      ``"vectors"``; MNIST-1D with ``patch_size=1`` is ``(B, 40, 1)``), ``L <= max_len``; a convolutional stem of
      ``stem_layers`` ``Conv1d`` layers of width ``embed_dim`` and odd kernel ``stem_kernel_size`` :math:`k`, zero
      padded by :math:`(k - 1) / 2` on both sides, with a GELU between layers, all of stride 1 except the last, of
      stride ``stem_stride`` :math:`s`: ``N = ceil(L / s)`` tokens. With ``stem_layers=1`` the tokens are linear
      embeddings of overlapping windows of :math:`k` positions, :math:`s` apart (overlapping patches). The positional
      table has ``ceil(max_len / s)`` rows (the model's ``max_len``, which the attention layers get); the stem mixes
      neighbouring positions, so this input takes no mask.

    Stochastic attention layers sample in training and return their predictive mean in eval mode; use
    :func:`~gpattn.attention.sample_attention` or :func:`~gpattn.models.predict_probabilities` for Monte Carlo
    prediction, and :class:`~gpattn.mlls.AttentionELBO` (which reads :meth:`kl_divergence` and the added KSVD loss
    terms) for training.

    :param num_classes: Number of classes of the linear head.
    :param embed_dim: Token width :math:`C`.
    :param depth: Number of encoder blocks.
    :param num_heads: Heads of every attention layer (must divide ``embed_dim``).
    :param attention: Registry name of the attention of the last ``gp_layers`` blocks
        (:func:`~gpattn.attention.attention_names`).
    :param gp_layers: How many of the last blocks use ``attention`` (``0 <= gp_layers <= depth``; with 0, ``attention``
        and ``attention_kwargs`` are not used, so that sweeps over ``gp_layers`` can share arguments).
    :param input: ``"tokens"``, ``"patches"``, ``"vectors"`` or ``"signal"``.
    :param vocab_size: Number of token ids (``input="tokens"``).
    :param max_len: Longest sequence, the size of the positional table (``"tokens"`` and ``"vectors"``); the
        longest signal ``L`` for ``"signal"``.
    :param input_dim: Feature width (``input="vectors"``), values per position (``input="signal"``).
    :param image_size: Image side ``int`` or ``(H, W)`` (``input="patches"``).
    :param patch_size: Patch side, dividing both image sides (``input="patches"``).
    :param in_channels: Image channels (``input="patches"``).
    :param stem_kernel_size: Odd kernel :math:`k` of the stem's convolutions (``input="signal"``; default 5).
    :param stem_stride: Stride :math:`s` of the stem's last convolution (``input="signal"``; default 2).
    :param stem_layers: Convolutions of the stem (``input="signal"``; default 2).
    :param mlp_ratio: Hidden width of the MLPs as a multiple of ``embed_dim``.
    :param dropout: Dropout on the embeddings, the MLPs and every attention output. A registered ``attention`` whose
        class takes no ``dropout`` argument (neither named nor through ``**kwargs``) is built without one, with
        ``dropout=0`` only: a positive ``dropout`` is refused (``ValueError``) rather than left off its outputs.
    :param attention_kwargs: Keyword arguments of the ``attention`` layers (e.g. ``num_inducing=10``). Layers that
        take a ``max_len`` get the model's (the number of patches for images) unless it is given here.

    .. note:: Cost per forward: the attention layers' costs plus O(B N C^2 mlp_ratio) per block for the MLPs; the
        ``"signal"`` stem adds O(B L k C^2) per layer but the last, O(B N k C^2) for the last.
    """

    def __init__(
        self,
        num_classes: int,
        embed_dim: int = 64,
        depth: int = 2,
        num_heads: int = 4,
        attention: str = "kep_svgp",
        gp_layers: int = 1,
        input: str = "tokens",
        vocab_size: int | None = None,
        max_len: int = 512,
        input_dim: int | None = None,
        image_size: int | tuple[int, int] | None = None,
        patch_size: int | None = None,
        in_channels: int | None = None,
        stem_kernel_size: int | None = None,
        stem_stride: int | None = None,
        stem_layers: int | None = None,
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
        **attention_kwargs: Any,
    ):
        super().__init__()
        # Python ints from here on (a NumPy integer would reach the attributes, configs and records)
        num_classes = check_int("num_classes", num_classes, minimum=2, where="Transformer")  # one class: no prediction
        embed_dim = _positive_int("embed_dim", embed_dim)
        num_heads = _positive_int("num_heads", num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"Transformer: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        _positive_int("depth", depth)
        check_int("gp_layers", gp_layers, 0, depth, where="Transformer")
        check_choice("input", input, INPUTS, where="Transformer")
        # Python floats from here on (a NumPy float would reach the dropout modules and the checkpoints' description)
        mlp_ratio = check_float("mlp_ratio", mlp_ratio, 0.0, strict_minimum=True, where="Transformer")
        dropout = check_float("dropout", dropout, 0.0, 1.0, strict_maximum=True, where="Transformer")
        arguments = (  # name, value, the inputs that use it; all are required by them but the stem's (defaults)
            ("vocab_size", vocab_size, ("tokens",)),
            ("input_dim", input_dim, ("vectors", "signal")),
            ("image_size", image_size, ("patches",)),
            ("patch_size", patch_size, ("patches",)),
            ("in_channels", in_channels, ("patches",)),
            ("stem_kernel_size", stem_kernel_size, ("signal",)),
            ("stem_stride", stem_stride, ("signal",)),
            ("stem_layers", stem_layers, ("signal",)),
        )
        for name, value, kinds in arguments:
            if input in kinds and value is None and name not in SIGNAL_STEM_DEFAULTS:
                raise ValueError(f"Transformer: input={input!r} needs {name}")
            if input not in kinds and value is not None:
                users = " or ".join(map(repr, kinds))
                raise ValueError(f"Transformer: {name} is only used with input={users}, got input={input!r}")

        self.input = input
        self.embed_dim = embed_dim
        self.num_classes = num_classes
        if input == "patches":
            if isinstance(image_size, (str, bytes)):  # tuple("88") would be ("8", "8")
                raise InputTypeError(f"Transformer: expected image_size to be an int or (H, W), got {image_size!r}")
            # a NumPy integer is one side too (numbers.Integral; tuple() of it would fail with "not iterable")
            sides = (image_size, image_size) if isinstance(image_size, numbers.Integral) else tuple(image_size)
            if len(sides) != 2:
                raise ValueError(f"Transformer: expected image_size to be an int or (H, W), got {image_size!r}")
            height, width, patch_size = (  # Python ints (the attributes reach configs and records)
                _positive_int(name, value)
                for name, value in (("image_size", sides[0]), ("image_size", sides[1]), ("patch_size", patch_size))
            )
            in_channels = _positive_int("in_channels", in_channels)
            if height % patch_size or width % patch_size:
                raise ValueError(f"Transformer: patch_size {patch_size} must divide the image size {(height, width)}")
            self.image_size, self.in_channels = (height, width), in_channels
            self.embedding = torch.nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)
            self.max_len = (height // patch_size) * (width // patch_size)
            self.input_shape = ("B", in_channels, height, width)
        elif input == "signal":
            self.input_dim = _positive_int("input_dim", input_dim)
            self.max_signal_length = _positive_int("max_len", max_len)
            given = {"stem_kernel_size": stem_kernel_size, "stem_stride": stem_stride, "stem_layers": stem_layers}
            kernel, stride, layers = (
                _positive_int(name, SIGNAL_STEM_DEFAULTS[name] if value is None else value)
                for name, value in given.items()
            )
            if kernel % 2 == 0:
                raise ValueError(
                    f"Transformer: expected an odd stem_kernel_size (padded by (k - 1) / 2 on both sides), got {kernel}"
                )
            self.stem_kernel_size, self.stem_stride, self.stem_layers = kernel, stride, layers
            convolutions = [
                torch.nn.Conv1d(
                    input_dim if index == 0 else embed_dim,
                    embed_dim,
                    kernel,
                    stride=stride if index == layers - 1 else 1,
                    padding=(kernel - 1) // 2,
                )
                for index in range(layers)
            ]
            modules = [convolutions[0]]
            for convolution in convolutions[1:]:
                modules += [torch.nn.GELU(), convolution]
            self.embedding = torch.nn.Sequential(*modules)
            self.max_len = math.ceil(max_len / stride)
            self.input_shape = ("B", "L", input_dim)
        else:
            self.max_len = _positive_int("max_len", max_len)
            if input == "tokens":
                self.vocab_size = _positive_int("vocab_size", vocab_size)
                self.embedding = torch.nn.Embedding(vocab_size, embed_dim)
                self.input_shape = ("B", "N")
            else:
                self.input_dim = _positive_int("input_dim", input_dim)
                self.embedding = torch.nn.Linear(input_dim, embed_dim)
                self.input_shape = ("B", "N", input_dim)
        self.position_embedding = torch.nn.Parameter(torch.empty(1, self.max_len, embed_dim))
        torch.nn.init.trunc_normal_(self.position_embedding, std=0.02)
        self.embedding_dropout = torch.nn.Dropout(dropout)

        if gp_layers:  # the model's dropout, where the layer takes one
            if accepts_argument(attention, "dropout"):
                attention_kwargs["dropout"] = dropout
            elif dropout > 0:
                raise ValueError(
                    f"Transformer: the attention {attention!r} takes no dropout argument, so dropout={dropout} cannot "
                    "reach its output: pass dropout=0, or register a layer that takes a dropout"
                )
        if gp_layers and "max_len" in attention_arguments(attention):
            # the sequence length bound of fixed-length parametrisations (features="primal_tokens")
            attention_kwargs.setdefault("max_len", self.max_len)
        hidden_dim = max(1, round(mlp_ratio * embed_dim))
        blocks = []
        for index in range(depth):
            if index >= depth - gp_layers:
                layer = build_attention(attention, embed_dim, num_heads, **attention_kwargs)
            else:
                layer = SoftmaxAttention(embed_dim, num_heads, dropout=dropout)
            blocks.append(_EncoderBlock(layer, embed_dim, hidden_dim, dropout))
        self.blocks = torch.nn.ModuleList(blocks)
        self.norm = torch.nn.LayerNorm(embed_dim)
        self.head = torch.nn.Linear(embed_dim, num_classes)

    # -- embedding ---------------------------------------------------------------------------------------------------
    def embed(self, inputs: Tensor) -> Tensor:
        """Tokens with positional embedding, shape ``(B, N, C)``."""
        if not isinstance(inputs, Tensor):
            raise TypeError(f"Transformer: expected inputs to be a torch.Tensor, got {type(inputs).__name__}")
        integer = self.input == "tokens"
        if not (inputs.dtype in (torch.int32, torch.int64) if integer else inputs.is_floating_point()):
            kind = "integer token ids" if integer else "floating-point inputs"
            raise TypeError(f"Transformer: expected {kind} for input={self.input!r}, got {inputs.dtype}")
        shape = self.input_shape
        if inputs.dim() != len(shape) or any(
            isinstance(want, int) and got != want for got, want in zip(inputs.shape, shape, strict=True)
        ):
            raise ValueError(
                f"Transformer: expected input={self.input!r} of shape ({', '.join(map(str, shape))}), got "
                f"{tuple(inputs.shape)}"
            )
        # device (and for float inputs dtype and finiteness: one elementwise pass) before any value is read
        check_tensor(
            "inputs",
            inputs,
            like=self.position_embedding,
            match_dtype=not integer,
            finite=not integer,
            where="Transformer",
        )
        if inputs.numel() == 0:
            raise ValueError(f"Transformer: expected non-empty inputs, got shape {tuple(inputs.shape)}")
        if integer and is_capturing():  # a CUDA graph: checked on the device at every replay, no read
            assert_indices_on_device(
                inputs, self.vocab_size, f"Transformer: token ids must lie in [0, {self.vocab_size})"
            )
        elif integer and (inputs.min() < 0 or inputs.max() >= self.vocab_size):
            raise ValueError(
                f"Transformer: token ids must lie in [0, {self.vocab_size}), got [{inputs.min()}, {inputs.max()}]"
            )
        if self.input == "signal":
            if inputs.shape[1] > self.max_signal_length:
                raise ValueError(
                    f"Transformer: signal length {inputs.shape[1]} exceeds max_len={self.max_signal_length}"
                )
            tokens = self.embedding(inputs.transpose(1, 2)).transpose(1, 2)  # (B, L, D) -> (B, D, L) -> (B, N, C)
        else:
            tokens = self.embedding(inputs)
        if self.input == "patches":
            tokens = tokens.flatten(2).transpose(1, 2)  # (B, C, H/p, W/p) -> (B, N, C)
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"Transformer: sequence length {length} exceeds max_len={self.max_len}")
        return self.embedding_dropout(tokens + self.position_embedding[:, :length])

    # -- forward -----------------------------------------------------------------------------------------------------
    def forward(self, inputs: Tensor, mask: Tensor | str | None = None) -> Tensor:
        """Class logits.

        :param inputs: Token ids ``(B, N)``, vectors ``(B, N, input_dim)``, images ``(B, in_channels, H, W)`` or
            signals ``(B, L, input_dim)``.
        :param mask: ``None``, a boolean padding mask ``(B, N)`` (``True`` = real token; padded tokens have no
            influence on the logits; pad at the end: the positions are absolute, so padding in front moves the real
            tokens to other position embeddings) or ``"causal"`` (the pooled mean still runs over all tokens);
            ``None`` for ``input="signal"``.
        :return: Logits, shape ``(B, num_classes)``.
        """
        if self.input == "signal" and mask is not None:
            raise ValueError(
                f"Transformer: input='signal' takes no mask (its convolutional stem mixes neighbouring positions), "
                f"got {mask if isinstance(mask, str) else type(mask).__name__}"
            )
        tokens = self.embed(inputs)  # shape: (B, N, C)
        padding = mask if isinstance(mask, Tensor) else None
        if padding is not None and (padding.dtype != torch.bool or tuple(padding.shape) != tuple(tokens.shape[:2])):
            error = InputTypeError if padding.dtype != torch.bool else ValueError
            raise error(
                f"Transformer: expected a boolean padding mask of shape {tuple(tokens.shape[:2])}, "
                f"got {padding.dtype} {tuple(padding.shape)}"
            )
        for block in self.blocks:
            tokens = block(tokens, mask)
        tokens = self.norm(tokens)
        if padding is None:
            pooled = tokens.mean(dim=1)
        else:
            # mean over the real tokens; where() rather than a product, so that padded outputs never leak (not even NaN)
            num_real = padding.sum(dim=1, keepdim=True).to(tokens.dtype)  # shape: (B, 1)
            pooled = torch.where(padding.unsqueeze(-1), tokens, 0.0).sum(dim=1) / num_real
        return self.head(pooled)

    # -- probabilistic interface -------------------------------------------------------------------------------------
    def attention_layers(self) -> list[AttentionLayer]:
        """The attention layer of every block, first block first."""
        return [block.attention for block in self.blocks]

    def kl_divergence(self) -> Tensor:
        """Sum of the KL divergences of every attention layer (the GP layers' after their last forward), a scalar."""
        return torch.stack([layer.kl_divergence() for layer in self.attention_layers()]).sum()
