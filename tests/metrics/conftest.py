"""The metrics tests compare with torchmetrics, which imports torchvision: import it through gpattn.integrations
first, which makes a torchvision whose compiled operators do not load beside this torch importable (otherwise these
modules fail to collect when run on their own)."""

import gpattn.integrations  # noqa: F401
