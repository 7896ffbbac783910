"""The server's model repository: layout, version policies, confinement and the index."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

import trioinfer
from _serve import start_serving
from trioinfer import ConfigError, ModelNotFound, example_repository
from trioinfer.server._repository import IndexEntry, ModelRepository, VersionPolicy
from trioinfer.testing import models


@pytest.fixture(scope="session")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ONNX model (a + b, a - b) to copy into repositories."""
    return models.write_add(tmp_path_factory.mktemp("onnx") / "add.onnx")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    out = tmp_path / "repo"
    out.mkdir()
    return out


def make_model(
    model_file: Path,
    root: Path,
    name: str,
    versions: Iterable[int] = (1,),
    config: str | None = None,
) -> Path:
    """Make <root>/<name>/<v>/model.onnx for each version, and config.toml if given."""
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    for version in versions:
        (directory / str(version)).mkdir()
        shutil.copyfile(model_file, directory / str(version) / "model.onnx")
    if config is not None:
        (directory / "config.toml").write_text(config, encoding="utf-8")
    return directory


def symlink(target: Path, link: Path, *, is_dir: bool = False) -> None:
    try:
        os.symlink(target, link, target_is_directory=is_dir)
    except (OSError, NotImplementedError) as exc:
        pytest.skip(f"cannot make symbolic links here: {exc}")


# The bundled example


def test_bundled_example_repository_is_served() -> None:
    repo = ModelRepository(example_repository())
    assert repo.names() == [
        "accumulator",
        "digit_names",
        "digits",
        "read_digit",
        "repeat_int32",
        "scale_image",
    ]
    entry = repo.entry("digits")
    assert entry.versions == (1,)
    assert entry.selected() == (1,)
    assert entry.notes == ()
    config = entry.config(1)
    assert config.name == "digits"
    assert config.path == example_repository().resolve() / "digits" / "1" / "model.onnx"
    assert config.path.is_file()
    assert [str(i.device) for i in config.instances] == ["cpu"]
    assert [(e.name, e.version) for e in repo.index()] == [
        ("accumulator", 1),
        ("digit_names", 1),
        ("digits", 1),
        ("read_digit", 1),
        ("repeat_int32", 1),
        ("scale_image", 1),
    ]
    # The pipeline has no file and no version directory: its config is the whole of it.
    pipeline = repo.entry("read_digit")
    assert (pipeline.versions, pipeline.notes) == ((1,), ())
    assert pipeline.config(1).backend == "pipeline"
    assert repo.entry("scale_image").config(1).path.name == "model.py"


async def test_the_bundled_pipeline_is_served_with_no_code() -> None:
    """scale_image (Python), digits (ONNX), digit_names (Python), as one model over HTTP."""

    images, labels = trioinfer.digits_samples()
    pixels = images[:3].reshape(3, 8, 8).astype(np.uint8)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, example_repository())
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            body = {
                "inputs": [
                    {
                        "name": "IMAGE",
                        "shape": [3, 8, 8],
                        "datatype": "UINT8",
                        "data": pixels.ravel().tolist(),
                    }
                ]
            }
            answer = (await client.post("/v2/models/read_digit/infer", json=body)).json()
            bad = await client.post(
                "/v2/models/read_digit/infer",
                json={"inputs": [{**body["inputs"][0], "data": [200] * 192}]},
            )
        nursery.cancel_scope.cancel()
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    assert answer["outputs"][0]["data"] == [names[label] for label in labels[:3]]
    # A step's failure names the step, with the repository's model names.
    assert bad.status_code == 400  # the model raised InvalidInput
    assert bad.json()["error"].startswith(
        "pipeline 'read_digit' (version 1), step 0 (model 'scale_image' (version 1)): image "
        "holds an intensity of 200; they run from 0 to 16"
    )


# The repository root


def test_root_is_resolved(tmp_path: Path, root: Path) -> None:
    (tmp_path / "sub").mkdir()
    assert ModelRepository(tmp_path / "sub" / ".." / "repo").root == root.resolve()


def test_missing_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ModelRepository(tmp_path / "nowhere")


def test_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        ModelRepository(tmp_path / "file")


