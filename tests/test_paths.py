"""Every documented way of naming a model works with relative and absolute paths.

Each test runs from a working directory other than the repository's, with a
copy of the bundled example repository under it, and names the model the way
the docs do: `ModelConfig.from_toml` (the docs home, how-to/models.md),
`ModelConfig(path=...)` (the README), `trioinfer bench --in-process
--model-repository` and the server's model repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trioinfer
from trioinfer.server import ModelRepository

X = trioinfer.digits_samples()[0][:2]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ``models/digits`` (a copy of the bundled repository)."""
    shutil.copytree(trioinfer.example_repository(), tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def labels(config: trioinfer.ModelConfig) -> list[int]:
    async with trioinfer.open_engine() as engine:
        await engine.load(config)
        return [int(v) for v in (await engine.infer("digits", {"input": X}))["label"]]


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
async def test_from_toml(workdir: Path, absolute: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = Path("models/digits/config.toml")
    config = trioinfer.ModelConfig.from_toml(workdir / toml if absolute else toml)
    assert config.path == workdir / "models" / "digits" / "1" / "model.onnx"
    # The config names one file, whatever the working directory is later.
    monkeypatch.chdir(workdir.parent)
    assert len(await labels(config)) == 2


async def test_from_toml_with_a_version_and_a_relative_path_key(workdir: Path) -> None:
    (workdir / "models" / "digits" / "2").mkdir()
    shutil.copy(workdir / "models/digits/1/model.onnx", workdir / "models/digits/2/model.onnx")
    config = trioinfer.ModelConfig.from_toml("models/digits/config.toml", version=1)
    assert config.path == workdir / "models" / "digits" / "1" / "model.onnx"
    # A `path` key in the file is relative to the file's directory.
    toml = workdir / "models" / "digits" / "config.toml"
    toml.write_text('path = "2/model.onnx"\n' + toml.read_text())
    config = trioinfer.ModelConfig.from_toml("models/digits/config.toml")
    assert config.path == workdir / "models" / "digits" / "2" / "model.onnx"
    assert len(await labels(config)) == 2


async def test_model_config_with_a_relative_path(workdir: Path) -> None:
    config = trioinfer.ModelConfig(name="digits", path="models/digits/1/model.onnx")
    assert len(await labels(config)) == 2


def test_from_dict_refuses_a_path_that_is_not_one() -> None:
    with pytest.raises(trioinfer.ConfigError, match="path"):
        trioinfer.ModelConfig.from_dict({"name": "m", "path": 5}, base=Path("x"))


def test_server_repository_with_a_relative_root(workdir: Path) -> None:
    repo = ModelRepository(Path("models"))
    assert "digits" in repo.names()
    assert repo.entry("digits").config(1).path == workdir / "models" / "digits" / "1" / "model.onnx"


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute"])
def test_bench_in_process_with_a_model_repository(workdir: Path, absolute: bool) -> None:
    out = workdir / "out.json"
    repository = str(workdir / "models") if absolute else "models/"
    command = [sys.executable, "-m", "trioinfer", "bench", "--in-process"]
    command += ["--model-repository", repository, "-m", "digits", "--concurrency", "2"]
    command += ["--warmup", "0.05", "--window", "0.2", "--windows", "2", "--json", str(out)]
    result = subprocess.run(
        command,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "120"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["target"] == "in-process"
