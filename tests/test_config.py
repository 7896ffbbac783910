"""ModelConfig from Python and from config.toml; bad configs fail at once with the field named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trioinfer import ConfigError, Device, Instance, ModelConfig
from trioinfer.lowlevel import Placement


def test_defaults_and_placements() -> None:
    config = ModelConfig(
        name="m",
        path="m.onnx",
        instances=[Instance("cuda:1", count=2, threads=4), Instance("cpu", cpu_affinity=[0])],
    )
    assert config.placements() == [
        Placement(Device("cuda", 1), 0, 4),
        Placement(Device("cuda", 1), 1, 4),
        Placement(Device("cpu"), 2, 0, (0,)),
    ]
    assert (config.backend, config.scheduler, config.batcher, config.fallback) == (
        "onnxruntime",
        "fifo",
        "none",
        "none",
    )


@pytest.mark.parametrize(
    ("text", "device"),
    [("cpu", Device("cpu")), ("CUDA", Device("cuda", 0)), ("tensorrt:3", Device("tensorrt", 3))],
)
def test_devices_parse(text: str, device: Device) -> None:
    assert Device.parse(text) == device


@pytest.mark.parametrize("text", ["gpu", "cuda:-1", "cpu:1", "cuda:x", ""])
def test_bad_devices_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        Device.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "../etc"}, "model name"),
        ({"name": ""}, "model name"),
        ({"instances": []}, "non-empty list"),
        # instances = "cpu" in a config.toml: the message shows the TOML that works.
        ({"instances": "cpu"}, r'\[\[instances\]\] tables, e.g. instances = \[\{ device = "cpu"'),
        ({"instances": [{"count": 0}]}, "count must be a positive integer"),
        ({"max_queue_size": 0}, "max_queue_size must be a positive integer"),
        ({"casting": "unsafe"}, "casting must be"),
        ({"scheduler": ""}, "scheduler must be a plugin name"),
        ({"scheduler_options": [1]}, "plugin options must be a table"),
        ({"queue_timeouts": {"0": 1, "00": 2}}, "queue_timeouts: level 0 is given twice"),
        ({"queue_sizes": {"-1": 1, " -1": 2}}, "queue_sizes: level -1 is given twice"),
        # cpu_fallback = "no" in a config.toml: truthy, so it once meant true.
        ({"cpu_fallback": "no"}, "cpu_fallback must be true or false, got 'no'"),
        ({"cpu_fallback": 0}, "cpu_fallback must be true or false, got 0"),
    ],
)
def test_bad_fields_are_refused(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"name": "m", "path": "m.onnx", **kwargs}
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**fields)  # type: ignore[arg-type]


def test_bad_instance_fields_are_refused() -> None:
    with pytest.raises(ConfigError, match="threads must be an integer >= 0"):
        Instance(threads=-1)
    with pytest.raises(ConfigError, match="cpu_affinity must be a list"):
        Instance(cpu_affinity=["a"])  # type: ignore[list-item]


def test_instance_count_is_bounded() -> None:
    # Each instance is a session of its own: a count of 100000 (a typo, or a client's
    # load override) would try to create them all.
    assert Instance(count=256).count == 256
    with pytest.raises(
        ConfigError, match="instances count 100000 is more than a model may have: at most 256"
    ):
        Instance(count=100_000)
    with pytest.raises(ConfigError, match=r"instances count 257 .* at most 256"):
        ModelConfig.from_dict({"name": "m", "path": "m.onnx", "instances": [{"count": 257}]})
    # The bound is on the model's instances, over all its groups.
    groups = [Instance("cuda:0", count=200), Instance("cpu", count=100)]
    with pytest.raises(ConfigError, match=r"300 instances in all .* at most 256"):
        ModelConfig(name="m", path="m.onnx", instances=groups)


def write_repo(tmp_path: Path, toml: str, versions: tuple[int, ...] = (1, 3)) -> Path:
    model_dir = tmp_path / "digits"
    model_dir.mkdir()
    for v in versions:
        (model_dir / str(v)).mkdir(parents=True)
        (model_dir / str(v) / "model.onnx").write_bytes(b"")
    (model_dir / "config.toml").write_text(toml)
    return model_dir / "config.toml"


def test_from_toml_finds_the_latest_version(tmp_path: Path) -> None:
    path = write_repo(
        tmp_path,
        """
max_queue_size = 16
backend_options = { dispatch = "thread" }

