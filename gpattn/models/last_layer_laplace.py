"""A last-layer Laplace approximation of a trained classifier with laplace-torch, predicting by Monte Carlo samples of
its linearised (GLM) predictive logits."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .._module_state import kept_call_results, restored_modes
from .._torch_compat import eager_calls
from ..validation import InputTypeError, check_int, check_tensor
from .monte_carlo import check_batch_mask

__all__ = ["LastLayerLaplace"]


def _check_non_empty(inputs: Tensor, where: str) -> None:
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise ValueError(f"{where}: expected at least one input, got shape {tuple(inputs.shape)}")


class LastLayerLaplace(torch.nn.Module):
    r"""The last-layer Laplace approximation (Daxberger et al., "Laplace Redux", NeurIPS 2021) of a trained
    classifier whose last layer is a linear map :math:`f(x) = W \phi(x) + b` of its features :math:`\phi(x)`, fitted
    with laplace-torch and predicting with :math:`T` Monte Carlo samples of the linearised (GLM) predictive's logits.

    :meth:`fit` runs ``laplace.Laplace(head, "classification", subset_of_weights="last_layer",
    hessian_structure="kron")`` on the training features, then ``optimize_prior_precision(method="marglik")``: the
    posterior over :math:`\theta = (\operatorname{vec} W, b)` is
    :math:`\mathcal N(\theta_{\mathrm{MAP}}, \Sigma)` with
    :math:`\Sigma^{-1} = \sum_i J_i^\top \Lambda_i J_i + \delta I` Kronecker-factored (K-FAC of the generalised
    Gauss-Newton matrix, :math:`\Lambda_i = \operatorname{diag}(p_i) - p_i p_i^\top` the softmax Hessian at the
    trained weights) and the scalar prior precision :math:`\delta` maximising the Laplace marginal likelihood. The
    trained weights are the MAP (no retraining). The GLM predictive of the logits of an input is

    .. math::

        f(x) \sim \mathcal N\big(f_{\theta_{\mathrm{MAP}}}(x),\; J(x) \Sigma J(x)^\top\big),
        \qquad J(x) = \big[\phi(x)^\top \otimes I_C,\; I_C\big],

    and :meth:`sample_logits` draws :math:`f^{(t)}(x) = \mu(x) + L(x) \varepsilon^{(t)}` with
    :math:`L L^\top` the covariance's Cholesky factor and :math:`\varepsilon^{(t)} \sim \mathcal N(0, I_C)`
    independent across inputs and samples (from the global torch RNG), so that the mean of
    :math:`\operatorname{softmax}(f^{(t)}(x))` is laplace-torch's ``la(x, pred_type="glm", link_approx="mc")``.
    laplace-torch's own ``functional_samples`` shares one :math:`\varepsilon^{(t)}` across a batch; the samples here
    do not, so that every input's Monte Carlo error is independent, as for the other sampled predictives.

    Laplace is given the classification head alone, fed the features that the model computes (captured by a forward
    pre-hook on the last layer): the same approximation as ``Laplace(model, ..., last_layer_name=last_layer)`` on the
    whole model, which laplace-torch calls with the inputs alone, so that it could not pass a padding mask.

    :param model: The trained classifier: ``model(inputs, mask=mask)`` gives logits ``(B, C)``, and its submodule
        ``last_layer`` is the :class:`torch.nn.Linear` that maps the features to them (its last operation).
    :param last_layer: Name of that submodule (``"head"`` for :class:`~gpattn.models.Transformer`).

    Example:
        >>> import torch
        >>> from gpattn.models import LastLayerLaplace, Transformer
        >>> model = Transformer(3, embed_dim=8, depth=1, num_heads=2, attention="softmax", vocab_size=5, max_len=4)
        >>> inputs, labels = torch.randint(0, 5, (32, 4)), torch.randint(0, 3, (32,))
        >>> laplace = LastLayerLaplace(model).fit(inputs, labels)
        >>> laplace.sample_logits(inputs[:6], num_samples=7).shape
        torch.Size([7, 6, 3])

    .. note:: Cost: :meth:`fit` is one forward pass over the training inputs, the K-FAC factors of the head
        (:math:`O(n (D^2 + C^2))` for :math:`D` features) and 100 steps of the marginal likelihood on their
        eigendecompositions; :meth:`sample_logits` one forward pass plus :math:`O(B C (D + C^2) + T B C^2)`.
    """

    def __init__(self, model: torch.nn.Module, last_layer: str = "head"):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"LastLayerLaplace: expected model to be a torch.nn.Module, got {type(model).__name__}")
        try:
            layer = model.get_submodule(last_layer)
        except AttributeError:
            layer = None
        if not isinstance(layer, torch.nn.Linear):
            found = "nothing" if layer is None else type(layer).__name__
            raise ValueError(
                f"LastLayerLaplace: expected the submodule {last_layer!r} of the model to be its last layer, a "
                f"torch.nn.Linear, found {found}; name the linear layer that gives the logits with last_layer="
            )
        self.model = model
        self.last_layer = last_layer
        self.laplace: Any = None  # laplace-torch's KronLLLaplace after fit()

    def forward(self, inputs: Tensor, mask: Tensor | str | None = None) -> Tensor:
        """The model's logits at the trained weights, shape ``(B, C)``: the GLM predictive's mean."""
        return self.model(inputs, mask=mask)

    @torch.no_grad()
    def features(self, inputs: Tensor, mask: Tensor | str | None = None, batch_size: int | None = None) -> Tensor:
        r"""The last layer's inputs :math:`\phi(x)` ``(B, D)``, from one eval-mode pass of the model (by batches of
        ``batch_size`` inputs, all at once for ``None``); the model's training mode is restored."""
        check_tensor("inputs", inputs, where="LastLayerLaplace")
        _check_non_empty(inputs, "LastLayerLaplace")
        if batch_size is not None:
            check_int("batch_size", batch_size, where="LastLayerLaplace")
        check_batch_mask(mask, inputs, "LastLayerLaplace")
        captured: list[Tensor] = []
        handle = self.model.get_submodule(self.last_layer).register_forward_pre_hook(
            lambda module, args: captured.append(args[0].detach())
        )
        step = inputs.shape[0] if batch_size is None else batch_size
        try:
            # a compiled model runs eagerly here: its compiled graphs would skip the hook
            with restored_modes(self.model), kept_call_results(self.model), eager_calls():
                self.model.eval()
                for start in range(0, inputs.shape[0], step):
                    batch_mask = mask[start : start + step] if isinstance(mask, Tensor) else mask
                    self.model(inputs[start : start + step], mask=batch_mask)
        finally:
            handle.remove()
        return torch.cat(captured)

    def fit(
        self, inputs: Tensor, labels: Tensor, mask: Tensor | str | None = None, batch_size: int = 256
    ) -> LastLayerLaplace:
        """Fit the approximation on the training data (see the class docstring) and return ``self``.

        :param inputs: The training inputs, as the model takes them.
        :param labels: Their integer labels ``(n,)``, of any integer dtype.
        :param mask: The model's mask argument (a tensor, one row per input, is cut into batches with ``inputs``).
        :param batch_size: Inputs per forward pass and per curvature batch.
        :raises ImportError: laplace-torch is not installed (``pip install 'gpattn[laplace]'``).
        :raises TypeError: Labels that are not integers (floats, bools).
        :raises ValueError: Labels of the wrong shape or out of the range of the classes; no input.

        The global torch RNG is left as it was (the curvature batches are read in order).
        """
        batch_size = check_int("batch_size", batch_size, where="LastLayerLaplace.fit")
        check_tensor("inputs", inputs, where="LastLayerLaplace.fit")
        _check_non_empty(inputs, "LastLayerLaplace.fit")
        check_tensor("labels", labels, where="LastLayerLaplace.fit")
        integer = not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
        if labels.dim() != 1 or labels.shape[0] != inputs.shape[0] or not integer:
            error = ValueError if integer else InputTypeError
            raise error(
                f"LastLayerLaplace.fit: expected integer labels of shape ({inputs.shape[0]},), got "
                f"{labels.dtype} {tuple(labels.shape)}"
            )
        classes = self.model.get_submodule(self.last_layer).out_features
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= classes:
            raise ValueError(
                f"LastLayerLaplace.fit: expected labels in [0, {classes - 1}] (the {classes} classes of the last "
                f"layer {self.last_layer!r}), got values in [{low}, {high}]"
            )
        # laplace-torch is an optional dependency, and imports torchmetrics, which imports torchvision: imported here,
        # through gpattn.integrations (which makes a torchvision built for another torch importable), not by every
        # import of gpattn.models
        from ..integrations import import_torchvision

        import_torchvision()
        try:
            from laplace import Laplace
        except ImportError as error:
            raise ImportError(
                "LastLayerLaplace needs laplace-torch: pip install 'gpattn[laplace]' (or laplace-torch)"
            ) from error
        features = self.features(inputs, mask, batch_size)
        head = torch.nn.Sequential(self.model.get_submodule(self.last_layer))
        laplace = Laplace(
            head, "classification", subset_of_weights="last_layer", hessian_structure="kron", last_layer_name="0"
        )
        # int64 labels, as laplace-torch's cross-entropy takes them; a loader with its own generator, as every loader
        # iterator draws a seed, which would otherwise come from the global RNG
        data = torch.utils.data.TensorDataset(features, labels.to(device=features.device, dtype=torch.int64))
        laplace.fit(torch.utils.data.DataLoader(data, batch_size=batch_size, generator=torch.Generator()))
        with warnings.catch_warnings():  # its reminder of the link approximation concerns a grid search on validation
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
            laplace.optimize_prior_precision(method="marglik")
        self.laplace = laplace
        return self

    def _fitted(self) -> Any:
        if self.laplace is None:
            raise RuntimeError("LastLayerLaplace: call fit() on the training data before predicting")
        return self.laplace

    @torch.no_grad()
    def predictive_moments(
        self, inputs: Tensor, mask: Tensor | str | None = None, batch_size: int | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""The GLM predictive of the logits: mean :math:`f_{\theta_{\mathrm{MAP}}}(x)` ``(B, C)`` and covariance
        :math:`J(x) \Sigma J(x)^\top` ``(B, C, C)``, with the last-layer Jacobians
        :math:`J(x) = [\phi(x)^\top \otimes I_C,\; I_C]` (laplace-torch's order of the parameters: :math:`W` row by
        row, then :math:`b`) and laplace-torch's functional variance, in the model's dtype.

        The Jacobians are formed here from the features, not by laplace-torch's forward hook, whose closure a copy
        (``copy.deepcopy``) would share with the original: the copy would read the original's last features."""
        laplace = self._fitted()
        features = self.features(inputs, mask, batch_size)  # shape: (B, D)
        head = laplace.model.last_layer  # laplace-torch's copy of the last layer, at the MAP weights
        mean = head(features)  # shape: (B, C)
        identity = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device)
        jacobians = torch.einsum("bd,ij->bijd", features, identity).reshape(*mean.shape, -1)  # shape: (B, C, C D)
        if head.bias is not None:
            jacobians = torch.cat([jacobians, identity.expand(mean.shape[0], -1, -1)], dim=-1)
        return mean, laplace.functional_variance(jacobians)

    @torch.no_grad()
    def sample_logits(
        self,
        inputs: Tensor,
        mask: Tensor | str | None = None,
        num_samples: int = 10,
        batch_size: int | None = None,
    ) -> Tensor:
        """:math:`T` = ``num_samples`` draws of the GLM predictive's logits (see the class docstring), shape
        ``(T, B, C)``, in float64 (the Cholesky factor of the covariance is taken in float64)."""
        check_int("num_samples", num_samples, where="LastLayerLaplace.sample_logits")
        check_tensor("inputs", inputs, where="LastLayerLaplace.sample_logits")
        _check_non_empty(inputs, "LastLayerLaplace.sample_logits")
        check_batch_mask(mask, inputs, "LastLayerLaplace.sample_logits")
        parts = []
        step = inputs.shape[0] if batch_size is None else check_int("batch_size", batch_size, where="LastLayerLaplace")
        for start in range(0, inputs.shape[0], step):
            batch_mask = mask[start : start + step] if isinstance(mask, Tensor) else mask
            mean, covariance = self.predictive_moments(inputs[start : start + step], batch_mask)
            mean, factor = mean.double(), torch.linalg.cholesky(covariance.double())
            noise = torch.randn(num_samples, *mean.shape, dtype=torch.float64, device=mean.device)  # (T, B, C)
            parts.append(mean + torch.einsum("bij,tbj->tbi", factor, noise))
        return torch.cat(parts, dim=1)