def test_names_skip_hidden_files_and_invalid_names_and_log_once(
    onnx_file: Path, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_model(onnx_file, root, "b")
    make_model(onnx_file, root, "a")
    (root / ".git").mkdir()
    (root / "README.md").write_text("models")
    (root / "_private").mkdir()
    caplog.set_level(logging.INFO, logger="trioinfer.server")
    repo = ModelRepository(root)
    assert repo.names() == ["a", "b"]
    assert repo.names() == ["a", "b"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("README.md" in m for m in messages) == 1
    assert sum("_private" in m for m in messages) == 1
    assert not any(".git" in m for m in messages)


def test_repository_removed_while_serving(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m")
    repo = ModelRepository(root)
    shutil.rmtree(root)
    with pytest.raises(ConfigError, match="cannot list the model repository"):
        repo.names()
    with pytest.raises(ConfigError, match="cannot list the model repository"):
        repo.index()
    with pytest.raises(ModelNotFound, match="cannot list the model repository"):
        repo.entry("m")


def test_root_in_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    symlink(tmp_path / "loop", tmp_path / "loop", is_dir=True)
    with pytest.raises(ConfigError, match="cannot be opened"):
        ModelRepository(tmp_path / "loop")


def test_empty_repository(root: Path) -> None:
    repo = ModelRepository(root)
    assert repo.names() == []
    assert repo.index() == []
    with pytest.raises(ModelNotFound, match="holds no models"):
        repo.entry("m")


# Model names


@pytest.mark.parametrize(
    "name",
    ["..", "a/b", "a\\b", ".hidden", "", "x" * 129, "a..b", "-dash", "abc\n", "sp ace", "é"],
)
def test_invalid_names_are_refused_with_the_rule(root: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="letters, digits") as info:
        ModelRepository(root).entry(name)
    assert not isinstance(info.value, ModelNotFound)


def test_non_string_name_is_refused(root: Path) -> None:
    with pytest.raises(ConfigError, match="not valid"):
        ModelRepository(root).entry(42)  # type: ignore[arg-type]


def test_longest_valid_name_is_accepted(onnx_file: Path, root: Path) -> None:
    name = "m" * 128
    make_model(onnx_file, root, name)
    assert ModelRepository(root).entry(name).versions == (1,)


def test_missing_model_lists_the_models_there(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "alpha")
    make_model(onnx_file, root, "beta")
    (root / "gamma").write_text("not a model")
    with pytest.raises(ModelNotFound, match=r"no model 'gamma'.*alpha, beta"):
        ModelRepository(root).entry("gamma")


def test_long_listing_is_cut_short(root: Path) -> None:
    for i in range(25):
        (root / f"m{i:02d}").mkdir()
    with pytest.raises(ModelNotFound, match=r"m19 and 5 more$"):
        ModelRepository(root).entry("other")


# Versions and policies


@pytest.mark.parametrize(
    ("value", "policy"),
    [
        ("latest", VersionPolicy()),
        ("all", VersionPolicy("all")),
        ({"latest": 2}, VersionPolicy("latest", count=2)),
        ({"latest": {}}, VersionPolicy()),
        ({"latest": {"num_versions": 3}}, VersionPolicy("latest", count=3)),
        ({"all": {}}, VersionPolicy("all")),
        ({"specific": [3, 1, 3]}, VersionPolicy("specific", versions=(1, 3))),
        ({"specific": {"versions": [2]}}, VersionPolicy("specific", versions=(2,))),
    ],
)
def test_policy_forms_parse(value: object, policy: VersionPolicy) -> None:
    assert VersionPolicy.parse(value) == policy


@pytest.mark.parametrize(
    "value",
    [
        "newest",
        "specific",
        3,
        None,
        [],
        {},
        {"latest": 0},
        {"latest": True},
        {"latest": "2"},
        {"latest": {"num_versions": 2, "extra": 1}},
        {"all": 1},
        {"all": {"x": 1}},
        {"specific": []},
        {"specific": [0]},
        {"specific": ["1"]},
        {"specific": [1 << 63]},
        {"specific": 1},
        {"specific": {}},
        {"latest": 1, "all": {}},
        {"newest": 1},
    ],
)
def test_bad_policies_are_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="version_policy"):
        VersionPolicy.parse(value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "newest"},
        {"kind": "all", "count": 2},
        {"kind": "latest", "versions": (1,)},
        {"kind": "specific"},
        {"kind": "latest", "count": 0},
    ],
)
def test_inconsistent_policies_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="version_policy"):
        VersionPolicy(**kwargs)


@pytest.mark.parametrize(
    ("policy", "selected"),
    [
        (VersionPolicy(), (5,)),
        (VersionPolicy("latest", count=2), (3, 5)),
        (VersionPolicy("latest", count=10), (1, 3, 5)),
        (VersionPolicy("all"), (1, 3, 5)),
        (VersionPolicy("specific", versions=(1, 5)), (1, 5)),
        (VersionPolicy("specific", versions=(2, 3)), (3,)),
    ],
)
def test_policies_select(policy: VersionPolicy, selected: tuple[int, ...]) -> None:
    assert policy.select([5, 1, 3]) == selected


@given(
    available=st.lists(st.integers(1, 1000), max_size=20),
    count=st.integers(1, 25),
    wanted=st.lists(st.integers(1, 1000), min_size=1, max_size=5),
)
def test_selection_is_ascending_and_from_what_is_available(
    available: list[int], count: int, wanted: list[int]
) -> None:
    ordered = sorted(set(available))
    assert VersionPolicy("latest", count=count).select(available) == tuple(ordered[-count:])
    assert VersionPolicy("all").select(available) == tuple(ordered)
    specific = VersionPolicy("specific", versions=wanted).select(available)
    assert specific == tuple(v for v in ordered if v in wanted)


@pytest.mark.parametrize(
    ("text", "selected"),
    [
        ("", (3,)),
        ('version_policy = "latest"', (3,)),
        ("version_policy = { latest = 2 }", (2, 3)),
        ('version_policy = "all"', (1, 2, 3)),
        ("version_policy = { all = {} }", (1, 2, 3)),
        ("version_policy = { specific = [1, 3] }", (1, 3)),
    ],
)
def test_config_policies_select_versions(
    onnx_file: Path, root: Path, text: str, selected: tuple[int, ...]
) -> None:
    make_model(onnx_file, root, "m", (1, 2, 3), text)
    entry = ModelRepository(root).entry("m")
    assert entry.versions == (1, 2, 3)
    assert entry.selected() == selected
    assert "version_policy" not in entry.settings


def test_specific_version_missing_on_disk_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1, 2), "version_policy = { specific = [2, 4] }")
    entry = ModelRepository(root).entry("m")
    with pytest.raises(ConfigError, match=r"names version 4, not on disk; versions on disk: 1, 2"):
        entry.selected()


def test_bad_policy_in_config_names_the_file(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), 'version_policy = "newest"')
    with pytest.raises(ConfigError, match=r"m/config\.toml: version_policy must be"):
        ModelRepository(root).entry("m")