[[instances]]
device = "cpu"
count = 2
threads = 1
""",
    )
    config = ModelConfig.from_toml(path)
    assert config.name == "digits"
    assert config.path == tmp_path / "digits" / "3" / "model.onnx"
    assert config.instances == (Instance("cpu", count=2, threads=1),)
    assert config.max_queue_size == 16
    assert dict(config.backend_options) == {"dispatch": "thread"}
    assert ModelConfig.from_toml(path, version=1).path.parent.name == "1"


def test_from_toml_skips_version_folders_the_repository_does_not_serve(tmp_path: Path) -> None:
    # '²' passes str.isdigit() but not int(); "01" and "0" are no version the server
    # serves: none of them is a crash or the version picked.
    path = write_repo(tmp_path, "", versions=(2,))
    for odd in ("\u00b2", "01", "0", "007"):
        (path.parent / odd).mkdir()
        (path.parent / odd / "model.onnx").write_bytes(b"")
    assert ModelConfig.from_toml(path).path == path.parent / "2" / "model.onnx"
    shutil.rmtree(path.parent / "2")
    with pytest.raises(ConfigError, match=r"has no version directory holding model\.onnx"):
        ModelConfig.from_toml(path)


def test_from_toml_refuses_unknown_keys_and_names_them(tmp_path: Path) -> None:
    path = write_repo(tmp_path, "max_queue = 3\n")
    with pytest.raises(ConfigError, match="unknown key 'max_queue'; known keys are"):
        ModelConfig.from_toml(path)
    path.write_text("[[instances]]\ndevice = 'cpu'\ncores = 2\n")
    with pytest.raises(ConfigError, match="instances: unknown key 'cores'"):
        ModelConfig.from_toml(path)


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ("max_queue = 3\n", "did you mean 'max_queue_size' for 'max_queue'?"),
        (
            "max_batch_size = 8\n",
            "write batcher = 'dynamic' and max_batch_size in [batcher_options]",
        ),
        ("[[instance_group]]\ncount = 2\n", "write [[instances]] tables"),
        ("device = 'cpu'\n", "device goes in an [[instances]] table"),
        ("version_policy = 'latest'\n", "pass version=N to ModelConfig.from_toml"),
        ("backend = 'python'\ninputs = []\n", "inputs is a backend option: put it in [backend"),
    ],
)
def test_an_unknown_key_says_what_to_write_instead(tmp_path: Path, text: str, hint: str) -> None:
    # The first mistakes: a typo, Triton's config.pbtxt fields, a server-only key.
    path = write_repo(tmp_path, text)
    with pytest.raises(ConfigError, match="known keys are ") as caught:
        ModelConfig.from_toml(path)
    assert hint in str(caught.value).split("known keys are ", 1)[1]


def test_from_toml_names_an_unknown_key_before_a_missing_model_file(tmp_path: Path) -> None:
    # With no version directory either, the typo is what the reader must hear about.
    path = write_repo(tmp_path, "max_queue = 3\n", versions=())
    with pytest.raises(ConfigError, match="unknown key 'max_queue'"):
        ModelConfig.from_toml(path)


def test_from_toml_on_a_directory_is_a_config_error(tmp_path: Path) -> None:
    path = write_repo(tmp_path, "")
    with pytest.raises(ConfigError, match=r"is a directory; .* e\.g\. .*config\.toml"):
        ModelConfig.from_toml(path.parent)


def test_from_toml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no model config at"):
        ModelConfig.from_toml(tmp_path / "nope" / "config.toml")
    path = write_repo(tmp_path, "name = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        ModelConfig.from_toml(path)
    # tomllib decodes the file itself: a Latin-1 one raised UnicodeDecodeError, no ConfigError.
    path.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"config\.toml is not valid TOML: it is not UTF-8 \("):
        ModelConfig.from_toml(path)
    path.write_text("name = " + "[" * 5000 + "]" * 5000)  # tomllib's RecursionError
    with pytest.raises(ConfigError, match=r"config\.toml is not valid TOML: it nests too"):
        ModelConfig.from_toml(path)
    path.write_text("")
    with pytest.raises(ConfigError, match=r"no version 7 holding model\.onnx"):
        ModelConfig.from_toml(path, version=7)
    for version in path.parent.iterdir():
        if version.is_dir():
            shutil.rmtree(version)
    with pytest.raises(
        ConfigError, match=r"has no version directory holding model\.onnx: expected"
    ):
        ModelConfig.from_toml(path)
    path.write_text('backend = "affine"\n')
    with pytest.raises(ConfigError, match=r"on the 'affine' backend too, .* named model\.onnx"):
        ModelConfig.from_toml(path)


def test_relative_path_is_relative_to_the_config(tmp_path: Path) -> None:
    path = write_repo(tmp_path, 'path = "weights/model.onnx"\n', versions=())
    assert ModelConfig.from_toml(path).path == tmp_path / "digits" / "weights" / "model.onnx"


def test_path_is_optional_and_the_old_placeholder_means_none(tmp_path: Path) -> None:
    """A model that reads no file needs no path; ``path="-"`` (what code passed before) is None."""
    assert ModelConfig(name="m", backend="python").path is None
    assert ModelConfig(name="m", path="-").path is None
    assert ModelConfig.from_dict({"name": "m", "path": "-"}, base=tmp_path).path is None
    assert ModelConfig.from_dict({"name": "m"}, base=tmp_path).path is None
    assert ModelConfig(name="m", path="m.onnx").model_file("the .onnx file") == Path("m.onnx")


def test_model_file_without_a_path_is_a_config_error_naming_the_backend() -> None:
    config = ModelConfig(name="x", backend="onnxruntime")
    with pytest.raises(
        ConfigError,
        match=r"model 'x' has no path: the onnxruntime backend needs the \.onnx file to load; "
        r"give it as ModelConfig\(path=\.\.\.\)",
    ):
        config.model_file("the .onnx file to load")


def test_a_pipelines_config_toml_gives_it_no_path(tmp_path: Path) -> None:
    path = write_repo(tmp_path, 'backend = "pipeline"\n', versions=())
    assert ModelConfig.from_toml(path).path is None
