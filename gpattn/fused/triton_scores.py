r"""Triton kernels of the fused amortised scores (:class:`~gpattn.features.amortized_scores.AmortizedSelfScores`):
the pass from the feature columns and the values to the scores, the weights and the token sums, and its backward pass,
each one launch of ``B * H`` programs instead of about fifteen PyTorch operators.

With the notation of :mod:`gpattn.features.amortized_scores`, the program of one sequence and head reads its
``(p, N)`` feature columns :math:`P_q, P_k` and ``(s, N)`` values :math:`a_r, a_e` tile by tile along the tokens,
twice:

* forward: the first sweep forms the inverse norms :math:`\nu` and accumulates :math:`W_r^\top = (a_r \circ c \nu_q w)
  P_q^\top` and :math:`W_e^\top` in registers; the second forms :math:`e^\top = c\, (W_e^\top P_q) \circ \nu_q`,
  :math:`r^\top` and the token sums :math:`\sum_i m_i e_{ik}^2`, :math:`\sum_j m_j r_{jk}^2`;
* backward: the first sweep accumulates the total gradients of :math:`W_e^\top, W_r^\top` (through the scores, and
  :math:`-\bar J` times the other weight from the trace of :math:`J`); the second forms the gradients of the feature
  columns (the GEMM of inner dimension :math:`2s` and the norms' term) and of the values, and the sums the output
  scale's gradient needs.

The norms are formed again from the columns in every sweep (one pass over a tile already loaded) rather than stored
and read back. The projection GEMMs before and after stay cuBLAS's. The PyTorch code of the autograd function is the
reference and the CPU path: :func:`runs_triton` decides, and the tests run these kernels on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``) against it.
"""

from __future__ import annotations

import functools
import os
import typing

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

from .._torch_compat import is_compiling
from .autocast import wide_dtype

#: the oldest Triton the kernels are written for (the ``gpu`` extra's floor): an older one (torch 2.1-2.3 bring Triton
#: 2.x) is left unused, as if absent, and the PyTorch path runs
TRITON_MINIMUM = (3, 0)

try:  # optional: pip install gpattn[gpu]
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = tl = None
else:
    if TorchVersion(triton.__version__) < TRITON_MINIMUM:
        triton = tl = None

__all__ = [
    "TOKENS_PER_PROGRAM",
    "TRITON_MAX_TOKENS",
    "TRITON_VARIABLE",
    "runs_triton",
    "scores_backward",
    "scores_forward",
    "triton_available",
]

#: set to ``0`` to keep the PyTorch path on CUDA (A/B timings), to ``1`` to let the interpreter take it on CPU
TRITON_VARIABLE = "GPATTN_TRITON"
#: dtypes of the feature columns the kernels take on a GPU (float64 stays on PyTorch's path there)
GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: tokens per tile
BLOCK_N = 64
#: the most tokens one program sweeps: longer sequences are split over ceil(N / TOKENS_PER_PROGRAM) programs per
#: sequence and head (a second grid axis), each sweeping a chunk of whole tiles, with the sums over the tokens
#: (weights, norms, token sums) written per chunk and reduced in a fixed order between two launches per pass. Only
#: sequences beyond TRITON_MAX_TOKENS are split, which take the kernels when GPATTN_TRITON=1 asks for them. On one
#: H200 (N = 16384, four programs per sequence and head) they took 9.39 ms against the PyTorch path's 9.95
#: (benchmarks/gpu_check.py's ``kep_svgp_triton`` row); their values are checked on a GPU at a split length by the
#: same script's ``kep_svgp_split_triton_vs_pytorch``, which has not run yet: the default waits for it
TOKENS_PER_PROGRAM = 4096
#: the longest sequences that take the kernels by default: each of their ``B * H`` programs sweeps all ``N`` tokens
#: twice, so that long sequences of a small batch leave most of a GPU idle. On one NVIDIA H200 (B = 16, 4 heads, s =
#: 10, float32, fwd + bwd; docs/guide/benchmarks.md) the kernels took 9.23 / 7.86 / 9.14 ms at N = 256 / 1024 / 4096
#: against the PyTorch path's 10.14 / 8.61 / 8.87, and 15.21 against 11.85 at N = 16384
TRITON_MAX_TOKENS = 4096


