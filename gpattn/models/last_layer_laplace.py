"""A last-layer Laplace approximation of a trained classifier with laplace-torch, predicting by Monte Carlo samples of
its linearised (GLM) predictive logits."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._module_state import kept_call_results, restored_modes
from .._torch_compat import eager_calls
from ..validation import InputTypeError, check_int, check_tensor
from .monte_carlo import check_batch_mask

__all__ = ["LastLayerLaplace"]

#: The entries of a fit in the module's state (see :meth:`LastLayerLaplace.get_extra_state`).
_FIT_KEYS = ("mean", "prior_precision", "loss", "num_data", "kronecker_factors", "eigenvalues", "eigenvectors")
#: The name of the head in the one-layer model that laplace-torch is given.
_HEAD_NAME = "0"


def _check_non_empty(inputs: Tensor, where: str) -> None:
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise ValueError(f"{where}: expected at least one input, got shape {tuple(inputs.shape)}")


def _map_tensors(fn: Callable[[Tensor], Tensor], value: Any) -> Any:
    # fn applied to every tensor of nested dicts and lists (the Kronecker factors are lists of lists of tensors)
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_tensors(fn, item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_tensors(fn, item) for item in value]
    return value


def _import_laplace() -> Any:
    """laplace-torch, an optional dependency that imports torchmetrics, which imports torchvision: imported on demand,
    through gpattn.integrations (which makes a torchvision built for another torch importable), not by every import
    of gpattn.models."""
    from ..integrations import import_torchvision

    import_torchvision()
    try:
        import laplace
    except ImportError as error:
        raise ImportError(
            "LastLayerLaplace needs laplace-torch: pip install 'gpattn[laplace]' (or laplace-torch)"
        ) from error
    return laplace


def _laplace_of_head(head: torch.nn.Linear) -> Any:
    # laplace-torch's last-layer K-FAC Laplace of a one-layer model (it keeps its own copy of the head)
    return _import_laplace().Laplace(
        torch.nn.Sequential(head),
        "classification",
        subset_of_weights="last_layer",
        hessian_structure="kron",
        last_layer_name=_HEAD_NAME,
    )


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

    The fit is module state, not a laplace-torch object kept aside: the MAP weights :math:`\theta_{\mathrm{MAP}}`,
    the prior precision :math:`\delta`, the Kronecker factors of the curvature and their eigendecompositions (which
    the predictive reads through laplace-torch's ``KronDecomposed``), the training loss and number of inputs (which
    the marginal likelihood reads). ``state_dict`` carries them as the module's extra state (plain tensors, lists,
    numbers: ``torch.load(weights_only=True)`` reads them); ``load_state_dict`` replaces the fit with the loaded one
    (an unfitted state leaves the module unfitted, and so does a load of the model's weights without a fit, as the
    fit belonged to the old weights); ``copy.deepcopy`` and ``pickle`` copy it; it follows the last layer's dtype and
    device (``.to()``, ``.float()``, a conversion of the wrapped model alone: converted when next read).
    :attr:`laplace` rebuilds laplace-torch's object from it.

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
        eigendecompositions; :meth:`sample_logits` one forward pass plus :math:`O(B C (D + C^2) + T B C^2)`. The fit
        holds :math:`O(D^2 + C^2)` numbers (the Kronecker factors, :math:`C \times C` and :math:`D \times D`, and their
        eigenvectors).
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
        self._fit: dict[str, Any] | None = None  # the entries _FIT_KEYS after fit()

    def _head(self) -> torch.nn.Linear:
        return self.model.get_submodule(self.last_layer)

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
        handle = self._head().register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
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
        classes = self._head().out_features
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= classes:
            raise ValueError(
                f"LastLayerLaplace.fit: expected labels in [0, {classes - 1}] (the {classes} classes of the last "
                f"layer {self.last_layer!r}), got values in [{low}, {high}]"
            )
        laplace = _laplace_of_head(self._head())
        features = self.features(inputs, mask, batch_size)
        # int64 labels, as laplace-torch's cross-entropy takes them; a loader with its own generator, as every loader
        # iterator draws a seed, which would otherwise come from the global RNG
        data = torch.utils.data.TensorDataset(features, labels.to(device=features.device, dtype=torch.int64))
        laplace.fit(torch.utils.data.DataLoader(data, batch_size=batch_size, generator=torch.Generator()))
        with warnings.catch_warnings():  # its reminder of the link approximation concerns a grid search on validation
            warnings.filterwarnings("ignore", message="By default `link_approx` is `probit`")
            laplace.optimize_prior_precision(method="marglik")
        fit = {
            "mean": laplace.mean,  # laplace-torch's order: W row by row, then b
            "prior_precision": laplace.prior_precision,  # shape: (1,)
            "loss": torch.as_tensor(laplace.loss, dtype=laplace.mean.dtype, device=laplace.mean.device),
            "num_data": int(laplace.n_data),
            "kronecker_factors": laplace.H_facs.kfacs,  # [[A_W (C, C), G_W (D, D)], [A_b (C, C)]]
            "eigenvalues": laplace.H.eigenvalues,  # of each factor, as laplace-torch decomposed them
            "eigenvectors": laplace.H.eigenvectors,
        }
        self._fit = _map_tensors(Tensor.detach, fit)  # laplace-torch's object, with its hooks, is dropped
        return self

    def _fitted(self) -> dict[str, Any]:
        if self._fit is None:
            raise RuntimeError("LastLayerLaplace: call fit() on the training data before predicting")
        return self._matched_fit()

    def _matched_fit(self) -> dict[str, Any]:
        # the fit in the last layer's dtype and device, whichever way they changed: .to() of this module or of the
        # wrapped model alone, a load that assigns the parameters (after this module's own extra state is loaded)
        weight = self._head().weight
        if self._fit["mean"].dtype != weight.dtype or self._fit["mean"].device != weight.device:
            self._fit = _map_tensors(lambda tensor: tensor.to(device=weight.device, dtype=weight.dtype), self._fit)
        return self._fit

    @property
    def laplace(self) -> Any:
        """laplace-torch's ``KronLLLaplace`` of the fit (``None`` before :meth:`fit`), built anew from the module's
        state at each access by its ``load_state_dict``, which eigendecomposes the Kronecker factors again
        (:math:`O(D^3 + C^3)`): its marginal likelihood, posterior precision and so on are the fit's; changing it
        leaves the module as it is."""
        if self._fit is None:
            return None
        fit = _map_tensors(Tensor.clone, self._matched_fit())
        head = copy.deepcopy(self._head())
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(fit["mean"], head.parameters())  # its copy: at the MAP weights
        laplace = _laplace_of_head(head)
        laplace.load_state_dict(
            {
                "mean": fit["mean"],
                "H": fit["kronecker_factors"],
                "loss": fit["loss"],
                "n_data": fit["num_data"],
                "n_outputs": head.out_features,
                "prior_precision": fit["prior_precision"],
                # the settings of the approximation, as laplace-torch's constructor set them
                "prior_mean": laplace.prior_mean,
                "sigma_noise": laplace.sigma_noise,
                "likelihood": laplace.likelihood,
                "temperature": laplace.temperature,
                "enable_backprop": laplace.enable_backprop,
                "cls_name": type(laplace).__name__,
                "data": None,
                "_last_layer_name": _HEAD_NAME,
            }
        )
        return laplace

    def get_extra_state(self) -> dict[str, Any]:
        """The fit, as ``state_dict`` stores it: ``{"fitted": False}`` before :meth:`fit`, else ``{"fitted": True}``
        and the MAP weights ``mean`` ``(P,)`` (laplace-torch's order: :math:`W` row by row, then :math:`b`), the
        ``prior_precision`` ``(1,)``, the training ``loss`` and ``num_data``, the ``kronecker_factors`` (one list of
        factors per parameter of the last layer) and their ``eigenvalues`` and ``eigenvectors``; the tensors in the
        last layer's dtype and device (not copies, as ``state_dict`` gives the parameters)."""
        if self._fit is None:
            return {"fitted": False}
        return {"fitted": True, **self._matched_fit()}

    def set_extra_state(self, state: Any) -> None:
        """Replace the fit with ``state`` (as :meth:`get_extra_state` gives it; its tensors copied): an unfitted state
        leaves the module unfitted.

        :raises ValueError: Not such a state, or a fit of a last layer of another size."""
        if not isinstance(state, dict) or not isinstance(state.get("fitted"), bool):
            raise ValueError(
                f"LastLayerLaplace: expected an extra state with a boolean 'fitted' entry, got {type(state).__name__}"
            )
        if not state["fitted"]:
            self._fit = None
            return
        missing = [key for key in _FIT_KEYS if key not in state]
        if missing:
            raise ValueError(f"LastLayerLaplace: the extra state of a fit lacks the entries {missing}")
        head = self._head()
        size = sum(parameter.numel() for parameter in head.parameters())
        mean = state["mean"]
        if not isinstance(mean, Tensor) or tuple(mean.shape) != (size,):
            found = tuple(mean.shape) if isinstance(mean, Tensor) else type(mean).__name__
            raise ValueError(
                f"LastLayerLaplace: expected the fitted mean of the last layer {self.last_layer!r} to have shape "
                f"({size},), got {found}"
            )
        self._fit = _map_tensors(lambda tensor: tensor.detach().clone(), {key: state[key] for key in _FIT_KEYS})

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a load that brings the model's weights without a fit leaves no fit behind: it belonged to the old weights
        if prefix + "_extra_state" not in state_dict and any(key.startswith(prefix) for key in state_dict):
            self._fit = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def predictive_moments(
        self, inputs: Tensor, mask: Tensor | str | None = None, batch_size: int | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""The GLM predictive of the logits: mean :math:`f_{\theta_{\mathrm{MAP}}}(x)` ``(B, C)`` and covariance
        :math:`J(x) \Sigma J(x)^\top` ``(B, C, C)``, with the last-layer Jacobians
        :math:`J(x) = [\phi(x)^\top \otimes I_C,\; I_C]` (laplace-torch's order of the parameters: :math:`W` row by
        row, then :math:`b`) and laplace-torch's functional variance of the fitted posterior, in the model's dtype.

        The Jacobians are formed here from the features, not by laplace-torch's forward hook, whose closure a copy
        (``copy.deepcopy``) would share with the original: the copy would read the original's last features."""
        fit = self._fitted()
        features = self.features(inputs, mask, batch_size)  # shape: (B, D)
        head = self._head()
        split = head.out_features * head.in_features
        weight = fit["mean"][:split].view(head.out_features, head.in_features)  # the MAP weights, as fitted
        bias = fit["mean"][split:] if fit["mean"].numel() > split else None
        mean = torch.nn.functional.linear(features, weight, bias)  # shape: (B, C)
        identity = torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device)
        jacobians = torch.einsum("bd,ij->bijd", features, identity).reshape(*mean.shape, -1)  # shape: (B, C, C D)
        if bias is not None:
            jacobians = torch.cat([jacobians, identity.expand(mean.shape[0], -1, -1)], dim=-1)
        # the posterior precision sum_l (A_l x G_l + delta I) from the eigenpairs of the factors, as laplace-torch's
        # KronLaplace.posterior_precision (its Hessian factor 1 / (sigma^2 T) is 1 for classification at T = 1)
        decomposed = _import_laplace().utils.KronDecomposed(fit["eigenvectors"], fit["eigenvalues"])
        return mean, (decomposed + fit["prior_precision"]).inv_square_form(jacobians)

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