def test_version_directories_are_read_strictly(
    onnx_file: Path, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = make_model(onnx_file, root, "m", (2, 10))
    for odd in ("0", "01", "\u0661"):  # zero, a leading zero, an Arabic-Indic digit one
        (directory / odd).mkdir()
        shutil.copyfile(onnx_file, directory / odd / "model.onnx")
    (directory / "3").mkdir()  # no model.onnx
    (directory / "4").mkdir()
    (directory / "4" / "model.onnx").mkdir()  # not a file
    (directory / "5").write_text("a file, not a directory")
    (directory / "99999999999999999999").mkdir()
    caplog.set_level(logging.INFO, logger="trioinfer.server")
    entry = ModelRepository(root).entry("m")
    assert entry.versions == (2, 10)
    assert entry.selected() == (10,)
    notes = "\n".join(entry.notes)
    for name in ("0", "01", "\u0661", "3", "4", "5", "99999999999999999999"):
        assert f" {name} (" in notes
    assert "ignored version directory 3 (it holds no model.onnx)" in notes
    assert len(caplog.records) == len(entry.notes)


def test_model_without_versions(root: Path) -> None:
    (root / "m").mkdir()
    repo = ModelRepository(root)
    entry = repo.entry("m")
    assert entry.versions == ()
    with pytest.raises(ConfigError, match=r"no version to serve: expected m/<N>/model\.onnx"):
        entry.selected()
    with pytest.raises(ConfigError, match="has no version 1; versions on disk: none"):
        entry.config(1)
    [row] = repo.index()
    assert row.name == "m"
    assert row.version is None
    assert "no version to serve" in row.reason


def test_a_model_py_without_backend_python_is_told_the_key_it_lacks(
    onnx_file: Path, root: Path
) -> None:
    # A newcomer's first Python model: model.py in a version directory, config.toml
    # declaring inputs and outputs, but no backend = "python". Not just "expected
    # m/<N>/model.onnx": the file that is there, and the key that serves it.
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.py").write_text("class Model: ...\n")
    with pytest.raises(ConfigError) as caught:
        ModelRepository(root).entry("m").selected()
    assert str(caught.value) == (
        "model 'm' has no version to serve: expected m/<N>/model.onnx with N a positive "
        "integer; ignored version directory 1 (it holds no model.onnx, but a model.py, which "
        'is served with backend = "python" in config.toml)'
    )
    # And the other way round: an ONNX file under backend = "python".
    (root / "m" / "config.toml").write_text('backend = "python"\n')
    (root / "m" / "1" / "model.py").unlink()
    shutil.copyfile(onnx_file, root / "m" / "1" / "model.onnx")
    with pytest.raises(ConfigError, match=r'backend = "onnxruntime" \(the default\) in config'):
        ModelRepository(root).entry("m").selected()


def test_a_plugin_backend_model_without_model_onnx_is_told_the_file_name(root: Path) -> None:
    # A third-party backend's file in a version directory is model.onnx, whatever its
    # format: its author, who wrote 1/model.npz, is told so and shown path.
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.npz").write_bytes(b"")
    (root / "m" / "config.toml").write_text('backend = "affine"\n')
    with pytest.raises(ConfigError, match=r"'affine' backend too, .* is named model\.onnx.*path ="):
        ModelRepository(root).entry("m").selected()
    (root / "m" / "config.toml").write_text('backend = "onnxruntime"\n')
    with pytest.raises(
        ConfigError,
        match=r"model\.onnx with N a positive integer; "
        r"ignored version directory 1 \(it holds no model\.onnx\)$",
    ):
        ModelRepository(root).entry("m").selected()


def test_a_misspelt_first_party_backend_is_called_a_typo_not_a_plugin(root: Path) -> None:
    # backend = "pyhton" is no plugin with a model.onnx of its own: the error asks about
    # the typo instead of explaining a third-party backend's file name.
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.py").write_text("class Model: ...\n")
    (root / "m" / "config.toml").write_text('backend = "pyhton"\n')
    with pytest.raises(ConfigError) as caught:
        ModelRepository(root).entry("m").selected()
    message = str(caught.value)
    assert "; is backend = 'pyhton' a typo? did you mean 'python'?" in message
    assert "whatever its format" not in message


# config.toml


def test_without_config_a_model_gets_defaults(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m", (1, 2))
    entry = ModelRepository(root).entry("m")
    assert entry.settings == {}
    assert entry.policy == VersionPolicy()
    config = entry.config(2)
    assert config.name == "m"
    assert config.path == directory / "2" / "model.onnx"
    assert config.max_queue_size == 1024
    assert config.backend == "onnxruntime"


def test_triton_config_beside_config_toml_is_ignored_with_a_note(
    onnx_file: Path, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = make_model(onnx_file, root, "m")
    (directory / "config.toml").write_text("")
    (directory / "config.pbtxt").write_text('name: "m"\nplatform: "onnxruntime_onnx"\n')
    (directory / "labels.txt").write_text("cat\ndog\n")
    caplog.set_level(logging.INFO, logger="trioinfer.server")
    repo = ModelRepository(root)
    entry = repo.entry("m")
    assert entry.versions == (1,)
    assert entry.settings == {}
    assert "ignored config.pbtxt (config.toml is read; it wins)" in entry.notes
    assert any("labels.txt" in note for note in entry.notes)
    assert any("config.pbtxt" in r.getMessage() for r in caplog.records)
    assert all(r.levelno == logging.INFO for r in caplog.records)
    # Asked again, the same notes are not logged again.
    caplog.clear()
    assert repo.entry("m").notes == entry.notes
    assert repo.index() == [IndexEntry("m", 1, "")]
    assert caplog.records == []


def test_settings_feed_the_config(onnx_file: Path, root: Path) -> None:
    make_model(
        onnx_file,
        root,
        "m",
        (1,),
        'name = "m"\nmax_queue_size = 7\nversion_policy = "all"\n'
        '[[instances]]\ndevice = "cpu"\ncount = 2\n',
    )
    entry = ModelRepository(root).entry("m")
    assert dict(entry.settings) == {
        "name": "m",
        "max_queue_size": 7,
        "instances": [{"device": "cpu", "count": 2}],
    }
    config = entry.config(1)
    assert config.max_queue_size == 7
    assert config.instances[0].count == 2


def test_bad_toml_names_the_file_and_the_error(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), "max_queue_size = = 3\n")
    with pytest.raises(ConfigError, match=r"m/config\.toml is not valid TOML: .*line 1"):
        ModelRepository(root).entry("m")


def test_config_that_is_not_utf8_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m")
    (directory / "config.toml").write_bytes(b"max_queue_size = 3 # \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        ModelRepository(root).entry("m")


def test_deeply_nested_config_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), "x = " + "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"m/config\.toml"):
        ModelRepository(root).entry("m")


def test_huge_config_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), "# " + "x" * (1 << 20))
    with pytest.raises(ConfigError, match="larger than"):
        ModelRepository(root).entry("m")


def test_config_that_is_a_directory_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m")
    (directory / "config.toml").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        ModelRepository(root).entry("m")


