"""Kernel-eigen features of self-attention: the base class of the per-sequence KSVD scores, one subclass per mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._module_state import GraphFreeState
from ..kernels import CosineFeatureKernel, ExponentialDotProductKernel
from ..mlls import KSVDAddedLossTerm
from ..validation import check_bool, check_choice, check_float, check_int
from .kernel_eigen_features_base import KernelEigenFeaturesBase
from .kernel_eigen_scores import KernelEigenScores

#: ``form`` of the KSVD penalty: the token-sum :math:`J` (docs/math.md section 2) or the official code's number
KSVD_FORMS = ("sum", "official")
#: the attention layers' number of inducing variables (the KSVD rank s) when none is given: min(DEFAULT_NUM_INDUCING, p)
DEFAULT_NUM_INDUCING = 10
KERNELS = ("cosine", "exponential")


class AttentionKernelEigenFeatures(GraphFreeState, KernelEigenFeaturesBase):
    r"""Per-sequence KSVD scores of the attention kernel of every head (docs/math.md section 2): the base class of the
    attention feature modes.

    For queries :math:`X` (``N`` tokens) and keys :math:`Z` (``M`` tokens) of one sequence and one head, the scores
    are :math:`e(x) = \phi_q(x)^\top W_{e|X}`, :math:`r(z) = \phi_k(z)^\top W_{r|X}` with data-dependent weights
    :math:`W_{e|X}, W_{r|X} \in \mathbb R^{p \times s}` (learned modes) or the exact dual scores. One class per mode
    (:func:`~gpattn.features.build_attention_features` maps the user-facing names to them):

    * ``"amortized"`` (:class:`~gpattn.features.AmortizedAttentionFeatures`; gpattn's default): learned maps
      estimate the singular vectors; length-agnostic, padding and causal masks, cross-attention.
    * ``"primal_tokens"`` (:class:`~gpattn.features.PrimalTokensAttentionFeatures`): the official KEP-SVGP and
      Primal-Attention parametrisation :math:`W_{e|X} = \tilde X_h^\top \tilde W_e`; self-attention only.
    * ``"primal_features"`` (:class:`~gpattn.features.PrimalFeaturesAttentionFeatures`; a gpattn variant): learned
      per-position singular vectors; sequences of exactly ``max_len`` tokens, no masks.
    * ``"exact"`` (:class:`~gpattn.features.ExactAttentionFeatures`): the truncated SVD of the dense kernel of every
      sequence; :math:`\Lambda` belongs to each sequence.

    The layers ask the capability attributes below (and :attr:`learns_spectrum`, :attr:`spectrum_per_call`) what a
    mode supports; every mode registers the added loss term ``"ksvd_loss"`` (:math:`\eta J^2`, refreshed by every
    training call; zero in exact mode, where :math:`J = 0`).

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s` (default :math:`\min(10, p)`: the cosine kernel has rank at most :math:`p`).
    :param kernel: ``"cosine"`` (primal features :math:`\phi = W x / \|W x\|`) or ``"exponential"`` (exact mode
        only: the softmax numerator :math:`\exp(\langle W_q x, W_k z\rangle / \sqrt p)`).
    :param feature_dim: :math:`p` (default ``embed_dim // num_heads``).
    :param tie_qk: :math:`W_q = W_k` (symmetric kernel; the learned weights of both branches are tied too).
    :param max_len: The longest sequence, or the sequence length (see the modes).
    :param ksvd_weight: :math:`\eta \geq 0` of the KSVD penalty.
    :param ksvd_form: ``"sum"`` (:math:`\eta \operatorname{mean}_b \sum_h J_{bh}^2` with the token-sum :math:`J`) or
        ``"official"`` (``"primal_tokens"`` only), see :func:`~gpattn.ksvd.ksvd_objective`.
    :param options: The mode's own keyword arguments (:attr:`options`; e.g. ``rank_multiple`` and ``padding`` of
        :class:`~gpattn.features.PrimalTokensAttentionFeatures`); another name is refused.

    Example:
        >>> from gpattn.features import ATTENTION_FEATURES
        >>> for mode, cls in ATTENTION_FEATURES.items():  # what each mode supports, as the layers ask it
        ...     print(f"{mode:16} {cls.__name__:32} causal={cls.supports_causal} cross={cls.supports_cross_attention}")
        amortized        AmortizedAttentionFeatures       causal=True cross=True
        primal_tokens    PrimalTokensAttentionFeatures    causal=False cross=False
        primal_features  PrimalFeaturesAttentionFeatures  causal=False cross=False
        exact            ExactAttentionFeatures           causal=False cross=True

    :ivar supports_causal: A causal mask is accepted (prefix sums).
    :ivar supports_cross_attention: Keys other than the queries are accepted.
    :ivar supports_padding_mask: A padding mask is accepted.
    :ivar supports_graph_capture: A call can be captured into a CUDA graph (it reads no value on the host then).
    :ivar kernels: The kernels the mode accepts.
    :ivar ksvd_forms: The forms of the KSVD penalty the mode accepts.
    :ivar options: The names of the mode's own keyword arguments.
    """

    supports_causal: bool = False
    supports_cross_attention: bool = True
    supports_padding_mask: bool = True
    supports_graph_capture: bool = True
    kernels: tuple[str, ...] = ("cosine",)
    ksvd_forms: tuple[str, ...] = ("sum",)
    options: tuple[str, ...] = ()
    #: the calls the mode accepts, for the error raised on any other
    supported_calls: str = ""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_inducing: int | None = None,
        kernel: str = "cosine",
        feature_dim: int | None = None,
        tie_qk: bool = False,
        max_len: int | None = None,
        ksvd_weight: float = 1.0,
        ksvd_form: str = "sum",
        **options: Any,
    ):
        super().__init__()
        where = type(self).__name__
        if not hasattr(type(self), "mode"):
            raise TypeError(
                f"{where} is the base of the attention feature modes: build a mode's class, e.g. "
                "build_attention_features(embed_dim, num_heads, mode='amortized')"
            )
        check_choice("kernel", kernel, KERNELS, where=where)
        check_choice("ksvd_form", ksvd_form, KSVD_FORMS, where=where)
        if kernel not in self.kernels:
            raise ValueError(
                f"{where}: the {kernel} kernel has no finite primal features: use features='exact', not {self.mode!r}"
            )
        if ksvd_form not in self.ksvd_forms:
            raise ValueError(
                f"{where}: ksvd_form={ksvd_form!r} reads the raw per-position weights of the official "
                f"parametrisation: it needs features='primal_tokens', not {self.mode!r}"
            )
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            offered = f"its options are {list(self.options)}" if self.options else "it has none"
            raise ValueError(f"{where}: features={self.mode!r} takes no option {unknown}; {offered}")
        embed_dim = check_int("embed_dim", embed_dim, where=where)
        num_heads = check_int("num_heads", num_heads, where=where)
        feature_dim = embed_dim // num_heads if feature_dim is None else feature_dim
        feature_dim = check_int("feature_dim", feature_dim, where=where)
        if num_inducing is None:  # the cosine kernel has rank <= p: the default fits every (embed_dim, num_heads)
            num_inducing = min(DEFAULT_NUM_INDUCING, feature_dim)
        num_inducing = check_int("num_inducing", num_inducing, where=where)
        if kernel == "cosine" and num_inducing > feature_dim:  # K = Phi_q Phi_k^T has rank <= p
            raise ValueError(
                f"{where}: num_inducing ({num_inducing}) must not exceed the feature dimension ({feature_dim}) of a "
                "cosine kernel (its rank)"
            )
        if max_len is not None:  # also where the mode does not use it: a wrong value is a mistake either way
            max_len = check_int("max_len", max_len, where=where)
        self.embed_dim, self.num_heads, self.num_inducing = embed_dim, num_heads, num_inducing
        self.tie_qk, self.max_len, self.ksvd_form = check_bool("tie_qk", tie_qk, where=where), max_len, ksvd_form
        self.ksvd_weight = check_float("ksvd_weight", ksvd_weight, 0.0, where=where)
        self.register_added_loss_term("ksvd_loss")
        heads = torch.Size([num_heads])
        if kernel == "cosine":
            self.kernel = CosineFeatureKernel(embed_dim, feature_dim, tie=tie_qk, batch_shape=heads)
        else:
            self.kernel = ExponentialDotProductKernel(embed_dim, feature_dim, tie=tie_qk, batch_shape=heads)
        self._build(max_len, **options)

    def _build(self, max_len: int | None) -> None:
        """The mode's own checks of its arguments (and its :attr:`options`) and its parameters, after the kernel (called
        once by ``__init__``)."""

    def forward(
        self,
        queries: Tensor,
        keys: Tensor | None = None,
        key_mask: Tensor | None = None,
        causal: bool = False,
        objective: bool = True,
        kernel_diag: bool = True,
    ) -> KernelEigenScores:
        r"""The features of a batch of sequences: :math:`e` at the queries, :math:`r` at the keys, :math:`\Lambda`.

        The inputs are the layer's checked tokens (the attention layers check them once per call); a call the mode
        does not support (see the capability attributes) raises ``ValueError``. A training call with ``objective``
        refreshes the KSVD penalty ``"ksvd_loss"``; any other call clears it (``None``: an
        :class:`~gpattn.mlls.AttentionELBO` after an eval-mode pass has a zero ``"ksvd"`` part, not the last
        training pass's penalty).

        :param queries: ``(B, N, C)``.
        :param keys: ``(B, M, C)``, or ``None`` (self-attention: the queries).
        :param key_mask: ``(B, M)`` bool, ``True`` for real tokens (in self-attention it masks the queries too), at
            least one per sequence (a sequence without any gives NaN; the attention layers refuse such masks, a
            check that reads the mask on the host, so it is not repeated here).
        :param causal: Prefix sums (self-attention; :attr:`supports_causal` modes only).
        :param objective: Compute :math:`J` (O(N p s); needed in training only).
        :param kernel_diag: Compute :math:`k_e(x, x)`, :math:`k_r(z, z)` (O(N p^2), or O(N p^2) memory per
            position when causal; needed for the residual only).
        :return: A :class:`~gpattn.features.KernelEigenScores` with scores of shape ``(B, H, N, s)`` and ``(B, H, M,
            s)``, :math:`\Lambda` of shape ``(H, s)`` (learned) or ``(B, H, s)`` (exact), :math:`J` of shape ``(B, H)``
            and the kernel diagonals ``(B, H, N)``, ``(B, H, M)``.
        """
        keys = queries if keys is None else keys
        self._check_call(queries, keys, key_mask, causal)
        queries, keys = self._watched(queries, keys, causal, kernel_diag)
        scores = self._scores(queries, keys, key_mask, causal, objective, kernel_diag)
        official = self._official_objective(scores, key_mask) if objective else None
        self._check_scores(scores, official, queries, keys)
        return self._penalised(scores, official)

    def _scores(
        self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool, objective: bool, kernel_diag: bool
    ) -> KernelEigenScores:
        """The mode's scores of a checked call (see :meth:`forward`; ``keys`` is ``queries`` in self-attention)."""
        raise NotImplementedError

    def _watched(self, queries: Tensor, keys: Tensor, causal: bool, kernel_diag: bool) -> tuple[Tensor, Tensor]:
        """The tokens the scores of a call (``causal``, ``kernel_diag``: see :meth:`forward`) are computed from (a mode
        may wrap them to watch their gradients; ``keys`` stays ``queries`` in self-attention)."""
        return queries, keys

    def _check_scores(self, scores: KernelEigenScores, official: Tensor | None, queries: Tensor, keys: Tensor) -> None:
        """The mode's checks of a call's results against the magnitude of its tokens (nothing by default)."""

    def _official_objective(self, scores: KernelEigenScores, key_mask: Tensor | None) -> Tensor | None:
        """The official code's KSVD number of a call when the penalty takes that form, else ``None`` (sum form)."""
        return None

    def _check_call(self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool) -> None:
        """Reject a call the capabilities exclude, a causal call with a padding mask (the causal scores read no mask)
        and empty batches or sequences; O(1) (a subclass adds its checks of the sequence length)."""
        cross = queries is not keys
        if (
            (causal and not self.supports_causal)
            or (cross and not self.supports_cross_attention)
            or (key_mask is not None and not self.supports_padding_mask)
        ):
            raise ValueError(f"features={self.mode!r} supports {self.supported_calls}")
        if causal and key_mask is not None:
            raise ValueError(
                f"features={self.mode!r}: a causal call takes no key_mask (the causal scores would ignore it); "
                "left-padded sequences need their padding dropped, or a padding mask without causal"
            )
        if 0 in (queries.shape[0], queries.shape[-2], keys.shape[-2]):
            raise ValueError(
                f"features={self.mode!r}: expected at least one sequence and one token, got queries of shape "
                f"{tuple(queries.shape)} and keys of shape {tuple(keys.shape)}"
            )

    def _penalised(self, scores: KernelEigenScores, official: Tensor | None = None) -> KernelEigenScores:
        # a training call refreshes the KSVD penalty: eta J^2 averaged over the sequences and summed over the heads
        # (sum form), or eta J_off^2 (the official code's number)
        if self.training and scores.objective is not None:
            if official is not None:
                penalty = KSVDAddedLossTerm(official, self.ksvd_weight)
            else:
                penalty = KSVDAddedLossTerm(scores.objective, self.ksvd_weight, num_averaged_dims=1)
            # registered in __init__; a plain store (gpytorch's update_added_loss_term reads the previous entry, so
            # torch.compile would guard on it being None and recompile on the second step)
            self._added_loss_terms["ksvd_loss"] = penalty
        else:  # no J of this call (eval mode): no penalty, not the last training call's (stale, holding its graph)
            self._added_loss_terms["ksvd_loss"] = None
        return scores