def triton_available() -> bool:
    """Whether Triton is installed (the ``gpu`` extra), at least :data:`TRITON_MINIMUM`."""
    return triton is not None


def _interpreting() -> bool:
    # whether Triton's interpreter is on, as Triton itself reads TRITON_INTERPRET when it decorates a kernel: its knobs
    # (Triton >= 3.4: "1", "true", "on", ... on; "0", "false", "off", ... off), else "1" alone (older ones). Another
    # reading disagreed with Triton's for e.g. "false": the GPU's compiled kernels were then taken for the interpreter's
    # (the PyTorch path by default, compiled kernels launched on CPU tensors with GPATTN_TRITON=1)
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def runs_triton(columns: Tensor) -> bool:
    """Whether the fused scores of ``columns`` (``(B, 2, H, p, N)``) take the Triton kernels: Triton is installed, the
    call is not being compiled by ``torch.compile`` (whose own kernels then fuse the PyTorch code), ``GPATTN_TRITON``
    is not ``0``, and either the columns are a CUDA tensor of float32, bfloat16 or float16 with at most
    :data:`TRITON_MAX_TOKENS` tokens (``GPATTN_TRITON=1``: any number), or Triton's interpreter is on
    (``TRITON_INTERPRET=1``) and ``GPATTN_TRITON=1`` asks for it (the tests: any device and dtype)."""
    if triton is None or is_compiling():
        return False
    setting = os.environ.get(TRITON_VARIABLE, "")
    if setting == "0":
        return False
    if _interpreting():
        return setting == "1"
    fits = setting == "1" or columns.shape[-1] <= TRITON_MAX_TOKENS
    return columns.is_cuda and columns.dtype in GPU_DTYPES and fits