def test_unknown_config_key_is_refused_with_the_known_ones(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), "max_queue = 3\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'max_queue'; known keys are .*max_queue_size"
    ):
        ModelRepository(root).entry("m")


def test_unknown_config_key_lists_the_servers_keys_too(onnx_file: Path, root: Path) -> None:
    # version_policy, traffic and labels are keys of a repository's config.toml as well.
    make_model(onnx_file, root, "m", (1,), "version_polcy = 'latest'\n")
    with pytest.raises(ConfigError) as caught:
        ModelRepository(root).entry("m")
    message = str(caught.value)
    assert message.startswith("m/config.toml: unknown key 'version_polcy'; known keys are ")
    assert all(key in message.split("; ")[1] for key in ("version_policy", "traffic", "labels"))
    assert message.endswith("; did you mean 'version_policy' for 'version_polcy'?")


def test_invalid_config_value_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), "max_queue_size = 0\n")
    with pytest.raises(ConfigError, match="max_queue_size must be a positive integer"):
        ModelRepository(root).entry("m")


def test_config_name_must_match_the_directory(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1,), 'name = "other"\n')
    with pytest.raises(ConfigError, match="differs from the directory's name 'm'"):
        ModelRepository(root).entry("m")


needs_permissions = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="file permissions do not stop root (or there are none to set here)",
)


@needs_permissions
def test_unreadable_config_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m", (1,), "max_queue_size = 3\n")
    (directory / "config.toml").chmod(0)
    try:
        with pytest.raises(ConfigError, match=r"cannot read m/config\.toml"):
            ModelRepository(root).entry("m")
    finally:
        (directory / "config.toml").chmod(0o644)


@needs_permissions
def test_unreadable_model_directory_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m")
    directory.chmod(0)
    try:
        with pytest.raises(ConfigError, match="cannot list its directory"):
            ModelRepository(root).entry("m")
    finally:
        directory.chmod(0o755)


# Overrides


def test_override_is_merged_on_top(onnx_file: Path, root: Path) -> None:
    make_model(
        onnx_file,
        root,
        "m",
        (1,),
        'max_queue_size = 7\ncasting = "safe"\nbatcher_options = { max_batch = 4 }\n',
    )
    entry = ModelRepository(root).entry("m")
    config = entry.config(1, {"max_queue_size": 9, "batcher_options": {"max_wait": 0.1}})
    assert config.max_queue_size == 9
    assert config.casting == "safe"
    assert dict(config.batcher_options) == {"max_wait": 0.1}
    # The entry itself is unchanged.
    assert entry.config(1).max_queue_size == 7


@pytest.mark.parametrize("key", ["name", "path", "version_policy"])
def test_override_of_repository_keys_is_refused(onnx_file: Path, root: Path, key: str) -> None:
    make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    with pytest.raises(ConfigError, match=f"may not set '{key}'"):
        entry.config(1, {key: "x"})


def test_unknown_override_key_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    with pytest.raises(ConfigError, match=r"model 'm' version 1: .*unknown key 'bogus'"):
        entry.config(1, {"bogus": 1})


@pytest.mark.parametrize("override", [["max_queue_size", 3], {1: 2}, "max_queue_size=3"])
def test_override_that_is_not_a_table_is_refused(
    onnx_file: Path, root: Path, override: Any
) -> None:
    make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    with pytest.raises(ConfigError, match="must be a table"):
        entry.config(1, override)


def test_invalid_override_value_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m")
    with pytest.raises(ConfigError, match="casting must be"):
        ModelRepository(root).entry("m").config(1, {"casting": "unsafe"})


@pytest.mark.parametrize("version", [2, 0, True, "1"])
def test_config_of_a_version_not_on_disk_is_refused(
    onnx_file: Path, root: Path, version: Any
) -> None:
    make_model(onnx_file, root, "m")
    with pytest.raises(ConfigError, match="versions on disk: 1"):
        ModelRepository(root).entry("m").config(version)


def test_config_of_a_version_removed_since_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    (directory / "1" / "model.onnx").unlink()
    with pytest.raises(ConfigError, match=r"m/1/model\.onnx is gone"):
        entry.config(1)
    with pytest.raises(ConfigError, match="is gone"):
        entry.fingerprint(1)


# The path key


