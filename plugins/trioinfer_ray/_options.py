"""The backend's options: the `OPTIONS` table and the checks of a model's ``backend_options``."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

import attrs

from trioinfer import ConfigError, ModelConfig
from trioinfer.lowlevel import Placement, check_seconds
from trioinfer_onnxruntime import OPTIONS as ORT_OPTIONS

#: Seconds ``load`` waits for an actor to be placed and its session built, by default.
DEFAULT_START_TIMEOUT_S: Final = 60.0
#: What an instance takes of a node's ``model:<name>`` resource with ``model_resource = true``:
#: a sliver, so that a node advertising 1 can host many instances of the model.
MODEL_RESOURCE_SHARE: Final = 0.001
_CODECS: Final = ("none", "uint8")

#: Every ``backend_options`` key the ray backend accepts, with what it means.
OPTIONS: Final[Mapping[str, str]] = {
    "address": "the Ray cluster to use: 'auto' (the one this machine belongs to), "
    "'ray://host:10001' (Ray Client) or 'host:6379'; left out: the Ray this process is "
    "connected to already, else a local one-node Ray started for you on 127.0.0.1",
    "num_cpus": "Ray logical CPUs each instance's actor reserves (default: the instance's "
    "threads, at least 1)",
    "num_gpus": "GPUs each instance's actor reserves (default 1 for a cuda or tensorrt device, "
    "else 0); Ray sets CUDA_VISIBLE_DEVICES, so the instance's device index counts within them",
    "resources": "custom Ray resources each actor reserves, a table such as "
    '{ "ssd" = 0.1 }: it is placed only on nodes that advertise them',
    "model_resource": "true: place instances only on nodes that advertise the resource "
    f"'model:<name>' (each instance takes {MODEL_RESOURCE_SHARE} of it; every version of a "
    "repository model asks for the same), e.g. nodes started with "
    "--resources '{\"model:digits\": 1}' where the model's weights are cached",
    "node_id": "a Ray node id (hex), or a list of them: instance i is placed on the "
    "(i mod n)-th, and nowhere else",
    "ship_model": "true: send the model file to the nodes through Ray's object store; "
    "false (default): each node reads the model's path from its own disk",
    "codec": "'none' (default) or 'uint8': float tensors travel as 8 bits per element with a "
    "per-tensor minimum and step (4x fewer bytes than float32; each element off by at most "
    "(max - min) / 510, plus one unit in the last place)",
    "start_timeout": "seconds to wait for an actor to be placed and to load the model before "
    f"the instance fails with BackendUnavailable (default {DEFAULT_START_TIMEOUT_S:g})",
    "onnxruntime": "a table of the onnxruntime backend's own options, applied in each actor "
    "(dispatch, pipeline_depth, graph_optimization_level, ...)",
}


@attrs.frozen
class RayOptions:
    """A model's checked ``backend_options`` for one instance."""

    address: str | None
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    node_id: str | None
    ship_model: bool
    codec: bool
    start_timeout: float
    ort_options: dict[str, Any]
    pipeline_depth: int