def _chunks(length: int) -> tuple[int, int]:
    """``(tokens per chunk, chunks)`` of a sequence of ``length`` tokens: one chunk up to :data:`TOKENS_PER_PROGRAM`,
    else as many equal chunks of whole tiles as keep each within it (the last one shorter)."""
    if length <= TOKENS_PER_PROGRAM:
        return length, 1
    count = -(-length // TOKENS_PER_PROGRAM)
    per_chunk = -(-length // count)
    per_chunk = -(-per_chunk // BLOCK_N) * BLOCK_N  # whole tiles
    return per_chunk, -(-length // per_chunk)


def _padded(size: int) -> int:
    # tl.dot needs every dimension a power of two of at least 16
    return max(16, triton.next_power_of_2(size))


def _dtypes(dtype: torch.dtype) -> tuple:
    # (accumulation, dot operands) of the kernels for columns of ``dtype``: half-precision products on the GPU's
    # matrix units; the interpreter multiplies half-precision operands as integers, so it takes float32 ones
    if dtype == torch.float64:
        return tl.float64, tl.float64
    if dtype in (torch.bfloat16, torch.float16) and not _interpreting():
        return tl.float32, tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    return tl.float32, tl.float32


def scores_forward(
    columns: Tensor, values: Tensor, token_weights: Tensor | float, square_mask: Tensor | None, root_scale: Tensor,
    sums: bool, floor: float,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:  # fmt: skip
    r"""The forward sweep of one launch: scores :math:`[e^\top; r^\top]` ``(B, 2, H, s, N)`` in the columns' dtype,
    ``paired`` :math:`[W_r^\top; W_e^\top]` ``(B, 2, H, s, p)`` and, with ``sums``, the token sums ``(B, 2, H, s)``
    (float32, or float64 for float64 columns), and the sum of the squared norms per sequence and head ``(B, H)`` (for
    the finiteness check).

    :param columns: :math:`[P_q; P_k]`, contiguous ``(B, 2, H, p, N)``.
    :param values: :math:`[a_r; a_e]`, contiguous ``(B, 2, H, s, N)``.
    :param token_weights: :math:`w`: a float or ``(B, 1, 1, 1, N)``.
    :param square_mask: ``None`` or the float padding mask ``(B, 1, 1, 1, N)``.
    :param root_scale: :math:`c`, ``(H,)``.
    :param sums: Form the token sums.
    :param floor: The squared norm below which a column is not normalised further.
    """
    batch, _, heads, features, length = columns.shape
    rank = values.shape[-2]
    wide = wide_dtype(columns.dtype)
    scores = torch.empty_like(values, dtype=columns.dtype)
    paired = torch.empty(batch, 2, heads, rank, features, dtype=wide, device=columns.device)
    token_sums = torch.empty(batch, 2, heads, rank, dtype=wide, device=columns.device) if sums else paired
    squared = torch.empty(batch, heads, dtype=wide, device=columns.device)
    weights = token_weights if torch.is_tensor(token_weights) else None
    accumulate, operands = _dtypes(columns.dtype)
    chunk_tokens, chunks = _chunks(length)
    strides = (paired.numel(), token_sums.numel() if sums else 0, squared.numel())  # one chunk's partial sums apart

    def launch(phase: int, paired_out: Tensor, sums_out: Tensor, squared_out: Tensor) -> None:
        _kernels()[0][(batch * heads, chunks if phase else 1)](
            columns, values, scores, paired_out, sums_out, squared_out,
            columns if weights is None else weights.reshape(batch if weights.shape[0] > 1 else 1, length),
            columns if square_mask is None else square_mask.reshape(batch, length),
            root_scale.to(wide).contiguous(),
            0.0 if weights is not None else float(token_weights), floor,
            heads, length, features, rank, 0 if weights is None or weights.shape[0] == 1 else length,
            chunk_tokens, *(stride if phase else 0 for stride in strides),
            P_PAD=_padded(features), S_PAD=_padded(rank), BLOCK_N=BLOCK_N, HAS_WEIGHTS=weights is not None,
            HAS_MASK=square_mask is not None, WITH_SUMS=sums, ACC=accumulate, DOT=operands,
            IEEE=operands == tl.float32, PHASE=phase,
        )  # fmt: skip

    if chunks == 1:
        launch(0, paired, token_sums, squared)
        return scores, paired, token_sums if sums else None, squared
    # the tokens split over chunks: partial weights and norms per chunk, summed in a fixed order, then the scores
    partial_paired = paired.new_empty(chunks, *paired.shape)
    partial_squared = squared.new_empty(chunks, *squared.shape)
    launch(1, partial_paired, token_sums, partial_squared)
    paired, squared = partial_paired.sum(0), partial_squared.sum(0)
    partial_sums = token_sums.new_empty(chunks, *token_sums.shape) if sums else paired
    launch(2, paired, partial_sums, squared)
    return scores, paired, partial_sums.sum(0) if sums else None, squared


def scores_backward(
    columns: Tensor, values: Tensor, scores: Tensor, paired: Tensor, grad_scores: Tensor | None,
    grad_objective: Tensor | None, sums_factor: Tensor | None, token_weights: Tensor | float,
    square_mask: Tensor | None, root_scale: Tensor, floor: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    r"""The backward sweep of one launch: the gradients of the feature columns ``(B, 2, H, p, N)`` and of the values
    ``(B, 2, H, s, N)`` (the columns' dtype), the total gradient of ``paired`` ``(B, 2, H, s, p)`` and the sums
    :math:`\sum_k \bar\beta_k e_k / (c \nu)` over the tokens of both branches per sequence and head ``(B, H)``.

    :param grad_scores: The scores' gradient, or ``None`` (unused).
    :param grad_objective: :math:`\bar J` ``(B, H)``, or ``None``.
    :param sums_factor: :math:`\bar J / (2 \lambda)` ``(B, H, s)``, or ``None`` (with ``grad_objective``).
    """
    batch, _, heads, features, length = columns.shape
    rank = values.shape[-2]
    wide = paired.dtype
    grad_columns = torch.empty_like(columns)
    grad_values = torch.empty_like(values, dtype=columns.dtype)
    total_paired = torch.empty_like(paired)
    score_sums = torch.empty(batch, heads, dtype=wide, device=columns.device)
    weights = token_weights if torch.is_tensor(token_weights) else None
    objective = grad_objective is not None
    accumulate, operands = _dtypes(columns.dtype)
    chunk_tokens, chunks = _chunks(length)
    strides = (total_paired.numel(), score_sums.numel())  # one chunk's partial sums apart
    grad_scores = columns if grad_scores is None else grad_scores.contiguous()
    grad_objective = paired if not objective else grad_objective.to(wide).contiguous()
    sums_factor = paired if not objective else sums_factor.to(wide).contiguous()

    def launch(phase: int, totals_out: Tensor, reduced: Tensor, score_out: Tensor) -> None:
        _kernels()[1][(batch * heads, chunks if phase else 1)](
            columns, values, scores, paired, grad_scores, grad_objective, sums_factor,
            grad_columns, grad_values, totals_out, score_out,
            columns if weights is None else weights.reshape(batch if weights.shape[0] > 1 else 1, length),
            columns if square_mask is None else square_mask.reshape(batch, length),
            root_scale.to(wide).contiguous(),
            0.0 if weights is not None else float(token_weights), floor,
            heads, length, features, rank, 0 if weights is None or weights.shape[0] == 1 else length,
            reduced, chunk_tokens, *(stride if phase else 0 for stride in strides),
            P_PAD=_padded(features), S_PAD=_padded(rank), BLOCK_N=BLOCK_N, HAS_WEIGHTS=weights is not None,
            HAS_MASK=square_mask is not None, HAS_GRAD=grad_scores is not columns, HAS_OBJECTIVE=objective,
            ACC=accumulate, DOT=operands, IEEE=operands == tl.float32, PHASE=phase,
        )  # fmt: skip

    if chunks == 1:
        launch(0, total_paired, paired, score_sums)
        return grad_columns, grad_values, total_paired, score_sums
    # the tokens split over chunks: partial totals per chunk, summed in a fixed order, then the gradients
    partial_totals = total_paired.new_empty(chunks, *total_paired.shape)
    launch(1, partial_totals, paired, score_sums)
    partial_scores = score_sums.new_empty(chunks, *score_sums.shape)
    launch(2, total_paired, partial_totals.sum(0), partial_scores)
    return grad_columns, grad_values, total_paired, partial_scores.sum(0)


@functools.cache
def _compiled(interpret: bool) -> tuple:
    # the kernels, decorated on first use (Triton reads TRITON_INTERPRET when it decorates): one pair per mode. Their
    # annotations are strings in this module (PEP 563), which Triton 3.0 does not read as tl.constexpr (3.6 and 3.9
    # do): it is handed the evaluated ones
    for kernel in (_forward_kernel, _backward_kernel):
        kernel.__annotations__ = typing.get_type_hints(kernel)
    return triton.jit(_forward_kernel), triton.jit(_backward_kernel)


def _kernels() -> tuple:
    return _compiled(_interpreting())


# -- the kernels (plain functions, decorated by _compiled) ------------------------------------------------------------
def _forward_kernel(
    columns, values, scores, paired, token_sums, squared, weights, mask, root,
    weight_value, floor, heads, length, features, rank, weight_stride, chunk_tokens, paired_stride, sums_stride,
    squared_stride,
    P_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    HAS_MASK: tl.constexpr, WITH_SUMS: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    PHASE: tl.constexpr,
):  # fmt: skip
    # PHASE 0: both sweeps over all tokens, one program per sequence and head. Tokens split over a second grid axis
    # (chunks of chunk_tokens): PHASE 1 sweeps its chunk once and writes partial weights and squared norms at the
    # chunk's offsets (*_stride apart), reduced between the launches; PHASE 2 reads the reduced weights and sweeps its
    # chunk again for the scores and partial token sums
    program = tl.program_id(0)
    chunk = tl.program_id(1)
    begin = chunk * chunk_tokens
    end = tl.minimum(begin + chunk_tokens, length)
    sequence = program // heads
    head = program % heads
    query = sequence * 2 * heads + head  # block (sequence, 0, head): P_q, a_r, e, W_r
    key = query + heads  # block (sequence, 1, head): P_k, a_e, r, W_e
    p_rows = tl.arange(0, P_PAD)
    s_rows = tl.arange(0, S_PAD)
    p_valid = p_rows < features
    s_valid = s_rows < rank
    c = tl.load(root + head).to(ACC)
    sp_offsets = s_rows[:, None] * features + p_rows[None, :]
    sp_valid = s_valid[:, None] & p_valid[None, :]
    if PHASE == 2:  # the weights of every chunk, reduced between the launches
        w_r = tl.load(paired + query * rank * features + sp_offsets, mask=sp_valid, other=0.0).to(ACC)
        w_e = tl.load(paired + key * rank * features + sp_offsets, mask=sp_valid, other=0.0).to(ACC)
    else:  # the first sweep: W_r^T, W_e^T and the squared norms over [begin, end)
        w_r = tl.zeros((S_PAD, P_PAD), dtype=ACC)
        w_e = tl.zeros((S_PAD, P_PAD), dtype=ACC)
        total = tl.zeros((BLOCK_N,), dtype=ACC)
        for start in range(begin, end, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            t_valid = tokens < end
            p_tile = p_valid[:, None] & t_valid[None, :]
            s_tile = s_valid[:, None] & t_valid[None, :]
            p_offsets = p_rows[:, None] * length + tokens[None, :]
            s_offsets = s_rows[:, None] * length + tokens[None, :]
            pq = tl.load(columns + query * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            pk = tl.load(columns + key * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            square_q = tl.sum(pq * pq, axis=0)
            square_k = tl.sum(pk * pk, axis=0)
            total += tl.where(t_valid, square_q + square_k, 0.0)
            if HAS_WEIGHTS:
                w = tl.load(weights + sequence * weight_stride + tokens, mask=t_valid, other=0.0).to(ACC)
            else:
                w = tl.zeros((BLOCK_N,), dtype=ACC) + weight_value
            factor_q = c * w / tl.sqrt(tl.maximum(square_q, floor))
            factor_k = c * w / tl.sqrt(tl.maximum(square_k, floor))
            a_r = tl.load(values + query * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            a_e = tl.load(values + key * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            alpha_r = (a_r * factor_q[None, :]).to(DOT)
            alpha_e = (a_e * factor_k[None, :]).to(DOT)
            if IEEE:
                w_r += tl.dot(alpha_r, tl.trans(pq.to(DOT)), input_precision="ieee")
                w_e += tl.dot(alpha_e, tl.trans(pk.to(DOT)), input_precision="ieee")
            else:
                w_r += tl.dot(alpha_r, tl.trans(pq.to(DOT))).to(ACC)
                w_e += tl.dot(alpha_e, tl.trans(pk.to(DOT))).to(ACC)
        tl.store(paired + chunk * paired_stride + query * rank * features + sp_offsets, w_r, mask=sp_valid)
        tl.store(paired + chunk * paired_stride + key * rank * features + sp_offsets, w_e, mask=sp_valid)
        tl.store(squared + chunk * squared_stride + program, tl.sum(total, axis=0))
    if PHASE != 1:  # the second sweep: the scores and their token sums over [begin, end)
        sums_e = tl.zeros((S_PAD,), dtype=ACC)
        sums_r = tl.zeros((S_PAD,), dtype=ACC)
        for start in range(begin, end, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            t_valid = tokens < end
            p_tile = p_valid[:, None] & t_valid[None, :]
            s_tile = s_valid[:, None] & t_valid[None, :]
            p_offsets = p_rows[:, None] * length + tokens[None, :]
            s_offsets = s_rows[:, None] * length + tokens[None, :]
            pq = tl.load(columns + query * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            pk = tl.load(columns + key * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            scale_q = c / tl.sqrt(tl.maximum(tl.sum(pq * pq, axis=0), floor))
            scale_k = c / tl.sqrt(tl.maximum(tl.sum(pk * pk, axis=0), floor))
            if IEEE:
                e = tl.dot(w_e.to(DOT), pq.to(DOT), input_precision="ieee") * scale_q[None, :]
                r = tl.dot(w_r.to(DOT), pk.to(DOT), input_precision="ieee") * scale_k[None, :]
            else:
                e = tl.dot(w_e.to(DOT), pq.to(DOT)).to(ACC) * scale_q[None, :]
                r = tl.dot(w_r.to(DOT), pk.to(DOT)).to(ACC) * scale_k[None, :]
            tl.store(scores + query * rank * length + s_offsets, e.to(scores.dtype.element_ty), mask=s_tile)
            tl.store(scores + key * rank * length + s_offsets, r.to(scores.dtype.element_ty), mask=s_tile)
            if WITH_SUMS:
                if HAS_MASK:
                    m = tl.load(mask + sequence * length + tokens, mask=t_valid, other=0.0).to(ACC)
                else:
                    m = tl.where(t_valid, 1.0, 0.0).to(ACC)
                sums_e += tl.sum(e * e * m[None, :], axis=1)
                sums_r += tl.sum(r * r * m[None, :], axis=1)
        if WITH_SUMS:
            tl.store(token_sums + chunk * sums_stride + query * rank + s_rows, sums_e, mask=s_valid)
            tl.store(token_sums + chunk * sums_stride + key * rank + s_rows, sums_r, mask=s_valid)


def _backward_kernel(
    columns, values, scores, paired, grad_scores, grad_objective, sums_factor, grad_columns, grad_values,
    total_paired, score_sums, weights, mask, root, weight_value, floor, heads, length, features, rank,
    weight_stride, reduced, chunk_tokens, paired_stride, score_stride,
    P_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_OBJECTIVE: tl.constexpr, ACC: tl.constexpr,
    DOT: tl.constexpr, IEEE: tl.constexpr, PHASE: tl.constexpr,
):  # fmt: skip
    # PHASE 0: both sweeps over all tokens. Tokens split over a second grid axis (chunks of chunk_tokens): PHASE 1
    # writes each chunk's partial total gradients of the weights (without the trace term) at the chunk's offset in
    # total_paired, reduced between the launches into ``reduced``; PHASE 2 reads them, adds the trace term (the first
    # chunk stores the totals) and sweeps its chunk for the gradients of the columns and values and partial score sums
    program = tl.program_id(0)
    chunk = tl.program_id(1)
    begin = chunk * chunk_tokens
    end = tl.minimum(begin + chunk_tokens, length)
    sequence = program // heads
    head = program % heads
    query = sequence * 2 * heads + head
    key = query + heads
    p_rows = tl.arange(0, P_PAD)
    s_rows = tl.arange(0, S_PAD)
    p_valid = p_rows < features
    s_valid = s_rows < rank
    c = tl.load(root + head).to(ACC)
    sp_offsets = s_rows[:, None] * features + p_rows[None, :]
    sp_valid = s_valid[:, None] & p_valid[None, :]
    w_r = tl.load(paired + query * rank * features + sp_offsets, mask=sp_valid, other=0.0).to(ACC)  # W_r^T
    w_e = tl.load(paired + key * rank * features + sp_offsets, mask=sp_valid, other=0.0).to(ACC)  # W_e^T
    if HAS_OBJECTIVE:
        g_j = tl.load(grad_objective + program).to(ACC)
        twice = 2.0 * tl.load(sums_factor + program * rank + s_rows, mask=s_valid, other=0.0).to(ACC)  # dJ / lambda
    if PHASE == 2:  # the partial totals of every chunk, reduced between the launches
        t_r = tl.load(reduced + query * rank * features + sp_offsets, mask=sp_valid, other=0.0).to(ACC)
        t_e = tl.load(reduced + key * rank * features + sp_offsets, mask=sp_valid, other=0.0).to(ACC)
    else:
        # sweep 1: the total gradients of W_e^T (from e) and W_r^T (from r)
        t_e = tl.zeros((S_PAD, P_PAD), dtype=ACC)
        t_r = tl.zeros((S_PAD, P_PAD), dtype=ACC)
        for start in range(begin, end, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            t_valid = tokens < end
            p_tile = p_valid[:, None] & t_valid[None, :]
            s_tile = s_valid[:, None] & t_valid[None, :]
            p_offsets = p_rows[:, None] * length + tokens[None, :]
            s_offsets = s_rows[:, None] * length + tokens[None, :]
            pq = tl.load(columns + query * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            pk = tl.load(columns + key * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            scale_q = c / tl.sqrt(tl.maximum(tl.sum(pq * pq, axis=0), floor))
            scale_k = c / tl.sqrt(tl.maximum(tl.sum(pk * pk, axis=0), floor))
            if HAS_GRAD:
                g_e = tl.load(grad_scores + query * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
                g_r = tl.load(grad_scores + key * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            else:
                g_e = tl.zeros((S_PAD, BLOCK_N), dtype=ACC)
                g_r = tl.zeros((S_PAD, BLOCK_N), dtype=ACC)
            if HAS_OBJECTIVE:
                if HAS_MASK:
                    m = tl.load(mask + sequence * length + tokens, mask=t_valid, other=0.0).to(ACC)
                else:
                    m = tl.where(t_valid, 1.0, 0.0).to(ACC)
                e = tl.load(scores + query * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
                r = tl.load(scores + key * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
                g_e += twice[:, None] * m[None, :] * e
                g_r += twice[:, None] * m[None, :] * r
            beta_e = (g_e * scale_q[None, :]).to(DOT)
            beta_r = (g_r * scale_k[None, :]).to(DOT)
            if IEEE:
                t_e += tl.dot(beta_e, tl.trans(pq.to(DOT)), input_precision="ieee")
                t_r += tl.dot(beta_r, tl.trans(pk.to(DOT)), input_precision="ieee")
            else:
                t_e += tl.dot(beta_e, tl.trans(pq.to(DOT))).to(ACC)
                t_r += tl.dot(beta_r, tl.trans(pk.to(DOT))).to(ACC)
    if PHASE == 1:
        tl.store(total_paired + chunk * paired_stride + query * rank * features + sp_offsets, t_r, mask=sp_valid)
        tl.store(total_paired + chunk * paired_stride + key * rank * features + sp_offsets, t_e, mask=sp_valid)
    else:
        if HAS_OBJECTIVE:  # -dJ Tr(W_e^T W_r): each weight's gradient is -dJ times the other
            t_e -= g_j * w_r
            t_r -= g_j * w_e
        first_chunk = sp_valid & ((sp_offsets * 0 + chunk) == 0)  # one store of the totals per sequence and head
        tl.store(total_paired + query * rank * features + sp_offsets, t_r, mask=first_chunk)
        tl.store(total_paired + key * rank * features + sp_offsets, t_e, mask=first_chunk)
    if PHASE != 1:
        # sweep 2: the gradients of the columns and the values
        score_total = tl.zeros((BLOCK_N,), dtype=ACC)
        for start in range(begin, end, BLOCK_N):
            tokens = start + tl.arange(0, BLOCK_N)
            t_valid = tokens < end
            p_tile = p_valid[:, None] & t_valid[None, :]
            s_tile = s_valid[:, None] & t_valid[None, :]
            p_offsets = p_rows[:, None] * length + tokens[None, :]
            s_offsets = s_rows[:, None] * length + tokens[None, :]
            pq = tl.load(columns + query * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            pk = tl.load(columns + key * features * length + p_offsets, mask=p_tile, other=0.0).to(ACC)
            square_q = tl.sum(pq * pq, axis=0)
            square_k = tl.sum(pk * pk, axis=0)
            nu_q = 1.0 / tl.sqrt(tl.maximum(square_q, floor))
            nu_k = 1.0 / tl.sqrt(tl.maximum(square_k, floor))
            if HAS_WEIGHTS:
                w = tl.load(weights + sequence * weight_stride + tokens, mask=t_valid, other=0.0).to(ACC)
            else:
                w = tl.zeros((BLOCK_N,), dtype=ACC) + weight_value
            factor_q = c * nu_q * w
            factor_k = c * nu_k * w
            e = tl.load(scores + query * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            r = tl.load(scores + key * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            if HAS_GRAD:
                g_e = tl.load(grad_scores + query * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
                g_r = tl.load(grad_scores + key * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            else:
                g_e = tl.zeros((S_PAD, BLOCK_N), dtype=ACC)
                g_r = tl.zeros((S_PAD, BLOCK_N), dtype=ACC)
            if HAS_OBJECTIVE:
                if HAS_MASK:
                    m = tl.load(mask + sequence * length + tokens, mask=t_valid, other=0.0).to(ACC)
                else:
                    m = tl.where(t_valid, 1.0, 0.0).to(ACC)
                g_e += twice[:, None] * m[None, :] * e
                g_r += twice[:, None] * m[None, :] * r
            beta_e = g_e * (c * nu_q)[None, :]
            beta_r = g_r * (c * nu_k)[None, :]
            a_r = tl.load(values + query * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            a_e = tl.load(values + key * rank * length + s_offsets, mask=s_tile, other=0.0).to(ACC)
            alpha_r = (a_r * factor_q[None, :]).to(DOT)
            alpha_e = (a_e * factor_k[None, :]).to(DOT)
            if IEEE:
                ga_r = tl.dot(t_r.to(DOT), pq.to(DOT), input_precision="ieee")
                ga_e = tl.dot(t_e.to(DOT), pk.to(DOT), input_precision="ieee")
                gpq = tl.dot(tl.trans(w_e.to(DOT)), beta_e.to(DOT), input_precision="ieee")
                gpq += tl.dot(tl.trans(t_r.to(DOT)), alpha_r, input_precision="ieee")
                gpk = tl.dot(tl.trans(w_r.to(DOT)), beta_r.to(DOT), input_precision="ieee")
                gpk += tl.dot(tl.trans(t_e.to(DOT)), alpha_e, input_precision="ieee")
            else:
                ga_r = tl.dot(t_r.to(DOT), pq.to(DOT)).to(ACC)
                ga_e = tl.dot(t_e.to(DOT), pk.to(DOT)).to(ACC)
                gpq = tl.dot(tl.trans(w_e.to(DOT)), beta_e.to(DOT)).to(ACC)
                gpq += tl.dot(tl.trans(t_r.to(DOT)), alpha_r).to(ACC)
                gpk = tl.dot(tl.trans(w_r.to(DOT)), beta_r.to(DOT)).to(ACC)
                gpk += tl.dot(tl.trans(t_e.to(DOT)), alpha_e).to(ACC)
            part_q = tl.sum(beta_e * e, axis=0) / (c * nu_q)  # sum_k d beta_k e_k / (c nu)
            part_k = tl.sum(beta_r * r, axis=0) / (c * nu_k)
            score_total += tl.where(t_valid, part_q + part_k, 0.0)
            grad_nu_q = (part_q + tl.sum(ga_r * a_r, axis=0) * factor_q) / nu_q
            grad_nu_k = (part_k + tl.sum(ga_e * a_e, axis=0) * factor_k) / nu_k
            gpq -= pq * tl.where(square_q > floor, nu_q * nu_q * nu_q * grad_nu_q, 0.0)[None, :]
            gpk -= pk * tl.where(square_k > floor, nu_k * nu_k * nu_k * grad_nu_k, 0.0)[None, :]
            out = grad_columns.dtype.element_ty
            tl.store(grad_columns + query * features * length + p_offsets, gpq.to(out), mask=p_tile)
            tl.store(grad_columns + key * features * length + p_offsets, gpk.to(out), mask=p_tile)
            out = grad_values.dtype.element_ty
            tl.store(grad_values + query * rank * length + s_offsets, (ga_r * factor_q[None, :]).to(out), mask=s_tile)
            tl.store(grad_values + key * rank * length + s_offsets, (ga_e * factor_k[None, :]).to(out), mask=s_tile)
        tl.store(score_sums + chunk * score_stride + program, tl.sum(score_total, axis=0))