def test_path_key_inside_the_model_directory_is_version_1(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m", (3,), 'path = "weights/add.onnx"\n')
    (directory / "weights").mkdir()
    shutil.copyfile(onnx_file, directory / "weights" / "add.onnx")
    entry = ModelRepository(root).entry("m")
    assert entry.versions == (1,)
    assert entry.selected() == (1,)
    assert entry.config(1).path == directory / "weights" / "add.onnx"
    assert any("ignored version directory 3" in note for note in entry.notes)
    assert not any("weights" in note for note in entry.notes)


def test_path_key_into_a_version_directory(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m", (1, 2), 'path = "2/model.onnx"\n')
    entry = ModelRepository(root).entry("m")
    assert entry.versions == (1,)
    assert entry.config(1).path == directory / "2" / "model.onnx"
    assert entry.notes == (
        "ignored version directory 1 (config.toml sets path, which is served as version 1)",
    )


def test_path_key_too_long_for_the_file_system(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (), f'path = "{"x" * 300}.onnx"\n')
    entry = ModelRepository(root).entry("m")
    assert entry.versions == ()
    with pytest.raises(ConfigError, match="no such file"):
        entry.selected()


def test_path_key_to_a_missing_file(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (), 'path = "nothing.onnx"\n')
    repo = ModelRepository(root)
    entry = repo.entry("m")
    assert entry.versions == ()
    with pytest.raises(
        ConfigError, match=r"sets path = 'nothing\.onnx', but there is no such file"
    ):
        entry.selected()
    [row] = repo.index()
    assert row.version is None
    assert "nothing.onnx" in row.reason


@pytest.mark.parametrize(
    "value",
    [
        '"../other/1/model.onnx"',
        '"/etc/passwd"',
        '"1/../../x.onnx"',
        '"a\\\\b.onnx"',
        '""',
        '"."',
        '"./"',
        '" "',
        "3",
    ],
)
def test_path_key_escaping_is_refused(onnx_file: Path, root: Path, value: str) -> None:
    make_model(onnx_file, root, "other")
    make_model(onnx_file, root, "m", (1,), f"path = {value}\n")
    with pytest.raises(ConfigError, match=r"m/config\.toml: path"):
        ModelRepository(root).entry("m")


def test_path_key_through_a_symlink_out_of_the_model_directory_is_refused(
    onnx_file: Path, root: Path
) -> None:
    other = make_model(onnx_file, root, "other")
    directory = make_model(onnx_file, root, "m", (), 'path = "link/1/model.onnx"\n')
    symlink(other, directory / "link", is_dir=True)
    with pytest.raises(ConfigError, match="leads outside the model directory"):
        ModelRepository(root).entry("m")


def test_path_key_through_a_symlink_out_of_the_repository_is_refused(
    onnx_file: Path, tmp_path: Path, root: Path
) -> None:
    outside = make_model(onnx_file, tmp_path, "outside")
    directory = make_model(onnx_file, root, "m", (), 'path = "link/1/model.onnx"\n')
    symlink(outside, directory / "link", is_dir=True)
    with pytest.raises(ConfigError, match="leads outside the model repository"):
        ModelRepository(root).entry("m")


# Symbolic links


def test_model_directory_linked_from_outside_is_refused(
    onnx_file: Path, tmp_path: Path, root: Path
) -> None:
    outside = make_model(onnx_file, tmp_path, "outside")
    symlink(outside, root / "evil", is_dir=True)
    repo = ModelRepository(root)
    assert repo.names() == ["evil"]
    with pytest.raises(ConfigError, match="leads outside the model repository") as info:
        repo.entry("evil")
    assert str(tmp_path) not in str(info.value)
    [row] = repo.index()
    assert row == IndexEntry("evil", None, str(info.value))


def test_model_file_linked_from_outside_is_refused(
    onnx_file: Path, tmp_path: Path, root: Path
) -> None:
    directory = make_model(onnx_file, root, "m", ())
    (directory / "1").mkdir()
    symlink(onnx_file, directory / "1" / "model.onnx")
    with pytest.raises(ConfigError, match=r"m/1/model\.onnx leads outside"):
        ModelRepository(root).entry("m")


def test_version_directory_linked_from_outside_is_refused(
    onnx_file: Path, tmp_path: Path, root: Path
) -> None:
    outside = make_model(onnx_file, tmp_path, "outside")
    directory = make_model(onnx_file, root, "m", ())
    symlink(outside / "1", directory / "1", is_dir=True)
    with pytest.raises(ConfigError, match="leads outside"):
        ModelRepository(root).entry("m")


def test_config_linked_from_outside_is_refused(onnx_file: Path, tmp_path: Path, root: Path) -> None:
    (tmp_path / "secret.toml").write_text("max_queue_size = 3\n")
    directory = make_model(onnx_file, root, "m")
    symlink(tmp_path / "secret.toml", directory / "config.toml")
    with pytest.raises(ConfigError, match=r"m/config\.toml leads outside"):
        ModelRepository(root).entry("m")


def test_model_file_replaced_by_an_escaping_link_later_is_refused(
    onnx_file: Path, root: Path
) -> None:
    directory = make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    (directory / "1" / "model.onnx").unlink()
    symlink(onnx_file, directory / "1" / "model.onnx")
    with pytest.raises(ConfigError, match="leads outside"):
        entry.config(1)


def test_symlink_loop_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m", ())
    (directory / "1").mkdir()
    symlink(directory / "1" / "model.onnx", directory / "1" / "model.onnx")
    with pytest.raises(ConfigError, match=r"model 'm': cannot resolve m/1/model\.onnx") as info:
        ModelRepository(root).entry("m")
    assert str(root) not in str(info.value)


def test_links_that_stay_inside_the_repository_are_followed(onnx_file: Path, root: Path) -> None:
    shared = make_model(onnx_file, root, "shared")
    directory = make_model(onnx_file, root, "m", ())
    (directory / "1").mkdir()
    symlink(shared / "1" / "model.onnx", directory / "1" / "model.onnx")
    symlink(directory, root / "alias", is_dir=True)
    repo = ModelRepository(root)
    assert repo.entry("m").config(1).path == directory / "1" / "model.onnx"
    assert repo.entry("alias").versions == (1,)


# Fingerprints


def test_fingerprint_changes_when_the_model_is_rewritten(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m", (1, 2))
    entry = ModelRepository(root).entry("m")
    before = entry.fingerprint(1)
    other = entry.fingerprint(2)
    assert entry.fingerprint(1) == before
    models.write_mlp(directory / "1" / "model.onnx", (4, 3))
    after = entry.fingerprint(1)
    assert after != before
    assert entry.fingerprint(2) == other
    # The same size and bytes, but a new modification time, is a change too.
    stat = (directory / "1" / "model.onnx").stat()
    os.utime(directory / "1" / "model.onnx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert entry.fingerprint(1) != after


def test_fingerprint_changes_with_the_config(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    without = entry.fingerprint(1)
    (directory / "config.toml").write_text("max_queue_size = 3\n")
    with_config = entry.fingerprint(1)
    assert with_config != without
    (directory / "config.toml").write_text("max_queue_size = 30\n")
    assert entry.fingerprint(1) != with_config


def test_fingerprint_of_an_unreadable_config_is_refused(onnx_file: Path, root: Path) -> None:
    directory = make_model(onnx_file, root, "m")
    entry = ModelRepository(root).entry("m")
    symlink(directory / "config.toml", directory / "config.toml")
    with pytest.raises(ConfigError, match=r"cannot stat m/config\.toml"):
        entry.fingerprint(1)


def test_fingerprint_of_a_version_not_on_disk_is_refused(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m")
    with pytest.raises(ConfigError, match="has no version 7"):
        ModelRepository(root).entry("m").fingerprint(7)


# The index


def test_index_lists_every_model_and_version_with_reasons(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "good", (1, 2))
    make_model(onnx_file, root, "broken", (1,), "max_queue_size = = 1\n")
    make_model(onnx_file, root, "unknown_key", (1,), "colour = 'red'\n")
    make_model(onnx_file, root, "pinned", (1, 2), "version_policy = { specific = [3] }\n")
    (root / "empty").mkdir()
    rows = {(row.name, row.version): row.reason for row in ModelRepository(root).index()}
    assert list(rows) == [
        ("broken", None),
        ("empty", None),
        ("good", 1),
        ("good", 2),
        ("pinned", 1),
        ("pinned", 2),
        ("unknown_key", None),
    ]
    assert rows["broken", None].startswith("broken/config.toml is not valid TOML")
    assert "no version to serve" in rows["empty", None]
    assert rows["good", 1] == 'not served: version_policy = "latest" serves version 2'
    assert rows["good", 2] == ""
    assert "names version 3, not on disk" in rows["pinned", 1]
    assert rows["pinned", 1] == rows["pinned", 2]
    assert "unknown key 'colour'" in rows["unknown_key", None]


def test_index_reason_names_the_versions_served(onnx_file: Path, root: Path) -> None:
    make_model(onnx_file, root, "m", (1, 2, 3), "version_policy = { latest = 2 }\n")
    assert ModelRepository(root).index() == [
        IndexEntry("m", 1, "not served: version_policy = { latest = 2 } serves versions 2, 3"),
        IndexEntry("m", 2, ""),
        IndexEntry("m", 3, ""),
    ]


def test_policy_text_is_config_syntax() -> None:
    assert str(VersionPolicy()) == '"latest"'
    assert str(VersionPolicy("all")) == '"all"'
    assert str(VersionPolicy("specific", versions=[3, 1])) == "{ specific = [1, 3] }"


async def test_pipelines_follow_their_step_models_versions_and_load_in_order(
    tmp_path: Path,
) -> None:
    """A new version of a step's model reloads the pipeline; a pipeline of a pipeline loads."""

    repo = tmp_path / "repo"
    shutil.copytree(example_repository(), repo)
    # A pipeline over the bundled pipeline, named to sort before everything it needs.
    (repo / "a_outer").mkdir()
    (repo / "a_outer" / "config.toml").write_text(
        'backend = "pipeline"\n[backend_options]\n'
        'inputs = [{ name = "I", dtype = "uint8", shape = ["batch", 8, 8] }]\n'
        'outputs = [{ name = "N", dtype = "string", shape = ["batch"] }]\n'
        "[[backend_options.steps]]\n"
        'model = "read_digit"\ninput_map = { IMAGE = "I" }\noutput_map = { NAME = "N" }\n'
    )
    images, labels = trioinfer.digits_samples()
    pixels = images[:2].reshape(2, 8, 8).astype(np.uint8).ravel().tolist()
    body = {"inputs": [{"name": "I", "shape": [2, 8, 8], "datatype": "UINT8", "data": pixels}]}
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo)
        assert listening.failed == ()
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            first = (await client.post("/v2/models/a_outer/infer", json=body)).json()
            # digits version 2 appears; loading digits serves it and drops version 1.
            shutil.copytree(repo / "digits" / "1", repo / "digits" / "2")
            loaded = await client.post("/v2/repository/models/digits/load")
            second = await client.post("/v2/models/a_outer/infer", json=body)
            index = (await client.post("/v2/repository/index")).json()
        nursery.cancel_scope.cancel()
    expected = [names[label] for label in labels[:2]]
    assert first["outputs"][0]["data"] == expected
    assert loaded.status_code == 200
    assert second.status_code == 200, second.text
    assert second.json()["outputs"][0]["data"] == expected
    assert [e["version"] for e in index if e["name"] == "digits" and e["state"] == "READY"] == ["2"]


#: A Triton ensemble over the bundled digits model, given whole by a load override (no
#: config file: its directory holds only an empty 1/, as Triton loads one).
CHAIN: dict[str, Any] = {
    "name": "chain",
    "platform": "ensemble",
    "max_batch_size": 8,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [64]}],
    "output": [{"name": "LABEL", "data_type": "TYPE_INT64", "dims": []}],
    "ensemble_scheduling": {
        "step": [
            {
                "model_name": "digits",
                "model_version": -1,
                "input_map": {"input": "IN"},
                "output_map": {"label": "LABEL"},
            }
        ]
    },
}


def chain_request(rows: int = 2) -> dict[str, Any]:
    """An infer request body for CHAIN: the first *rows* held-out digits."""
    images, _ = trioinfer.digits_samples()
    data = images[:rows].ravel().tolist()
    return {"inputs": [{"name": "IN", "shape": [rows, 64], "datatype": "FP32", "data": data}]}


@pytest.mark.pipeline
async def test_a_pipeline_a_load_override_configures_loads_again_without_it(
    tmp_path: Path,
) -> None:
    """Its override is its only config: a load without one (a reload, or a load after an
    unload) reuses it, the index lists it unloaded with its version, and after a restart,
    which forgets it, a load without it says so."""
    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    (repo / "chain" / "1").mkdir(parents=True)
    load = {"parameters": {"config": CHAIN}}
    _, labels = trioinfer.digits_samples()
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            assert (await client.post("/v2/repository/models/chain/load", json=load)).is_success
            config = (await client.get("/v2/models/chain/config")).json()
            reloaded = await client.post("/v2/repository/models/chain/load")
            again = (await client.get("/v2/models/chain/config")).json()
            assert (await client.post("/v2/repository/models/chain/unload")).is_success
            index = (await client.post("/v2/repository/index")).json()
            after_unload = await client.post("/v2/repository/models/chain/load")
            answer = await client.post("/v2/models/chain/infer", json=chain_request())
        nursery.cancel_scope.cancel()
    assert reloaded.status_code == 200, reloaded.text
    assert again == config
    assert [row for row in index if row["name"] == "chain"] == [
        {"name": "chain", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    assert after_unload.status_code == 200, after_unload.text
    assert answer.json()["outputs"][0]["data"] == labels[:2].tolist()
    # A restart: the server knows no config of it, and says what to do.
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            restarted = await client.post("/v2/repository/models/chain/load")
        nursery.cancel_scope.cancel()
    assert restarted.status_code == 400
    assert restarted.json()["error"].endswith(
        "a directory holding only an empty version directory is served with the config a "
        "load request carries (parameters.config, as Triton loads an ensemble), which the "
        "server keeps until it stops, not across a restart: load it with its config again, "
        "or write it as config.toml"
    )


def test_public_names() -> None:
    from trioinfer.server._models import public_names

    assert public_names("model 'digits.v12': x") == "model 'digits' (version 12): x"
    assert public_names("'a.b.v2' and 'c'") == "'a.b' (version 2) and 'c'"
    assert public_names("digits.v1 unquoted") == "digits.v1 unquoted"


async def test_server_log_lines_name_versions_as_answers_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:

    model = tmp_path / "repo" / "pairs"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(
        "class Model:\n    def infer(self, inputs):\n        return {'y': inputs['x']}\n"
    )
    (model / "config.toml").write_text(
        'backend = "python"\nbatcher = "dynamic"\n[backend_options]\n'
        'inputs = [{ name = "x", dtype = "float32", shape = ["batch", 4] }]\n'
        'outputs = [{ name = "y", dtype = "float32", shape = ["pairs", 2] }]\n'
    )
    caplog.set_level(logging.INFO, logger="trioinfer")
    async with trio.open_nursery() as nursery:
        await start_serving(nursery, tmp_path / "repo")
        nursery.cancel_scope.cancel()
    assert "model 'pairs' (version 1): the 'dynamic' batcher will not group" in caplog.text
    assert "pairs.v1" not in caplog.text


async def test_a_client_that_leaves_is_seen_on_a_reused_connection_after_a_large_body(
    tmp_path: Path,
) -> None:
    """A client that leaves mid-request is seen on a keep-alive connection used before.

    The serving tutorial's sequence; before the read-ahead was counted per
    watched request it failed about half the time (the watcher parked).
    """
    import json

    from prometheus_client.parser import text_string_to_metric_families

    models.write_slow(tmp_path / "repo" / "slow" / "1" / "model.onnx", width=256, depth=400)
    big = np.ones((4096, 256), np.float32)  # 4 MiB: seconds of work on this model
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": list(big.shape), "datatype": "FP32",
                     "parameters": {"binary_data_size": big.nbytes}}]}
    ).encode()  # fmt: skip
    body = header + big.tobytes()
    headers = {"Inference-Header-Content-Length": str(len(header))}

    async def pending(client: httpx.AsyncClient) -> float:
        text = (await client.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "trioinfer_inference_pending":
                    return sample.value
        return 0.0

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, tmp_path / "repo")
        one = httpx.Limits(max_connections=1)  # every request on the same connection
        async with httpx.AsyncClient(base_url=listening.urls[0], limits=one) as client:
            # As the serving tutorial does: a large request that times out, a few small
            # ones, then a large one whose client leaves, all on one connection.
            timeout = json.dumps({"parameters": {"timeout": 100_000}, **json.loads(header)})
            timed = timeout.encode() + big.tobytes()
            timed_out = await client.post(
                "/v2/models/slow/infer",
                content=timed,
                headers={"Inference-Header-Content-Length": str(len(timeout))},
            )
            for _ in range(3):
                await pending(client)
            with trio.move_on_after(0.5):  # the client gives up, and closes the connection
                await client.post("/v2/models/slow/infer", content=body, headers=headers)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as watcher:
            with trio.fail_after(10):  # the engine sees it at once; BIG alone takes longer
                while await pending(watcher):  # noqa: ASYNC110  # polling the server over HTTP
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert timed_out.status_code == 504


def test_layout_hint_names_a_model_directory_given_as_the_repository(
    onnx_file: Path, root: Path
) -> None:
    # `--model-repository models/digits` instead of `models`: say so, and name the parent.
    directory = make_model(onnx_file, root, "digits", (1, 2), "max_queue_size = 8\n")
    hint = ModelRepository(directory).layout_hint()
    assert hint is not None
    assert "looks like one model's directory (it holds config.toml, 1/, 2/)" in hint
    assert hint.endswith(f"; try {root.resolve()}")
    assert ModelRepository(root).layout_hint() is None
    # Version directories alone (no config.toml) are a model directory too.
    (directory / "config.toml").unlink()
    assert "(it holds 1/, 2/)" in (ModelRepository(directory).layout_hint() or "")
    # And so is a directory holding a model file itself.
    shutil.copyfile(onnx_file, root / "model.onnx")
    assert "(it holds model.onnx)" in (ModelRepository(root).layout_hint() or "")


def test_layout_hint_says_an_empty_repository_holds_no_model(root: Path) -> None:
    hint = ModelRepository(root).layout_hint()
    assert hint is not None
    assert hint.startswith(f"{root.resolve()} holds no model directory: ")
    assert "<repository>/<model>/<version>/model.onnx" in hint


def test_unknown_model_message_lists_only_models_with_served_versions() -> None:
    # Between an unload and the next load a model's entry has no versions: a request for it
    # is a 404, whose list of served models must not name it (it said "'m' is not served;
    # served models: 'm'").
    from trioinfer.server._models import ServedModels

    served = ServedModels.__new__(ServedModels)  # only the routing table, no engine
    served._served = {"m": {}, "other": {1: "v1"}}  # type: ignore[dict-item]
    served._errors = {}
    with pytest.raises(ModelNotFound) as caught:
        served.resolve("m")
    assert str(caught.value) == (
        "Request for unknown model: 'm' is not served; served models: 'other'"
    )


async def test_a_request_for_a_model_that_failed_to_load_says_why(root: Path) -> None:
    # Not only "'m' is not served": a newcomer whose config.toml has a typo asks for the
    # model, and the 404 carries the reason the server logged at start-up.
    from trioinfer.server._models import ServedModels

    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "config.toml").write_text("batcher_option = {}\n")
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(root))
        assert await served.load_all() == ["m"]
        with pytest.raises(ModelNotFound) as caught:
            served.resolve("m")
    message = str(caught.value)
    assert message.startswith(
        "Request for unknown model: 'm' is not served; served models: none; failed to load 'm': "
        "m/config.toml: unknown key 'batcher_option'"
    )
    assert message.endswith("did you mean 'batcher_options' for 'batcher_option'?")


