"""The last-layer Laplace tests compare with laplace-torch, which imports torchmetrics, which imports torchvision:
import it through gpattn.integrations first, which makes a torchvision whose compiled operators do not load beside
this torch importable (otherwise these modules fail to collect)."""

import gpattn.integrations  # noqa: F401
