"""The interface shared by every attention layer: input checks, masks, heads, output projection, sampling mode."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from gpytorch.module import Module
from torch import Tensor

from .._module_state import GraphFreeState, kept_call_results, restored_modes
from .._torch_compat import COMPILES_ASSERTS, autocast_enabled, compilable, is_capturing, is_compiling
from ..validation import check_bool, check_float, check_int, check_tensor

_EMPTY_SEQUENCE = "every sequence needs at least one real token"


# not frozen: torch 2.3's dynamo cannot build a frozen dataclass inside a compiled layer (InternalTorchDynamoError
# "'AttentionInputs' object has no attribute 'queries'"); nothing assigns to its fields after construction
@dataclass
class AttentionInputs:
    """Checked inputs of one attention call.

    :ivar queries: shape ``(B, N, C)``.
    :ivar keys: shape ``(B, M, C)`` (the queries in self-attention, ``context`` in cross-attention).
    :ivar key_mask: ``None`` or a boolean ``(B, M)`` tensor, ``True`` for real tokens, ``False`` for padding.
    :ivar causal: Query ``i`` may only see keys ``j <= i`` (self-attention only).
    :ivar is_cross: ``context`` was given.
    """

    queries: Tensor
    keys: Tensor
    key_mask: Tensor | None
    causal: bool
    is_cross: bool


class AttentionLayer(GraphFreeState, Module):
    r"""Base class of the attention layers: one signature for all.

    ``forward(x, mask=None, context=None)`` maps tokens ``x`` of shape ``(B, N, C)`` to ``(B, N, C)``:

    * ``mask``: ``None``; a boolean padding mask of shape ``(B, M)`` with ``True`` for real tokens (masked keys have
      no influence on any output; outputs at padded query positions are unspecified and must be ignored
      downstream); or the string ``"causal"`` (output ``i`` depends on tokens ``<= i`` only).
    * ``context``: key tokens of shape ``(B, M, C)`` for cross-attention (``M`` may differ from ``N``).

    Stochastic layers return a reparameterised sample in training mode and the predictive mean in eval mode,
    unless sampling is switched on with :func:`sample_attention`. They expose ``kl_divergence()`` (zero for
    deterministic layers) and ``posterior(x, ...)`` (predictive mean and variance of the output, as in eval mode in
    either mode: no sampling, no dropout, and the results of the last ``forward`` call, its added loss terms and KL,
    left as they are).

    ``copy.deepcopy`` and ``pickle`` work after a training step too: the copy holds the last call's added loss terms
    (and any per-call KL) detached from its autograd graph (``gpattn._module_state.GraphFreeState``).

    A layer's training recipe (e.g. SGPA's KL annealing) belongs to its comparison row, not to the layer: see
    :class:`~gpattn.methods.TrainingRecipe`.

    :attr:`supports_graph_capture` says whether a training step (forward pass, KL, added loss terms, backward pass) of
    the layer can be captured into a CUDA graph (``torch.cuda.graph``) and replayed: no value is read on the host while
    a graph is captured (:func:`~gpattn._torch_compat.is_capturing`), so the layer's magnitude guards are skipped there
    (as under ``torch.compile``) and a padding mask that hides a whole sequence fails as a device-side assertion.
    Layers built on GPyTorch's Cholesky factorisation (SGPA, the symmetric SVGP, CGPT) and the exact KSVD (an SVD)
    read values and cannot be captured.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads :math:`H` (must divide ``embed_dim``).
    :param dropout: Dropout on the output.
    """

    is_stochastic: bool = False
    supports_cross_attention: bool = True
    supports_causal: bool = True
    supports_graph_capture: bool = False
    #: attributes besides the added loss terms that a ``forward`` call sets for the loss (e.g. a KL that belongs to the
    #: call): :meth:`predictive_mean` and :meth:`posterior` leave them as the last ``forward`` call set them
    call_results: tuple[str, ...] = ()

    # torch's call (forward hooks, forward pre-hooks) rather than gpytorch.Module's, which bypasses the hooks:
    # attention layers return plain tensors, and users capture their inputs with register_forward_pre_hook
    __call__ = torch.nn.Module.__call__

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        where = type(self).__name__
        # Python ints (a NumPy integer in a batch shape fails deep in GPyTorch's broadcasting)
        embed_dim = check_int("embed_dim", embed_dim, where=where)
        num_heads = check_int("num_heads", num_heads, where=where)
        if embed_dim % num_heads:
            raise ValueError(f"{where}: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        check_float("dropout", dropout, 0.0, 1.0, strict_maximum=True, where=where)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.dropout = torch.nn.Dropout(dropout)
        self.sample_in_eval = False

    # -- inputs ------------------------------------------------------------------------------------------------------
    def _check_tokens(self, tokens: Tensor, name: str) -> None:
        # O(1) checks plus one elementwise pass (finiteness) per input tensor. The device must be the parameters' and
        # the dtype that of the layer's own first parameter, which it applies to the tokens (a layer with no
        # parameter besides out_proj, e.g. a test double returning its input, takes any floating dtype)
        reference, own = self.out_proj.weight, False
        for parameter_name, parameter in self.named_parameters():
            if not parameter_name.startswith("out_proj."):
                reference, own = parameter, True
                break
        check_tensor(
            name,
            tokens,
            ("B", "N", self.embed_dim),
            floating=True,
            non_empty=True,
            like=reference,
            match_dtype=own,
            finite=True,
            meaning="(batch, tokens, embed_dim)",
            where=type(self).__name__,
        )

    def _prepare(self, x: Tensor, mask: Tensor | str | None, context: Tensor | None) -> AttentionInputs:
        """Check the inputs of ``forward`` / ``posterior`` (the one entry point of every layer) before anything is
        computed: a bad input raises ``TypeError`` or ``ValueError`` and leaves the layer untouched."""
        where = type(self).__name__
        self._check_tokens(x, "x")
        keys = x
        if context is not None:
            if not self.supports_cross_attention:
                raise ValueError(f"{where} does not support cross-attention (context=...)")
            self._check_tokens(context, "context")
            if context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"{where}: context must match x in batch size, got context {tuple(context.shape)} for x "
                    f"{tuple(x.shape)}"
                )
            keys = context
        causal, key_mask = False, None
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"{where}: expected mask to be None, a boolean tensor or 'causal', got {mask!r}")
            if not self.supports_causal:
                raise ValueError(f"{where} does not support causal masks")
            if context is not None:
                raise ValueError(f"{where}: a causal mask needs self-attention (context=None)")
            causal = True  # query i always sees key i: no row of the mask is empty
        elif mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
                raise TypeError(f"{where}: expected a boolean padding mask (True = real token), got {got}")
            expected = (keys.shape[0], keys.shape[1])
            if tuple(mask.shape) != expected:
                raise ValueError(
                    f"{where}: expected a padding mask of shape {expected} = (batch, keys), got {tuple(mask.shape)}"
                )
            if mask.device != keys.device:
                raise ValueError(f"{where}: mask is on {mask.device} but the tokens are on {keys.device}")
            if (COMPILES_ASSERTS and is_compiling()) or is_capturing():  # the same check without a data-dependent
                # branch (one graph, not four; a CUDA graph checks it at every replay): a RuntimeError when the step
                # runs (a device-side assert on a GPU), without the indices
                torch._assert_async(mask.any(dim=-1).all(), f"{where}: {_EMPTY_SEQUENCE}")
            else:
                empty = ~mask.any(dim=-1)
                if empty.any():
                    raise ValueError(
                        f"{where}: the mask hides every token of sequence(s) {empty.nonzero().flatten().tolist()}: "
                        f"{_EMPTY_SEQUENCE}"
                    )
            key_mask = mask
        return AttentionInputs(x, keys, key_mask, causal, context is not None)

    # -- heads -------------------------------------------------------------------------------------------------------
    def split_heads(self, tokens: Tensor) -> Tensor:
        """``(B, N, C)`` -> ``(B, H, N, C / H)``."""
        batch, length, _ = tokens.shape
        return tokens.view(batch, length, self.num_heads, -1).transpose(1, 2)

    @staticmethod
    def merge_heads(tokens: Tensor) -> Tensor:
        """``(B, H, N, d)`` -> ``(B, N, H d)``."""
        batch, heads, length, width = tokens.shape
        return tokens.transpose(1, 2).reshape(batch, length, heads * width)

    def head_projection(self) -> Tensor:
        """The head blocks :math:`P_h^\\top` of ``out_proj`` (``y = b + sum_h o_h P_h^T``), shape ``(H, C / H, C)``: a
        view of the weight (each block a transposed, column-major matrix, which batched GEMMs read without a copy)."""
        return self.out_proj.weight.view(self.embed_dim, self.num_heads, self.head_dim).permute(1, 2, 0)

    @staticmethod
    def accumulate_heads(output: Tensor, head_values: Tensor, coefficients: Tensor) -> Tensor:
        r"""``output + sum_{h, k} head_values[b, h, n, k] coefficients[b, h, k, :]`` as one GEMM of inner dimension
        :math:`H k` per sequence: layers whose head outputs are linear in small per-head tensors fold their output
        maps and ``out_proj`` into ``coefficients`` and never form the ``(B, H, N, C / H)`` head outputs.

        :param output: ``(B, N, C)`` (or broadcastable to it, e.g. the bias).
        :param head_values: ``(B, H, N, k)``; no copy when it is a transposed view of a contiguous ``(B, H, k, N)``.
        :param coefficients: ``(H, k, C)`` or ``(B, H, k, C)``.
        :return: ``(B, N, C)``.

        .. note:: With ``head_values`` a transposed view of a contiguous ``(B, H, k, N)`` tensor (the column layout of
            the kernel-eigen scores) the product is :math:`y = o + S^\top A` with :math:`S` the ``(B, H k, N)`` view
            and the backward pass returns :math:`\bar S = A \bar y^\top` in that same layout (autograd through the
            transposed view would hand back a transposed gradient, and every elementwise pass over it downstream would
            read it with a stride of :math:`H k`).
        """
        batch, heads, length, width = head_values.shape
        coefficients = coefficients.expand(batch, *coefficients.shape[-3:]).reshape(batch, heads * width, -1)
        columns = head_values.mT
        # (B, H k, N) without a copy, its gradient handed back in that layout (autocast takes the general product)
        if columns.is_contiguous() and not autocast_enabled(columns.device.type):
            return _columns_output_gemm(output, columns.view(batch, heads * width, length), coefficients)
        flat = head_values.permute(0, 2, 1, 3).reshape(batch, length, heads * width)
        return torch.baddbmm(output.expand(batch, length, coefficients.shape[-1]), flat, coefficients)

    def project_out(self, heads: Tensor) -> Tensor:
        """Concatenate heads ``(B, H, N, C / H)`` and apply the output projection and dropout: ``(B, N, C)``."""
        return self.dropout(self.out_proj(self.merge_heads(heads)))

    def project_out_moments(self, mean_heads: Tensor, variance_heads: Tensor) -> tuple[Tensor, Tensor]:
        r"""Push per-head marginal moments through the output projection (no dropout).

        With independent head outputs :math:`h` (variances :math:`\sigma^2`) and ``out_proj`` :math:`y = W h + b`,
        the output has mean :math:`W \mu + b` and variance :math:`(W \odot W) \sigma^2`.

        :param mean_heads: shape ``(B, H, N, C / H)``.
        :param variance_heads: shape ``(B, H, N, C / H)``, independent entries.
        :return: Mean and variance, each of shape ``(B, N, C)``.
        """
        mean = self.out_proj(self.merge_heads(mean_heads))
        variance = self.merge_heads(variance_heads) @ self.out_proj.weight.square().mT
        return mean, variance

    # -- probabilistic interface -------------------------------------------------------------------------------------
    @property
    def sampling(self) -> bool:
        """Whether ``forward`` returns a sample (training, or eval inside :func:`sample_attention`)."""
        return self.is_stochastic and (self.training or self.sample_in_eval)

    def kl_divergence(self) -> Tensor:
        """Sum of the KL terms of the layer (zero for deterministic layers), a scalar."""
        parameter = next(self.parameters())
        return torch.zeros((), dtype=parameter.dtype, device=parameter.device)

    def learned_spectrum(self) -> Tensor | None:
        """The learned KSVD singular values per head, shape ``(H, s)``, or ``None`` for layers without a learned
        spectrum (the default; e.g. softmax or SGPA attention, and KSVD layers whose singular values are recomputed
        exactly per sequence). ``gpattn compare`` records and plots it for every layer that has one."""
        return None

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of the output, each ``(B, N, C)``, as in eval mode (no dropout) whatever the
        layer's mode (:meth:`predictive_mean`); deterministic layers have zero variance."""
        mean = self.predictive_mean(x, mask, context)
        return mean, torch.zeros_like(mean)

    def predictive_mean(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        """The output as eval mode gives it, whatever the layer's mode: the predictive mean of a stochastic layer
        (sampling off, also inside :func:`sample_attention`), without dropout, shape ``(B, N, C)``. The call runs
        :meth:`forward` :meth:`as_in_eval`: the layer and every submodule keep their own modes, and the added loss
        terms and :attr:`call_results` of the last ``forward`` call (the loss of a training step) stay as they were."""
        with self.as_in_eval():
            return self(x, mask=mask, context=context)

    @contextmanager
    def as_in_eval(self) -> Iterator[AttentionLayer]:
        """Within the block the layer is in eval mode with sampling off (no dropout, no sample); on exit every
        submodule gets back its own mode (:func:`restored_modes`), every attention layer its sampling switch, and every
        submodule the added loss terms and :attr:`call_results` it had on entry (:func:`kept_call_results`: a
        ``forward`` call inside the block does not replace the loss of the last training step). Cost O(number of
        submodules)."""
        layers = [module for module in self.modules() if isinstance(module, AttentionLayer)]
        sampling = [layer.sample_in_eval for layer in layers]
        with restored_modes(self), kept_call_results(self):
            try:
                self.eval()
                for layer in layers:
                    layer.sample_in_eval = False
                yield self
            finally:
                for layer, value in zip(layers, sampling, strict=True):
                    layer.sample_in_eval = value

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        """Attend: a reparameterised sample of the output (stochastic layers in training, or inside
        :func:`sample_attention`) or its predictive mean (eval mode, deterministic layers).

        :param x: Query tokens, shape ``(B, N, C)``.
        :param mask: ``None``, a boolean padding mask of shape ``(B, M)`` (``True`` = real token) or ``"causal"``.
            Every sequence needs a real token: a mask that hides a whole sequence raises ``ValueError``, or, under
            ``torch.compile`` on torch 2.9 and later (not ROCm), where the check is an asynchronous assertion instead
            of a data-dependent branch, a ``RuntimeError`` when the step runs; on a GPU that is a device-side
            assertion, after which the process's CUDA context is unusable.
        :param context: Key tokens of shape ``(B, M, C)`` for cross-attention, or ``None`` (self-attention).
        :return: shape ``(B, N, C)``.
        """
        raise NotImplementedError


class _ColumnsOutputGEMM(torch.autograd.Function):
    r""":math:`y = o + S^\top A` for columns :math:`S` (``(B, K, N)``, contiguous), coefficients :math:`A`
    (``(B, K, C)``) and ``o`` broadcastable to ``(B, N, C)``; the backward pass gives :math:`\bar S = A \bar y^\top`
    as a contiguous ``(B, K, N)`` tensor, :math:`\bar A = S \bar y` and :math:`\bar o` summed to ``o``'s shape.
    The backward pass is made of differentiable operations on the saved inputs (double backward works)."""

    @staticmethod
    def forward(ctx, output: Tensor, columns: Tensor, coefficients: Tensor) -> Tensor:
        ctx.save_for_backward(columns, coefficients)
        ctx.output_shape = output.shape
        batch, _, length = columns.shape
        return torch.baddbmm(output.expand(batch, length, coefficients.shape[-1]), columns.mT, coefficients)

    @staticmethod
    def backward(ctx, grad: Tensor):
        columns, coefficients = ctx.saved_tensors
        grad_output = grad.sum_to_size(ctx.output_shape) if ctx.needs_input_grad[0] else None
        grad_columns = coefficients @ grad.mT if ctx.needs_input_grad[1] else None  # (B, K, C) x (B, C, N)
        grad_coefficients = columns @ grad if ctx.needs_input_grad[2] else None  # (B, K, N) x (B, N, C)
        return grad_output, grad_columns, grad_coefficients


# as torch.compile should meet it (gpattn._torch_compat.compilable: a graph break on torch < 2.4)
_columns_output_gemm = compilable(_ColumnsOutputGEMM.apply)


@contextmanager
def sample_attention(module: torch.nn.Module, enabled: bool = True):
    """Within the block, every stochastic :class:`AttentionLayer` in ``module`` returns samples in eval mode too
    (Monte Carlo prediction); restores the previous setting afterwards."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sample_attention: expected a torch.nn.Module, got {type(module).__name__}")
    enabled = check_bool("enabled", enabled, where="sample_attention")  # enabled="no" would switch sampling on
    layers = [layer for layer in module.modules() if isinstance(layer, AttentionLayer)]
    previous = [layer.sample_in_eval for layer in layers]
    for layer in layers:
        layer.sample_in_eval = enabled
    try:
        yield module
    finally:
        for layer, value in zip(layers, previous, strict=True):
            layer.sample_in_eval = value