async def test_a_model_that_never_finishes_loading_is_named_in_the_log(
    root: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A plugin backend whose load() never returned held `trioinfer serve`'s start for
    # ever, its port closed, with not a line in the log.
    from trioinfer.server._models import ServedModels

    class Hangs:
        async def load(self, config: Any, placement: Any) -> Any:
            await trio.sleep_forever()

    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.onnx").write_bytes(b"")
    (root / "m" / "config.toml").write_text('backend = "hangs"\n')
    registry = trioinfer.Registry(extra={"backends": {"hangs": Hangs}})
    async with trioinfer.open_engine(registry=registry) as engine:
        served = ServedModels(engine, ModelRepository(root))
        with trio.move_on_after(35):
            await served.load_all()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [message.split(";")[0] for message in said] == [
        "model 'm' is still loading after 10 s",
        "model 'm' is still loading after 30 s",
    ]


@pytest.mark.pipeline
async def test_a_step_model_with_a_broken_config_is_named_with_its_fault(root: Path) -> None:
    # Its config.toml has a typo: the pipeline's error said the step model "is not in the
    # repository", which sends its author looking for a misspelt step name.
    from trioinfer.server._models import ServedModels

    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "config.toml").write_text("batcher_option = {}\n")
    (root / "p").mkdir()
    (root / "p" / "config.toml").write_text(
        'backend = "pipeline"\n[backend_options]\n'
        "inputs = [{ name = 'x', dtype = 'float32', shape = [1] }]\n"
        "outputs = [{ name = 'y', dtype = 'float32', shape = [1] }]\n"
        "steps = [{ model = 'm', input_map = { x = 'x' }, output_map = { y = 'y' } }]\n"
    )
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(root))
        assert await served.load_all() == ["m", "p"]
        assert served.error("p").startswith(
            "failed to load 'p': step model 'm' of model 'p': m/config.toml: unknown key "
            "'batcher_option'"
        )


