"""The README's code runs as written (keeps it true to the code)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README should show Python usage"
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 (our own README)
    assert namespace["posterior"].mean.shape == (200,)


def test_readme_commands_exist_in_makefile() -> None:
    makefile = (README.parent / "Makefile").read_text()
    for target in re.findall(r"^make (\w[\w-]*)", README.read_text(), flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"make {target} is not a Makefile target"
