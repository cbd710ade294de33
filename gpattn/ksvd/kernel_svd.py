"""Truncated singular value decomposition of an asymmetric kernel matrix, with a safeguarded backward pass."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._torch_compat import compilable
from ..validation import MAX_SEED, all_finite, check_choice, check_float, check_int, check_tensor

#: The methods of :func:`kernel_svd`: a full ``torch.linalg.svd`` truncated to the rank, or a seeded randomised range
#: finder with power iterations.
SVD_METHODS = ("exact", "randomized")
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class KernelSVD(NamedTuple):
    r"""A rank-:math:`s` kernel SVD :math:`K \approx H_e \Lambda H_r^\top`.

    :ivar left: :math:`H_e`, orthonormal columns, shape ``(*batch, N, s)``.
    :ivar singular_values: :math:`\lambda_1 \geq \dots \geq \lambda_s \geq 0`, shape ``(*batch, s)``.
    :ivar right: :math:`H_r`, orthonormal columns, shape ``(*batch, M, s)``.
    """

    left: Tensor
    singular_values: Tensor
    right: Tensor


def default_gradient_tolerance(dtype: torch.dtype) -> float:
    r"""The default relative broadening :math:`\delta` of near-degenerate pairs in :func:`kernel_svd`'s backward pass:
    the square root of the machine epsilon of ``dtype`` (about 1.5e-8 in float64, 3.5e-4 in float32)."""
    return torch.finfo(dtype).eps ** 0.5


def _broadened_inverse(values: Tensor, width: Tensor) -> Tensor:
    # x / (x^2 + w^2): 1 / x for |x| >> w, bounded by 1 / (2 w), exactly 0 at x = 0 (Lorentzian broadening)
    tiny = torch.finfo(values.dtype).tiny
    return values / (values * values + width * width).clamp_min(tiny)


def _svd_backward(
    left: Tensor,
    singular_values: Tensor,
    right: Tensor,
    left_grad: Tensor,
    singular_values_grad: Tensor,
    right_grad: Tensor,
    tolerance: float,
    num_rows: int,
    num_cols: int,
) -> Tensor:
    r"""Gradient of :math:`K` (``num_rows x num_cols``) from the gradients of ``k`` singular triplets
    :math:`K \approx U S V^\top` (real case).

    .. math::

        \bar K = U \big[(J S + S L) \circ F + \operatorname{diag}(\bar S)\big] V^\top
            + (I - U U^\top) \bar U S^{-1} V^\top + U S^{-1} \bar V^\top (I - V V^\top),

    with :math:`J = U^\top \bar U - \bar U^\top U`, :math:`L = V^\top \bar V - \bar V^\top V` and
    :math:`F_{ij} = 1 / (s_j^2 - s_i^2)` off the diagonal: Townsend (2016), the formula of ``torch.linalg.svd``'s
    backward. It is evaluated as

    .. math::

        (J S + S L)_{ij} F_{ij} = \tfrac12 \frac{(J + L)_{ij}}{s_j - s_i} + \tfrac12 \frac{(J - L)_{ij}}{s_j + s_i},

    so that only the first term is singular at a repeated pair. Its :math:`1 / (s_j - s_i)` becomes
    :math:`x / (x^2 + \epsilon_{ij}^2)` with :math:`\epsilon_{ij} = \delta \max(s_i, s_j)`; singular values at or below
    the noise floor :math:`\nu = \max(N, M)\, \varepsilon_{\text{machine}}\, s_1` count as zeros (their reciprocals and
    their couplings with each other are 0).

    Shapes: ``left`` and ``left_grad`` ``(*batch, N, k)``, ``singular_values`` and its gradient ``(*batch, k)``,
    ``right`` and ``right_grad`` ``(*batch, M, k)``; returns ``(*batch, N, M)``.
    """
    dtype_info = torch.finfo(singular_values.dtype)
    noise = max(num_rows, num_cols) * dtype_info.eps * singular_values[..., :1]  # nu; shape: (*batch, 1)
    alive = singular_values > noise  # not numerically zero; shape: (*batch, k)
    safe_values = singular_values.clamp_min(dtype_info.tiny)
    inverse_values = torch.where(alive, safe_values.reciprocal(), 0.0)  # S^+ (pseudo-inverse convention)
    rows, cols = singular_values.unsqueeze(-1), singular_values.unsqueeze(-2)  # s_i, s_j; shape: (*batch, k, 1), (1, k)
    pair_scale = torch.maximum(rows, cols)  # shape: (*batch, k, k)
    pair_alive = alive.unsqueeze(-1) | alive.unsqueeze(-2)
    # ~ 1 / (s_j - s_i), Lorentzian-broadened at the pair's scale (0 on the diagonal and for two zeros)
    inverse_differences = torch.where(pair_alive, _broadened_inverse(cols - rows, tolerance * pair_scale), 0.0)
    inverse_sums = torch.where(pair_alive, (rows + cols).clamp_min(dtype_info.tiny).reciprocal(), 0.0)  # 1/(s_j+s_i)
    left_inner = left.mT @ left_grad  # U^T gU; shape: (*batch, k, k)
    right_inner = right.mT @ right_grad  # V^T gV
    left_skew, right_skew = left_inner - left_inner.mT, right_inner - right_inner.mT  # J, L (zero diagonals)
    core = 0.5 * ((left_skew + right_skew) * inverse_differences + (left_skew - right_skew) * inverse_sums)
    matrix_grad = left @ (core + torch.diag_embed(singular_values_grad)) @ right.mT
    rank = singular_values.shape[-1]
    if num_rows > rank:  # (I - U U^T) gU S^{-1} V^T
        matrix_grad = matrix_grad + ((left_grad - left @ left_inner) * inverse_values.unsqueeze(-2)) @ right.mT
    if num_cols > rank:  # U S^{-1} gV^T (I - V V^T)
        matrix_grad = matrix_grad + left @ ((right_grad - right @ right_inner) * inverse_values.unsqueeze(-2)).mT
    return matrix_grad


class _SafeguardedSVD(torch.autograd.Function):
    """Singular triplets with the broadened backward of :func:`_svd_backward`.

    ``rank=None``: the reduced SVD of ``torch.linalg.svd`` (all ``min(N, M)`` triplets, so the backward is exact up to
    the broadening); an integer: the top-``rank`` triplets of the seeded randomised range finder, whose backward
    sees only those triplets (the discarded spectrum is taken as zero).
    """

    @staticmethod
    def forward(ctx, matrix, rank, oversampling, power_iterations, seed, tolerance):
        if rank is None:
            left, singular_values, right_h = torch.linalg.svd(matrix, full_matrices=False)
            right = right_h.mT
        else:
            left, singular_values, right = _randomized_svd(matrix, rank, oversampling, power_iterations, seed)
        ctx.tolerance, ctx.shape = tolerance, matrix.shape[-2:]
        ctx.save_for_backward(left, singular_values, right)
        return left, singular_values, right

    @staticmethod
    def backward(ctx, left_grad, singular_values_grad, right_grad):
        left, singular_values, right = ctx.saved_tensors
        with torch.autocast(left.device.type, enabled=False):  # the saved triplets' precision, not autocast's
            matrix_grad = _svd_backward(
                left, singular_values, right, left_grad, singular_values_grad, right_grad, ctx.tolerance, *ctx.shape
            )
        return matrix_grad, None, None, None, None, None


# as torch.compile should meet it (gpattn._torch_compat.compilable: a graph break on torch < 2.4)
_safeguarded_svd = compilable(_SafeguardedSVD.apply)


def _fix_signs(left: Tensor, right: Tensor) -> tuple[Tensor, Tensor]:
    # Flip each singular pair so that the largest-magnitude entry of its left vector is positive.
    pivot = left.abs().argmax(dim=-2, keepdim=True)  # shape: (*batch, 1, s)
    signs = torch.sign(torch.gather(left, -2, pivot))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return left * signs, right * signs


def _randomized_svd(
    matrix: Tensor, rank: int, oversampling: int, power_iterations: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    # Halko, Martinsson & Tropp (2011), Algorithms 4.4 and 5.1, with QR re-orthonormalisation.
    num_rows, num_cols = matrix.shape[-2:]
    sketch_size = min(rank + oversampling, num_rows, num_cols)
    generator = torch.Generator().manual_seed(seed)
    test_matrix = torch.randn(*matrix.shape[:-2], num_cols, sketch_size, generator=generator, dtype=matrix.dtype)
    basis = torch.linalg.qr(matrix @ test_matrix.to(matrix.device)).Q  # shape: (*batch, N, k)
    for _ in range(power_iterations):
        basis = torch.linalg.qr(matrix.mT @ basis).Q
        basis = torch.linalg.qr(matrix @ basis).Q
    small_left, singular_values, small_right_h = torch.linalg.svd(basis.mT @ matrix, full_matrices=False)
    return basis @ small_left[..., :rank], singular_values[..., :rank], small_right_h[..., :rank, :].mT


def kernel_svd(
    matrix: Tensor,
    rank: int,
    method: str = "exact",
    oversampling: int = 10,
    power_iterations: int = 4,
    seed: int = 0,
    gradient_tolerance: float | None = None,
) -> KernelSVD:
    r"""Top-:math:`s` singular triplets of a (batched, rectangular) kernel matrix.

    Returns :math:`H_e, \Lambda, H_r` with :math:`K H_r = H_e \Lambda` and :math:`K^\top H_e = H_r \Lambda`
    (exactly for ``method="exact"``; up to the randomised approximation otherwise), sorted decreasingly. The
    sign of each pair is fixed deterministically: the largest-magnitude entry of each left vector is positive.

    **Gradients.** The backward pass of an SVD divides by the gaps :math:`\lambda_j^2 - \lambda_i^2` between singular
    values and by the singular values themselves (rectangular :math:`K`): ``torch.linalg.svd`` returns NaN or huge
    gradients as soon as two singular values coincide (e.g. the zeros of a rank-deficient or padded matrix, even
    outside the top :math:`s`) or a kept one vanishes. This function has its own backward pass (Townsend, 2016, the
    formula of PyTorch, with :math:`1/(\lambda_j^2 - \lambda_i^2)` split into :math:`1/(\lambda_j - \lambda_i)` and
    :math:`1/(\lambda_j + \lambda_i)` terms) with two safeguards; the forward pass is untouched.

    * Near-degenerate pairs: :math:`1/(\lambda_j - \lambda_i)` is replaced by the Lorentzian broadening
      :math:`x / (x^2 + \epsilon_{ij}^2)` (Liao, Liu, Wang & Xiang, *Differentiable programming tensor networks*, PRX
      2019) with a width relative to the pair, :math:`\epsilon_{ij} = \delta \max(\lambda_i, \lambda_j)`,
      :math:`\delta` = ``gradient_tolerance``. Relative, so that the small but well separated singular values of a
      fast-decaying spectrum (smooth kernels) keep their exact gradient.
    * Numerical zeros: singular values at or below the noise floor :math:`\nu = \max(N, M)\,
      \varepsilon_{\text{machine}} \lambda_1` (``numpy.linalg.matrix_rank``'s tolerance: LAPACK cannot resolve them)
      count as exact zeros, the pseudo-inverse convention: their reciprocals in the :math:`S^{-1}` terms and their
      couplings with each other are 0; their couplings with larger singular values are kept.

    *Bias.* A pair with relative gap :math:`|\lambda_i - \lambda_j| \geq g \max(\lambda_i, \lambda_j)` has its
    coefficient multiplied by :math:`x^2 / (x^2 + \epsilon_{ij}^2)`, a relative error below :math:`(\delta / g)^2`
    (about 2e-16 / g^2 in float64, 1.2e-7 / g^2 in float32 with the default :math:`\delta`); values above
    :math:`\nu` are otherwise exact. Every coefficient is finite: at most :math:`1 / (2 \delta \max(\lambda_i,
    \lambda_j))` for a pair and :math:`1 / \nu` for a value. At an exactly repeated pair :math:`\lambda_i = \lambda_j
    > \nu` the term :math:`\tfrac12 (J + L)_{ij} / (\lambda_j - \lambda_i)` of the formula is dropped: it reads 0/0
    there, and its limit depends on how the loss changes as the pair splits, not on the incoming gradients alone.
    That is exact for losses that see a degenerate block only through :math:`\Lambda` and the left and right singular
    subspaces separately (functions of the singular values, of the projectors :math:`H_e H_e^\top`,
    :math:`H_r H_r^\top`). A loss that couples the left and right vectors of the block loses the symmetric part of
    its coupling: for :math:`\langle W, H_e \Lambda H_r^\top \rangle` with a repeated value among the kept ones, the
    gradient misses :math:`\tfrac12 H_b (B + B^\top - 2 \operatorname{diag} B) G_b^\top` with
    :math:`B = H_b^\top W G_b` and :math:`H_b`, :math:`G_b` the block's left and right vectors (the antisymmetric
    part is kept). Kept numerical zeros have arbitrary singular vectors: their share of the gradient is the
    pseudo-inverse choice (zero), not a derivative; the gradient jumps where a singular value crosses :math:`\nu`.

    float16 and bfloat16 matrices are decomposed in float32 (LAPACK has no half-precision SVD), with autocast off,
    and the triplets are returned in the matrix's dtype.

    With ``method="randomized"`` the backward pass sees only the :math:`s` computed triplets and treats the
    discarded spectrum as zero (the range finder is not differentiated): exact when :math:`\operatorname{rank} K
    \leq s`, with a relative bias :math:`O(\lambda_{s+1} / \lambda_s)` otherwise.

    :param matrix: :math:`K`, shape ``(*batch, N, M)``.
    :param rank: :math:`s \leq \min(N, M)` (a Python or NumPy integer).
    :param method: ``"exact"`` (``torch.linalg.svd``, O(N M min(N, M))) or ``"randomized"`` (a seeded
        randomised range finder with power iterations, O(N M (s + oversampling)) per pass).
    :param oversampling: Extra sketch columns of the randomised method (an integer >= 0).
    :param power_iterations: Subspace iterations of the randomised method (an integer >= 0).
    :param seed: Seed of the randomised sketch, a 64-bit integer as ``torch.Generator.manual_seed`` takes (the global
        RNG is not touched).
    :param gradient_tolerance: :math:`\delta \geq 0`, the relative width of the broadening of near-degenerate pairs
        (default :func:`default_gradient_tolerance`, :math:`\sqrt{\varepsilon_{\text{machine}}}` of the matrix's
        dtype); 0 gives the formula of ``torch.linalg.svd`` above the noise floor (exactly repeated singular values
        still contribute nothing instead of NaN).
    :return: A :class:`KernelSVD`.
    :raises InputTypeError: For a non-tensor or non-floating matrix, or a non-integer ``rank``, ``oversampling``,
        ``power_iterations`` or ``seed`` (bools included).
    :raises ValueError: For a matrix of fewer than two dimensions or with NaN or Inf, a ``rank`` outside
        :math:`[1, \min(N, M)]`, an unknown ``method``, a negative ``oversampling`` or ``power_iterations``, a seed
        outside the 64-bit range, or a ``gradient_tolerance`` that is negative or not finite.

    .. note:: Cost of the backward pass: O(N M k + (N + M) k^2) with :math:`k = \min(N, M)` (exact) or
        :math:`s` (randomised).
    """
    check_tensor("matrix", matrix, ("...", "N", "M"), floating=True, where="kernel_svd")
    if not all_finite(matrix):  # one pass and one read, also while captured: the SVD itself cannot be captured
        raise ValueError("kernel_svd: matrix contains NaN or Inf values")
    num_rows, num_cols = matrix.shape[-2:]
    rank = check_int("rank (at most min(N, M))", rank, 1, min(num_rows, num_cols), where="kernel_svd")
    check_choice("method", method, SVD_METHODS, where="kernel_svd")
    # a negative oversampling would shrink the sketch below the rank (fewer triplets than asked, silently)
    oversampling = check_int("oversampling", oversampling, minimum=0, where="kernel_svd")
    power_iterations = check_int("power_iterations", power_iterations, minimum=0, where="kernel_svd")
    seed = check_int("seed", seed, minimum=-(2**63), maximum=MAX_SEED, where="kernel_svd")
    if gradient_tolerance is not None:
        gradient_tolerance = check_float("gradient_tolerance", gradient_tolerance, minimum=0.0, where="kernel_svd")
    # LAPACK has no half-precision SVD: float16 and bfloat16 matrices are decomposed in float32 (also inside an
    # autocast region, which would otherwise send the randomised method's products back to half precision)
    work = matrix.float() if matrix.dtype in _HALF_DTYPES else matrix
    if gradient_tolerance is None:
        gradient_tolerance = default_gradient_tolerance(work.dtype)
    sketch_rank = None if method == "exact" else rank
    with torch.autocast(work.device.type, enabled=False):
        left, singular_values, right = _safeguarded_svd(
            work, sketch_rank, oversampling, power_iterations, seed, float(gradient_tolerance)
        )
    left, right = _fix_signs(left[..., :rank], right[..., :rank])
    result = KernelSVD(left, singular_values[..., :rank], right)
    return KernelSVD(*(part.to(matrix.dtype) for part in result)) if work is not matrix else result