async def test_an_unloaded_model_is_not_said_to_have_failed_to_load(
    onnx_file: Path, root: Path
) -> None:
    # A reload with a bad override fails while the served version goes on serving; once
    # the model is unloaded on purpose, its 404 said "failed to load 'm': ..." still (the
    # reason of that earlier reload), as if the unload had been a failure.
    from trioinfer.server._models import ServedModels

    (root / "m" / "1").mkdir(parents=True)
    shutil.copyfile(onnx_file, root / "m" / "1" / "model.onnx")
    async with trioinfer.open_engine() as engine:
        served = ServedModels(engine, ModelRepository(root))
        assert await served.load_all() == []
        with pytest.raises(ConfigError):
            await served.load("m", {"max_queue_size": -1})
        served.resolve("m")  # still served
        await served.unload("m")
        with pytest.raises(ModelNotFound) as caught:
            served.resolve("m")
        assert served.error("m") == ""
    assert str(caught.value) == (
        "Request for unknown model: 'm' is not served; served models: none"
    )


async def test_a_version_the_policy_drops_leaves_metrics_as_an_unload_does(
    onnx_file: Path, root: Path
) -> None:
    """Version 2 appears under ``latest = 1``: version 1's engine series and stats end.

    As at an unload: its requests by outcome stay (one server counts them for its
    whole life), the rest goes; /metrics shows no counter going down.
    """
    from prometheus_client.parser import text_string_to_metric_families

    make_model(onnx_file, root, "m", (1,), "version_policy = { latest = 1 }\n")
    body = {
        "inputs": [
            {"name": name, "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
            for name in ("a", "b")
        ]
    }

    def series(text: str) -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels.get("version", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels.get("model") == "m" and "outcome" not in sample.labels
        }

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, root)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            for _ in range(3):
                assert (await client.post("/v2/models/m/infer", json=body)).status_code == 200
            before = (await client.get("/metrics")).text
            assert ("trioinfer_inference_batch_rows_sum", "1") in series(before)
            shutil.copytree(root / "m" / "1", root / "m" / "2")
            assert (await client.post("/v2/repository/models/m/load")).status_code == 200
            after = (await client.get("/metrics")).text
            stats = (await client.get("/v2/models/m/stats")).json()["model_stats"]
        nursery.cancel_scope.cancel()
    assert [entry["version"] for entry in stats] == ["2"]
    assert {v for (_, v) in series(after)} <= {"2", ""}
    requests = {
        sample.labels["version"]: sample.value
        for family in text_string_to_metric_families(after)
        for sample in family.samples
        if sample.name == "trioinfer_inference_requests_total" and sample.labels["model"] == "m"
    }
    assert requests == {"1": 3}


