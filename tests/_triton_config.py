"""Reading GET .../config answers in tests: trioinfer's own settings among Triton's parameters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def own_setting(config: Mapping[str, Any], key: str) -> Any:
    """trioinfer's setting *key* as a GET .../config answer carries it: ``trioinfer.<key>``.

    A plugin's name is the parameter's string; anything else is JSON in it.
    """
    text = config["parameters"][f"trioinfer.{key}"]["string_value"]
    return text if key in ("scheduler", "batcher", "fallback") else json.loads(text)
