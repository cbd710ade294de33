"""The README's code runs as written (keeps it true to the code)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 4, "the README shows a GP model, an attention model, a timm and a Hugging Face conversion"
    namespaces = []
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 (our own README)
        namespaces.append(namespace)
    gp = namespaces[0]
    assert gp["posterior"].mean.shape == (200,)
    # the fit converges: the posterior mean recovers sin(2x) (noise sd 0.1) to well within the noise level
    rmse = (gp["posterior"].mean - gp["torch"].sin(2 * gp["x"]).squeeze(-1)).pow(2).mean().sqrt()
    assert float(rmse.detach()) < 0.1
    assert namespaces[1]["probabilities"].shape == (128, 2)
    assert float(namespaces[1]["accuracy"]) > 0.9  # the Transformer example learns the pointer task (chance 0.5)
    assert namespaces[1]["variance"].shape == (1, 8, 32) and bool((namespaces[1]["variance"] >= 0).all())
    timm_model = namespaces[2]["model"]
    assert type(timm_model.blocks[-1].attn.layer).__name__ == "KEPSVGPAttention"
    assert timm_model.blocks[-1].attn.layer.strategy._variational_distribution.variational_mean.grad.abs().sum() > 0
    probabilities = namespaces[3]["probabilities"]
    assert probabilities.shape == (2, 2)
    assert float((probabilities.sum(-1) - 1).abs().max()) < 1e-6


def test_readme_commands_exist_in_makefile() -> None:
    makefile = (README.parent / "Makefile").read_text()
    for target in re.findall(r"^make (\w[\w-]*)", README.read_text(), flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"make {target} is not a Makefile target"
