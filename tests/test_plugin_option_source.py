"""A plugin refusing its options from a repository's config says which file and model."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

import trioinfer
from trioinfer import ConfigError
from trioinfer._examples import example_repository
from trioinfer.server import ModelRepository
from trioinfer.server._models import ServedModels

#: Each plugin of the digits model, with an option it refuses.
REFUSED = [
    ("scheduler", "priority", {"max_wait": -1}, "max_wait must be"),
    ("batcher", "dynamic", {"max_queue_dela": 1}, "'max_queue_dela'"),
    ("fallback", "resilient", {"attempts": 0}, "attempts must be"),
]


def digits(root: Path, lines: str = "") -> None:
    shutil.copytree(example_repository() / "digits", root / "digits")
    (root / "digits" / "config.toml").write_text(f'name = "digits"\n{lines}')


async def load_error(root: Path, override: dict[str, Any] | None = None) -> str:
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(root))
        with pytest.raises(ConfigError) as caught:
            await served.load("digits", override)
    return str(caught.value)


@pytest.mark.parametrize(("kind", "plugin", "options", "said"), REFUSED)
async def test_a_plugin_refusing_options_from_config_toml_names_the_file_and_model(
    tmp_path: Path, kind: str, plugin: str, options: dict[str, Any], said: str
) -> None:
    # "failed to load 'digits': batcher plugin 'dynamic' does not accept ..." left the
    # operator of a large repository looking for the file that gave the option.
    ((key, value),) = options.items()
    digits(tmp_path, f'{kind} = "{plugin}"\n{kind}_options = {{ {key} = {value} }}\n')
    message = await load_error(tmp_path)
    assert message.startswith("failed to load 'digits': digits/config.toml: "), message
    assert said in message, message


@pytest.mark.parametrize(("kind", "plugin", "options", "said"), REFUSED)
async def test_a_plugin_refusing_options_from_a_load_override_says_so(
    tmp_path: Path, kind: str, plugin: str, options: dict[str, Any], said: str
) -> None:
    digits(tmp_path)
    message = await load_error(tmp_path, {kind: plugin, f"{kind}_options": options})
    assert message.startswith(
        "failed to load 'digits': digits/config.toml with the config override: "
    ), message
    assert said in message, message
