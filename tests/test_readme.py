"""The README's quickstart runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_quickstart_runs_and_predicts_the_labels(tmp_path: Path) -> None:
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    script = tmp_path / "quickstart.py"
    script.write_text(block.group(1))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    predicted, expected = re.fullmatch(r"\[(.*)\] expected \[(.*)\]\n", done.stdout).groups()  # type: ignore[union-attr]
    assert predicted == expected
    assert done.stderr == ""
