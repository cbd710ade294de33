"""Kernel-eigen inducing features: the KSVD state behind the kernel-eigen SVGP pair."""

from __future__ import annotations

from collections.abc import Callable

import torch
from gpytorch.utils.memoize import cached, clear_cache_hook
from torch import Tensor

from .._module_state import GraphFreeState
from ..kernels import AsymmetricKernel
from ..ksvd import SVD_METHODS, KernelSVD, kernel_svd, ksvd_objective
from ..mlls import KSVDAddedLossTerm
from ..validation import check_bool, check_choice, check_float, check_int, check_tensor
from .kernel_eigen_features_base import KernelEigenFeaturesBase
from .kernel_eigen_scores import SIDES, KernelEigenScores, induced_kernel_diag, numerically_nonzero

MODES = ("exact", "primal")


class KernelEigenFeatures(GraphFreeState, KernelEigenFeaturesBase):
    r"""Kernel-eigen inducing features of an asymmetric kernel on a landmark set.

    Holds the rank-:math:`s` KSVD :math:`\kappa(X, Z) \approx H_e \Lambda H_r^\top` of the kernel between query
    landmarks :math:`X` and key landmarks :math:`Z` (one set by default) and answers the projection scores

    .. math::

        e(x) = \kappa(x, Z) H_r, \qquad r(z) = \kappa(X, z)^\top H_e,

    for any query :math:`x` and key :math:`z`. The inducing variables :math:`u_e = H_e^\top f_e(X)` of the left
    GP :math:`f_e(x) = \kappa(x, Z) w` have :math:`K_{uu} = \Lambda^2` and :math:`K_{fu}(x) = e(x) \Lambda`; the
    right branch is the same with roles swapped. This object plays the role that ``inducing_points`` play in
    GPyTorch (and inducing variables in GPflow): ``features(x)`` returns the
    :class:`~gpattn.features.KernelEigenScores` at ``x`` (see :meth:`forward`), which the strategies consume.

    Modes (docs/math.md section 2):

    * ``"exact"``: the truncated SVD of the dense :math:`\kappa(X, Z)` (recomputed by every call in training;
      memoised in eval mode). :math:`J = 0`, no penalty. O(M^2 p + M^3) per call.
    * ``"primal"``: learned :math:`W_e, W_r \in \mathbb R^{p \times s}` and a learned positive :math:`\Lambda`
      with :math:`e(x) = W_e^\top \phi_q(x)`, :math:`r(z) = W_r^\top \phi_k(z)`, initialised at the exact KSVD
      of the initial landmarks and kept near a stationary point by the penalty :math:`\eta J^2`, registered
      as the added loss term ``"ksvd_loss"``. Needs a kernel with primal features. O(N p s) per call.

    The mode is read once, at construction: :attr:`learns_spectrum` says which of the two the features are.

    Example:
        >>> from gpattn.kernels import ShiftedRBFKernel
        >>> landmarks = torch.linspace(-2, 2, 8).unsqueeze(-1)
        >>> features = KernelEigenFeatures(ShiftedRBFKernel(input_dim=1), landmarks, num_inducing=3)
        >>> scores = features(torch.linspace(-3, 3, 5).unsqueeze(-1), kernel_diag=True)
        >>> scores.left_scores.shape, scores.singular_values.shape, features.Kuu().shape  # e(x), Lambda, K_uu
        (torch.Size([5, 3]), torch.Size([3]), torch.Size([3, 3]))
        >>> bool((features.residual_diag(landmarks) >= 0).all()), features.learns_spectrum
        (True, False)

    :param kernel: The asymmetric kernel, or a zero-argument callable returning it (used by strategies that
        read ``model.covar_module`` lazily; the callable's kernel is then not registered here).
    :param landmarks: Query landmarks :math:`X`, shape ``(*batch, M, d)``. A :class:`torch.nn.Parameter` is
        registered as is (shared), anything else is copied.
    :param num_inducing: :math:`s \leq \min(M_X, M_Z)`, the KSVD rank.
    :param mode: ``"exact"`` or ``"primal"``.
    :param key_landmarks: Key landmarks :math:`Z`, shape ``(*batch, M', d)``. By default they are the query landmarks:
        then not registered under a second name but read through ``landmarks`` (one tensor, whatever replaces it: a
        conversion, an assigning load, Pyro's ``update_module_params``); the state dict still holds a
        ``key_landmarks`` entry (the landmarks), so that a module built with key landmarks of its own loads it. They
        cannot be assigned apart (``features.key_landmarks = ...``, ``initialize(key_landmarks=...)``, or
        ``torch.func.functional_call`` given that entry: a ``ValueError``); assign the landmarks.
    :param learn_landmarks: Register copied landmarks as parameters (else buffers).
    :param svd_method: ``"exact"`` or ``"randomized"`` (see :func:`~gpattn.ksvd.kernel_svd`).
    :param ksvd_weight: :math:`\eta` of the primal-mode penalty.
    """

    def __init__(
        self,
        kernel: AsymmetricKernel | Callable[[], AsymmetricKernel],
        landmarks: Tensor,
        num_inducing: int,
        mode: str = "exact",
        key_landmarks: Tensor | None = None,
        learn_landmarks: bool = True,
        svd_method: str = "exact",
        ksvd_weight: float = 1.0,
    ):
        super().__init__()
        where = "KernelEigenFeatures"
        check_choice("mode", mode, MODES, where=where)
        if isinstance(kernel, AsymmetricKernel):
            self.base_kernel = kernel
        elif callable(kernel) and not isinstance(kernel, torch.nn.Module):  # a module is no getter: a wrong kernel
            object.__setattr__(self, "_kernel_getter", kernel)
        else:
            raise TypeError(
                "KernelEigenFeatures: expected an AsymmetricKernel (gpattn.kernels) or a callable returning one, got "
                f"{type(kernel).__name__}"
            )
        check_choice("svd_method", svd_method, SVD_METHODS, where=where)
        learn_landmarks = check_bool("learn_landmarks", learn_landmarks, where=where)
        check_float("ksvd_weight", ksvd_weight, 0.0, where=where)
        # the token width, when the kernel is known now (a getter's kernel may not exist yet)
        width = kernel.input_dim if isinstance(kernel, AsymmetricKernel) else "d"
        self._register_landmarks("landmarks", landmarks, learn_landmarks, width)
        # one landmark set by default: the key landmarks are then not registered at all, and reading them reads the
        # landmarks (__getattr__), so that nothing that replaces the registered landmarks (a conversion, an assigning
        # load, Pyro's update_module_params) can leave a second copy behind
        self._shared_key_landmarks = key_landmarks is None
        if key_landmarks is not None:
            self._register_landmarks("key_landmarks", key_landmarks, learn_landmarks, width)
        num_landmarks = min(self.landmarks.shape[-2], self.key_landmarks.shape[-2])
        self.num_inducing = check_int("num_inducing (the KSVD rank)", num_inducing, 1, num_landmarks, where=where)
        self.mode = mode
        self.svd_method = svd_method
        self.ksvd_weight = float(ksvd_weight)
        self.learns_spectrum = mode == "primal"
        if self.learns_spectrum:
            self._init_primal()

    def _register_landmarks(self, name: str, landmarks: Tensor, learn: bool, width: int | str) -> None:
        shape = ("...", "M", width)
        check_tensor(name, landmarks, shape, floating=True, non_empty=True, finite=True, where="KernelEigenFeatures")
        if isinstance(landmarks, torch.nn.Parameter):
            self.register_parameter(name, landmarks)
        elif learn:
            self.register_parameter(name, torch.nn.Parameter(landmarks.detach().clone()))
        else:
            self.register_buffer(name, landmarks.detach().clone())

    def _init_primal(self) -> None:
        kernel = self.kernel
        if not kernel.has_primal_features:
            raise ValueError(f"mode='primal' needs a kernel with primal features; {type(kernel).__name__} has none")
        if self.num_inducing > kernel.feature_dim:
            raise ValueError(
                f"expected num_inducing <= feature_dim = {kernel.feature_dim} in primal mode, got {self.num_inducing}"
            )
        with torch.no_grad():
            svd = self._exact_svd()
            # the stationary point W_e = Phi_k^T H_r, W_r = Phi_q^T H_e (docs/math.md section 6, identity 2)
            left_weights = kernel.key_features(self.key_landmarks).mT @ svd.right
            right_weights = kernel.query_features(self.landmarks).mT @ svd.left
            singular_values = svd.singular_values
            size = max(self.landmarks.shape[-2], self.key_landmarks.shape[-2])
            rank = int(numerically_nonzero(singular_values, size).sum(-1).min())
        if rank < self.num_inducing:  # a learned Lambda cannot start (numerically) at zero
            raise ValueError(
                f"KernelEigenFeatures: the kernel on the landmarks has numerical rank {rank} < num_inducing = "
                f"{self.num_inducing}, so primal mode would start with singular values at rounding level (prior "
                f"variances ~0, a KL of order 1/lambda^2): duplicated landmarks, or a kernel of rank below "
                f"num_inducing (a cosine kernel without lift has rank <= its feature dimension); use num_inducing <= "
                f"{rank} or mode='exact', which leaves numerically zero directions out"
            )
        self.left_weights = torch.nn.Parameter(left_weights)  # shape: (*batch, p, s)
        self.right_weights = torch.nn.Parameter(right_weights)
        self._register_singular_values(singular_values)
        self.register_added_loss_term("ksvd_loss")
        # J = 0 at the exact initialisation; refreshed by every training forward pass
        zero_objective = torch.zeros(left_weights.shape[:-2], dtype=left_weights.dtype)
        self.update_added_loss_term("ksvd_loss", KSVDAddedLossTerm(zero_objective, self.ksvd_weight))

    @property
    def kernel(self) -> AsymmetricKernel:
        """The asymmetric kernel :math:`\\kappa`."""
        return self.base_kernel if "base_kernel" in self._modules else self._kernel_getter()

    @property
    def inducing_points(self) -> Tensor:
        """The query landmarks :math:`X`, shape ``(*batch, M, d)`` (what a GPyTorch strategy calls
        ``inducing_points``)."""
        return self.landmarks

    def _clear_cache(self) -> None:
        clear_cache_hook(self)

    def __getattr__(self, name: str):
        # the default key landmarks are the landmarks: not registered under a second name, read through this one
        if name == "key_landmarks" and self._reads_key_landmarks_from_landmarks():
            return self.landmarks
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "key_landmarks" and self._reads_key_landmarks_from_landmarks():
            landmarks = self._parameters.get("landmarks", self._buffers.get("landmarks"))
            if value is landmarks:  # they are already
                return
            # an assignment would untie them for good (torch.func.functional_call's temporary one too) or, as
            # GPyTorch's initialize did before they were read through the landmarks, move the landmarks with them
            raise ValueError(
                "KernelEigenFeatures: the key landmarks are the landmarks (built without key_landmarks), so they "
                "cannot be assigned apart: assign the landmarks, or build the features with key_landmarks of their "
                "own (for torch.func.functional_call, leave 'key_landmarks' out of the tensors given)"
            )
        super().__setattr__(name, value)

    def _reads_key_landmarks_from_landmarks(self) -> bool:
        # built without key_landmarks (a flag set once; the guard against a registered one is for safety only)
        registered = self.__dict__.get("_parameters", {}), self.__dict__.get("_buffers", {})
        shared = self.__dict__.get("_shared_key_landmarks", False)
        return shared and not any("key_landmarks" in tensors for tensors in registered)

    def _apply(self, fn, *args, **kwargs):
        # the eval-mode memo of the KSVD holds the old dtype and device: .double() or .to(device) must not reuse it
        self._clear_cache()
        return super()._apply(fn, *args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # the state dict keeps its key_landmarks entry (the landmarks) for the default key landmarks, as before they
        # were read through the landmarks: checkpoints keep their keys, and a module built with its own key landmarks
        # loads them
        landmarks = self._parameters.get("landmarks", self._buffers.get("landmarks"))
        if landmarks is not None and self._reads_key_landmarks_from_landmarks():
            destination[prefix + "key_landmarks"] = landmarks if keep_vars else landmarks.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        key = prefix + "key_landmarks"
        if key in state_dict and self._reads_key_landmarks_from_landmarks():
            # the entry of a module with the default key landmarks repeats its landmarks; one with different values
            # comes from a module built with its own key landmarks, which this one cannot hold
            saved, landmarks = state_dict.pop(key), state_dict.get(prefix + "landmarks")
            if landmarks is not None and not (saved.shape == landmarks.shape and torch.equal(saved, landmarks)):
                error_msgs.append(
                    f"{key}: the state dict holds key landmarks different from its landmarks, but this "
                    "KernelEigenFeatures reads its key landmarks from its landmarks (built without key_landmarks); "
                    "build it with key_landmarks to load them"
                )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _exact_svd(self) -> KernelSVD:
        return kernel_svd(self.kernel(self.landmarks, self.key_landmarks), self.num_inducing, method=self.svd_method)

    @cached(name="ksvd_memo")
    def decomposition(self) -> KernelSVD:
        r"""Exact mode: the truncated KSVD of :math:`\kappa(X, Z)`, memoised until the cache is cleared
        (every call in training, of the features or of a strategy, ``train()``/``eval()``, a dtype or device
        change)."""
        if self.learns_spectrum:
            raise RuntimeError("decomposition() is defined in exact mode only")
        return self._exact_svd()

    def _exact_singular_values(self) -> Tensor:
        return self.decomposition().singular_values

    @property
    def active_inducing(self) -> Tensor | None:
        r"""Exact mode: which of the ``s`` singular values of the landmark matrix are numerically nonzero
        (:func:`~gpattn.features.numerically_nonzero`; fewer than ``s`` when ``num_inducing`` exceeds the kernel's
        numerical rank on the landmarks, e.g. duplicated landmarks or a smooth kernel with ``s`` close to ``M``),
        shape ``(*batch, s)``; ``None`` in primal mode (a learned :math:`\Lambda` is positive)."""
        if self.learns_spectrum:
            return None
        size = max(self.landmarks.shape[-2], self.key_landmarks.shape[-2])
        return numerically_nonzero(self.singular_values, size)

    @property
    def numerical_rank(self) -> int:
        """The smallest number of numerically nonzero directions over the batch (``num_inducing`` in primal mode)."""
        active = self.active_inducing
        return self.num_inducing if active is None else int(active.sum(-1).min())

    def check_inputs(self, x: Tensor, where: str = "KernelEigenFeatures") -> None:
        """Check a model's inputs once per call: a floating tensor of shape ``(*batch, N, d)`` with ``N >= 1``, the
        landmarks' width ``d``, dtype and device, and finite values (one elementwise pass).

        :raises TypeError: Not a floating tensor, or another dtype than the landmarks'.
        :raises ValueError: Another width, no points, another device, or a NaN or infinite value.
        """
        shape = ("...", "N", self.landmarks.shape[-1])
        check_tensor("x", x, shape, floating=True, non_empty=True, like=self.landmarks, finite=True, where=where)

    def forward(
        self,
        x: Tensor,
        sides: tuple[str, ...] = SIDES,
        kernel_diag: bool = False,
        where: str = "KernelEigenFeatures",
        check: bool = True,
    ) -> KernelEigenScores:
        r"""The features at the points ``x``: :math:`e(x) = \kappa(x, Z) H_r` (``"left"``, ``x`` as queries) and
        :math:`r(x) = \kappa(X, x)^\top H_e` (``"right"``, ``x`` as keys) in exact mode, :math:`W_e^\top \phi_q(x)`
        and :math:`W_r^\top \phi_k(x)` in primal mode; with ``kernel_diag`` also :math:`k_e(x, x) =
        \|\kappa(x, Z)\|^2` and :math:`k_r(x, x) = \|\kappa(X, x)\|^2` (the residual's inputs).

        :param x: shape ``(*batch, N, d)``.
        :param sides: The branches to evaluate, ``("left", "right")`` or one of them.
        :param kernel_diag: Also compute the kernel diagonals.
        :param where: The caller named in error messages.
        :param check: Check ``x`` (:meth:`check_inputs`); a caller that has checked it already passes ``False``.
        :return: A :class:`~gpattn.features.KernelEigenScores` with scores of shape ``(*batch, N, s)`` (``None``
            for a side not asked for) and :math:`\Lambda` of shape ``(*batch_l, s)``.

        .. note:: Cost: exact mode O(N M p) for the cross-kernel matrices (the diagonals come from them for free),
            plus the memoised O(M^2 p + M^3) KSVD of the landmarks; primal mode O(N D p + N p s), plus O((N + M) p^2)
            for the diagonals.
        """
        for side in sides:
            check_choice("side", side, SIDES, where=where)
        if check:
            self.check_inputs(x, where)
        if self.training:  # a new KSVD of the current landmarks and kernel, as GPyTorch's strategies clear their memos
            self._clear_cache()
        kernel = self.kernel
        parts: dict[str, Tensor | None] = {}
        for side in SIDES:
            if side not in sides:
                parts[side], parts[f"{side}_diag"] = None, None
                continue
            if self.learns_spectrum:
                if side == "left":  # e(x) = W_e^T phi_q(x)
                    features, weights = kernel.query_features(x), self.left_weights
                    other = kernel.key_features(self.key_landmarks) if kernel_diag else None
                else:  # r(x) = W_r^T phi_k(x)
                    features, weights = kernel.key_features(x), self.right_weights
                    other = kernel.query_features(self.landmarks) if kernel_diag else None
                parts[side] = features @ weights
                parts[f"{side}_diag"] = induced_kernel_diag(features, other) if kernel_diag else None
                continue
            svd = self.decomposition()
            if side == "left":
                cross, vectors = kernel.forward(x, self.key_landmarks), svd.right  # kappa(x, Z), H_r
            else:
                cross, vectors = kernel.forward(self.landmarks, x).mT, svd.left  # kappa(X, x)^T, H_e
            parts[side] = cross @ vectors
            parts[f"{side}_diag"] = cross.pow(2).sum(-1) if kernel_diag else None
        return KernelEigenScores(
            left_scores=parts["left"],
            right_scores=parts["right"],
            singular_values=self.singular_values,
            left_kernel_diag=parts["left_diag"],
            right_kernel_diag=parts["right_diag"],
            active=self.active_inducing,
        )

    def scores(self, x: Tensor, side: str = "left") -> Tensor:
        r"""Projection scores :math:`e(x)` (``side="left"``, :math:`x` a query) or :math:`r(x)` (``"right"``, a key),
        shape ``(*batch, N, s)``; :math:`K_{fu}(x) =` ``scores(x) * singular_values``. See :meth:`forward`."""
        return self(x, sides=(side,)).scores(side)

    def kernel_diag(self, x: Tensor, side: str = "left") -> Tensor:
        r"""Prior variance :math:`k_e(x, x) = \|\kappa(x, Z)\|^2` (left) or :math:`k_r(x, x) = \|\kappa(X, x)\|^2`
        (right), shape ``(*batch, N)``. See :meth:`forward`."""
        return self(x, sides=(side,), kernel_diag=True).kernel_diag(side)

    def residual_diag(self, x: Tensor, side: str = "left") -> Tensor:
        r"""Diagonal of the residual :math:`K_{ff} - Q_{ff}`, :math:`k_e(x, x) - \|e(x)\|^2` (left), clamped at 0
        (see :meth:`~gpattn.features.KernelEigenScores.residual_diag`); its sum over the query landmarks is
        :math:`\sum_{i > s} \lambda_i^2` in exact mode. Shape ``(*batch, N)``."""
        return self(x, sides=(side,), kernel_diag=True).residual_diag(side)

    def ksvd_objective(self) -> Tensor:
        r""":math:`J` (sum form) on the landmarks; identically zero in exact mode. Shape ``(*batch)``."""
        if not self.learns_spectrum:
            return torch.zeros(self.landmarks.shape[:-2], dtype=self.landmarks.dtype, device=self.landmarks.device)
        return ksvd_objective(
            self.scores(self.landmarks, "left"),
            self.scores(self.key_landmarks, "right"),
            self.left_weights,
            self.right_weights,
            self.singular_values,
        )

    def refresh_ksvd_loss(self) -> None:
        """Recompute the added loss term ``"ksvd_loss"`` (:math:`\\eta J^2`; primal mode, a no-op in exact mode).

        Strategies call this on every forward pass.
        """
        if self.learns_spectrum:
            self.update_added_loss_term("ksvd_loss", KSVDAddedLossTerm(self.ksvd_objective(), self.ksvd_weight))
