"""The README's quickstart runs as written."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import trio

import trioinfer
from trioinfer.server import serve_http

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


async def test_serving_example_answers_as_shown() -> None:
    section = README.read_text().split("## Serving over HTTP", 1)[1]
    body, shown = re.search(
        r"/v2/models/digits/infer -d '(.*?)'\n# (\{.*\})\n", section, re.S
    ).groups()  # type: ignore[union-attr]
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(
            functools.partial(
                serve_http, trioinfer.example_repository(), port=0, handle_signals=False
            )
        )
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            response = await client.post("/v2/models/digits/infer", content=body)
        nursery.cancel_scope.cancel()
    assert response.status_code == 200
    assert response.json() == json.loads(shown)