@pytest.mark.python_model
async def test_a_model_its_backend_cannot_load_is_a_400_naming_why(root: Path) -> None:
    # A model.py that raises at import, or a model.onnx that is no ONNX file, failed its
    # load with a BackendError: POST .../load answered 500, as for a bug of the server's,
    # where Triton (and every other refused load here) answers 400 with the reason.
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.py").write_text("raise RuntimeError('no weights')\n")
    (root / "broken" / "config.toml").write_text(
        'backend = "python"\n[backend_options]\n'
        "inputs = [{ name = 'x', dtype = 'float32', shape = [1] }]\n"
        "outputs = [{ name = 'y', dtype = 'float32', shape = [1] }]\n"
    )
    (root / "garbled" / "1").mkdir(parents=True)
    (root / "garbled" / "1" / "model.onnx").write_bytes(b"not an ONNX file")
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, root)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            broken = await client.post("/v2/repository/models/broken/load")
            garbled = await client.post("/v2/repository/models/garbled/load")
        nursery.cancel_scope.cancel()
    assert (broken.status_code, garbled.status_code) == (400, 400)
    assert broken.json()["error"] == (
        "failed to load 'broken': model 'broken' (version 1): importing model.py raised "
        "RuntimeError: no weights (model.py, line 1, in <module>)"
    )
    assert garbled.json()["error"].startswith(
        "failed to load 'garbled': model 'garbled' (version 1): ONNX Runtime could not load "
        "garbled/1/model.onnx: "
    )