def check_options(config: ModelConfig, placement: Placement) -> RayOptions:
    """Check *config*'s ``backend_options`` for the instance at *placement*.

    Raises:
        ConfigError: An unknown option, or one of the wrong kind, naming what is expected.
    """
    options = dict(config.backend_options)
    where = f"model {config.name!r}: ray backend option"
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"model {config.name!r}: ray backend has no option "
            f"{', '.join(map(repr, unknown))}; it knows {', '.join(sorted(OPTIONS))}"
        )
    address = options.get("address")
    if address is not None and (not isinstance(address, str) or not address):
        raise ConfigError(
            f"{where} address must be 'auto', 'ray://host:port' or 'host:port', got {address!r}"
        )
    problem = address_problem(address) if address is not None else None
    if problem is not None:
        raise ConfigError(f"{where} address: {problem}")
    gpu = placement.device.kind != "cpu"
    threads = placement.threads or 1
    num_cpus = _amount(where, "num_cpus", options.get("num_cpus", threads))
    num_gpus = _amount(where, "num_gpus", options.get("num_gpus", 1 if gpu else 0))
    raw = options.get("resources", {})
    if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(f"{where} resources must be a table of name = amount, got {raw!r}")
    resources = {name: _amount(where, f"resources[{name!r}]", v) for name, v in raw.items()}
    model_resource = options.get("model_resource", False)
    if not isinstance(model_resource, bool):
        raise ConfigError(f"{where} model_resource must be true or false, got {model_resource!r}")
    if model_resource:
        resources[model_resource_name(config.name)] = MODEL_RESOURCE_SHARE
    node_id = _node_for(where, options.get("node_id"), placement.index)
    ship = options.get("ship_model", False)
    if not isinstance(ship, bool):
        raise ConfigError(f"{where} ship_model must be true or false, got {ship!r}")
    codec = options.get("codec", "none")
    if codec not in _CODECS:
        raise ConfigError(f"{where} codec must be 'none' or 'uint8', got {codec!r}")
    timeout = check_seconds(
        f"{where} start_timeout", options.get("start_timeout", DEFAULT_START_TIMEOUT_S)
    )
    ort = options.get("onnxruntime", {})
    if not isinstance(ort, Mapping):
        raise ConfigError(f"{where} onnxruntime must be a table of options, got {ort!r}")
    bad = sorted(set(ort) - set(ORT_OPTIONS))
    if bad:
        raise ConfigError(
            f"{where} onnxruntime has no option {', '.join(map(repr, bad))}; the onnxruntime "
            f"backend knows {', '.join(sorted(ORT_OPTIONS))}"
        )
    depth = ort.get("pipeline_depth", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 8:
        raise ConfigError(
            f"{where} onnxruntime.pipeline_depth must be an integer from 1 to 8, got {depth!r}"
        )
    return RayOptions(
        address=address,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources,
        node_id=node_id,
        ship_model=ship,
        codec=codec == "uint8",
        start_timeout=timeout,
        ort_options=dict(ort),
        pipeline_depth=depth,
    )


def address_problem(address: str) -> str | None:
    """Why *address* is no address a Ray driver connects to (a scheme but ``ray://``), or None.

    ``http://head:8265``, the dashboard's, is what ``ray job submit`` reads from
    ``RAY_ADDRESS``: a user of Ray Jobs may well have it set.
    """
    scheme, sep, _ = address.partition("://")
    if not sep or scheme == "ray":
        return None
    jobs = " (http://host:8265 is the dashboard's (Ray Jobs') address)" if "http" in scheme else ""
    return (
        f"{address!r} is not an address a Ray driver connects to{jobs}; give 'host:6379' "
        "(the head's GCS), 'ray://host:10001' (Ray Client) or 'auto'"
    )


#: How ``trioinfer serve`` names a repository model's version in the engine: ``digits.v3``.
_SERVED_VERSION = re.compile(r"^(.+)\.v[0-9]+$")


def model_resource_name(model: str) -> str:
    """The node resource a model's instances ask for with ``model_resource = true``.

    ``model:<name>``, the name without the version ``trioinfer serve`` gives a
    repository model in the engine (its version 3 of ``digits`` is ``digits.v3``):
    a node advertising ``model:digits`` hosts every version of ``digits``, as the
    docs tell operators to start it.
    """
    served = _SERVED_VERSION.match(model)
    return f"model:{served.group(1) if served else model}"


def _amount(where: str, name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{where} {name} must be a number >= 0, got {value!r}")
    return float(value)


def _node_for(where: str, value: object, index: int) -> str | None:
    if value is None:
        return None
    nodes = [value] if isinstance(value, str) else value
    if (
        not isinstance(nodes, (list, tuple))
        or not nodes
        or not all(isinstance(n, str) and n and _is_hex(n) for n in nodes)
    ):
        raise ConfigError(
            f"{where} node_id must be a Ray node id (hex) or a non-empty list of them, "
            f"got {value!r}"
        )
    return str(nodes[index % len(nodes)])


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True
