"""The model repository the server serves: ``<root>/<model>/[config.toml]`` and ``<N>/model.onnx``.

The layout follows Triton's: one directory per model, named as requests name the
model, holding an optional ``config.toml`` and one numbered directory per
version. A ``version_policy`` key in ``config.toml`` says which versions are
served, as Triton's ``version_policy`` does; every other key is a
[`ModelConfig`][trioinfer.ModelConfig] field. A model without ``config.toml``
gets the defaults, and the engine reads its signature from the ONNX file, which
is how Triton auto-completes ONNX configurations.

Everything here is read with file listings, ``stat`` and a TOML parser: nothing
from the repository is imported, unpickled or executed, and every path is
resolved and refused with a [`ConfigError`][trioinfer.ConfigError] if it leads
outside the repository (through ``..`` or a symbolic link). Reading is blocking
file I/O, so async code calls these methods from a worker thread.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Literal, TypeGuard

import attrs

from .._config import (
    _MAX_VERSION,
    _NAME_RE,
    MODEL_FILES,
    PIPELINE,
    ModelConfig,
    _is_version_name,
    model_file_hint,
    model_file_name,
    parse_toml,
    unknown_keys_error,
)
from .._exceptions import ConfigError, ModelNotFound
from ._triton import OWN_PREFIX, TRITON_FIELDS, TritonModel, with_declared_shapes

#: What completes a ``config.pbtxt`` model's configuration from its code: called with the
#: backend's name, the configuration (Triton's JSON, every field printed) and the version's
#: model file; returns the completed configuration, or None to keep it. The server's calls
#: the backend's ``complete_triton_config`` (`trioinfer.abc.ConfigCompletingBackend`).
Completer = Callable[[str, Mapping[str, Any], Path], Mapping[str, Any] | None]

__all__ = ["IndexEntry", "ModelEntry", "ModelRepository", "VersionPolicy"]

log = logging.getLogger("trioinfer.server")

_PolicyKind = Literal["latest", "all", "specific"]

_CONFIG_FILE = "config.toml"
_TRITON_FILE = "config.pbtxt"
# Triton's keys a config.toml model's load override may use too (max_batch_size, ...):
# those that are not also ModelConfig fields.
_TRITON_ONLY = TRITON_FIELDS - {f.name for f in attrs.fields(ModelConfig)}
# A label file holds one label per line; a bound keeps a stray huge file from being read.
_MAX_LABELS_BYTES = 16 << 20

# A config.toml is a few lines; a bound keeps a stray huge file from being read whole.
_MAX_CONFIG_BYTES = 1 << 20
# Server-only keys of config.toml: the server reads them, ModelConfig never sees them.
_SERVER_KEYS = frozenset({"version_policy", "traffic", "labels"})


def _in_tritons_form(key: str, value: object) -> bool:
    # Whether a config.toml model's override key is Triton's: one ModelConfig lacks, or
    # response_cache as Triton writes it ({"enable": true}, what GET .../config answers).
    return key in _TRITON_ONLY or (key == "response_cache" and isinstance(value, Mapping))


_POLICY_FORMS = (
    '"latest", "all", { latest = N }, { specific = [1, 3] } or { all = {} } '
    "(Triton's { latest = { num_versions = N } } and { specific = { versions = [...] } } "
    "are read too)"
)
_NAME_RULE = (
    "1-128 characters of letters, digits, '_', '.', '-', starting with a letter or digit, "
    "and without '..'"
)
_LISTED_NAMES = 20


def _shown(value: object) -> str:
    """``repr`` of a value from a request or a file, cut short so messages stay readable."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_version_number(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_VERSION:
        raise ConfigError(
            f"{where}: a version is an integer from 1 to 2**63-1, got {_shown(value)}"
        )
    return value


def _to_versions(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"version_policy: versions must be a list of integers, got {_shown(value)}"
        )
    return tuple(sorted({_check_version_number(v, "version_policy") for v in value}))


def _check_kind(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("latest", "all", "specific"):
        raise ConfigError(
            f"version_policy kind must be 'latest', 'all' or 'specific', got {_shown(value)}"
        )


def _check_count(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"version_policy: latest needs a positive number of versions, got {_shown(value)}"
        )


@attrs.frozen
class VersionPolicy:
    """Which of a model's versions on disk are served, as Triton's ``version_policy``.

    In ``config.toml`` it is written ``version_policy = "latest"`` (the default:
    the highest version), ``{ latest = 2 }`` (the two highest), ``"all"`` or
    ``{ all = {} }``, or ``{ specific = [1, 3] }``; see
    [`parse()`][trioinfer.server.VersionPolicy.parse].

    Attributes:
        kind: ``"latest"``, ``"all"`` or ``"specific"``.
        count: For ``"latest"``, how many of the highest versions to serve
            (all of them when fewer are on disk, as in Triton).
        versions: For ``"specific"``, the versions to serve, ascending.
    """

    kind: _PolicyKind = attrs.field(default="latest", validator=_check_kind)
    count: int = attrs.field(default=1, validator=_check_count)
    versions: tuple[int, ...] = attrs.field(default=(), converter=_to_versions)

    @versions.validator
    def _check_versions(self, _attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
        if self.kind == "specific" and not value:
            raise ConfigError("version_policy: specific needs at least one version, e.g. [1, 3]")
        if self.kind != "specific" and value:
            raise ConfigError(
                f"version_policy: versions are only for 'specific', not for {self.kind!r}"
            )
        if self.kind != "latest" and self.count != 1:
            raise ConfigError(f"version_policy: a count is only for 'latest', not {self.kind!r}")

    def select(self, available: Sequence[int]) -> tuple[int, ...]:
        """Return the versions of *available* this policy serves, ascending.

        A ``specific`` policy returns only the versions it names that are in
        *available*; ``ModelEntry.selected()`` is what refuses a policy that
        names a missing version.
        """
        ordered = sorted(set(available))
        if self.kind == "all":
            return tuple(ordered)
        if self.kind == "latest":
            return tuple(ordered[-self.count :])
        return tuple(v for v in ordered if v in self.versions)

    @classmethod
    def parse(cls, value: object) -> VersionPolicy:
        """Read the ``version_policy`` value of a ``config.toml``.

        Accepts ``"latest"``, ``"all"``, ``{ latest = N }``, ``{ specific = [1, 3] }``
        and ``{ all = {} }``, and, for those coming from Triton's ``config.pbtxt``,
        ``{ latest = { num_versions = N } }`` and ``{ specific = { versions = [1, 3] } }``.

        Raises:
            ConfigError: For any other value, listing the accepted forms.
        """
        if value == "latest":
            return cls("latest")
        if value == "all":
            return cls("all")
        if isinstance(value, str):
            raise ConfigError(f"version_policy must be {_POLICY_FORMS}; got {_shown(value)}")
        if not isinstance(value, Mapping) or len(value) != 1:
            raise ConfigError(f"version_policy must be {_POLICY_FORMS}; got {_shown(value)}")
        ((kind, arg),) = value.items()
        if kind == "all":
            if isinstance(arg, Mapping) and not arg:
                return cls("all")
            raise ConfigError(f"version_policy: write {{ all = {{}} }}, got {_shown(value)}")
        if kind == "latest":
            if isinstance(arg, Mapping):
                arg = _only_key(arg, "num_versions", "latest", default=1)
            if not isinstance(arg, int) or isinstance(arg, bool) or arg < 1:
                raise ConfigError(
                    f"version_policy: latest needs a positive number of versions, as in "
                    f"{{ latest = 2 }}; got {_shown(value)}"
                )
            return cls("latest", count=arg)
        if kind == "specific":
            if isinstance(arg, Mapping):
                arg = _only_key(arg, "versions", "specific", default=None)
            return cls("specific", versions=arg)
        raise ConfigError(f"version_policy must be {_POLICY_FORMS}; got {_shown(value)}")

    def __str__(self) -> str:
        # Written as config.toml spells it, so a message shows what to edit.
        if self.kind == "all":
            return '"all"'
        if self.kind == "latest":
            return '"latest"' if self.count == 1 else f"{{ latest = {self.count} }}"
        return f"{{ specific = [{', '.join(map(str, self.versions))}] }}"


def _only_key(table: Mapping[str, Any], key: str, kind: str, *, default: object) -> object:
    unknown = sorted(set(table) - {key})
    if unknown:
        raise ConfigError(
            f"version_policy: {kind} takes only {key!r}, got {', '.join(map(_shown, unknown))}"
        )
    return table.get(key, default)


@attrs.frozen
class IndexEntry:
    """One row of the repository index: a model, or one version of it.

    The server adds the state (``READY``, ``UNAVAILABLE``, ...), since only it
    knows what is loaded.

    Attributes:
        name: The model's name.
        version: A version on disk, or ``None`` for a model that has no usable
            version or whose configuration is broken.
        reason: Why it cannot be served as it stands (a broken ``config.toml``,
            a version the policy leaves out), or ``""``.
    """

    name: str
    version: int | None
    reason: str = ""


def _frozen_table(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(value))


@attrs.frozen
class ModelEntry:
    """What one model directory holds, as ``ModelRepository.entry()`` read it.

    It is a snapshot: call ``entry()`` again to see later changes on disk, and use
    ``fingerprint()`` to tell whether a version has changed since.

    Attributes:
        name: The model's name, which is its directory's name.
        directory: ``<root>/<name>``.
        versions: The version directories that hold ``model.onnx``, ascending
            (just ``(1,)`` when ``config.toml`` sets ``path``).
        policy: Which of *versions* are served.
        settings: The ``config.toml`` table without the server's own keys
            (``version_policy``): [`ModelConfig`][trioinfer.ModelConfig] fields,
            already checked. Empty without ``config.toml``.
        notes: What was ignored, e.g. a ``config.pbtxt`` beside a ``config.toml``
            or a version directory without ``model.onnx``; logged, never an error.
        traffic: Each served version's share of requests (``traffic`` in ``config.toml``).
        triton: The Triton configuration, for a model configured by
            ``config.pbtxt`` (then *settings* are what it maps to), else ``None``.
        label_files: Output name to its labels file, for the classification
            extension: ``labels`` in ``config.toml``, or the outputs'
            ``label_filename`` in ``config.pbtxt``.
        from_override: Whether the load override configures it whole (an
            ensemble in a directory with no config file): its "model file" is
            the directory.
        source: Where its config was read, as errors name it
            (``digits/config.toml``); None where there is no config file.
    """

    name: str
    directory: Path
    versions: tuple[int, ...]
    policy: VersionPolicy = attrs.field(factory=VersionPolicy)
    settings: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_table)
    notes: tuple[str, ...] = ()
    traffic: Mapping[int, float] = attrs.field(factory=dict)
    triton: TritonModel | None = None
    label_files: Mapping[str, str] = attrs.field(factory=dict)
    from_override: bool = False
    source: str | None = None

    def config_source(self, override: Mapping[str, Any] | None = None) -> str | None:
        """Where a load's config came from, for its errors: the file, and the override.

        A plugin that refuses its options says only what it refuses: without this the
        operator of a large repository looked for the file that gave them.
        """
        if override is None or self.from_override:
            return self.source
        if self.source is None:
            return f"model {self.name!r}: the config override"
        return f"{self.source} with the config override"

    @property
    def model_file(self) -> str:
        """The file each version directory holds: ``model.onnx``, or ``model.py`` for Python.

        A ``config.pbtxt``'s ``default_model_filename`` names another.
        """
        if self.triton is not None and self.triton.model_filename is not None:
            return self.triton.model_filename
        return model_file_name(self.settings.get("backend", "onnxruntime"))

    def selected(self) -> tuple[int, ...]:
        """Return the versions the policy serves, ascending.

        Raises:
            ConfigError: If there is no version on disk, or a ``specific`` policy
                names a version that is not on disk.
        """
        if not self.versions:
            if "path" in self.settings:
                raise ConfigError(
                    f"model {self.name!r}: {_CONFIG_FILE} sets path = "
                    f"{_shown(self.settings['path'])}, but there is no such file"
                )
            # What was there instead, and why it was not read: a model.py without
            # backend = "python", a version directory named v1.
            ignored = "".join(f"; {note}" for note in self.notes)
            raise ConfigError(
                f"model {self.name!r} has no version to serve: "
                f"expected {self.name}/<N>/{self.model_file} with N a positive integer"
                f"{model_file_hint(self.settings.get('backend', 'onnxruntime'))}{ignored}"
                f"{self._override_only_hint()}"
            )
        missing = [v for v in self.policy.versions if v not in self.versions]
        if missing:
            raise ConfigError(
                f"model {self.name!r}: version_policy = {self.policy} names "
                f"{_versions_text(missing)}, not on disk; versions on disk: "
                f"{', '.join(map(str, self.versions))}"
            )
        return self.policy.select(self.versions)

    def _override_only_hint(self) -> str:
        # No config file and an empty version directory: Triton's layout for an ensemble
        # loaded with its config in the request, which the server forgets at a restart.
        if _has_config_file(self.directory):
            return ""
        try:
            empty = any(
                child.name.isdigit() and _is_dir(child) and not any(child.iterdir())
                for child in self.directory.iterdir()
            )
        except OSError:
            return ""
        if not empty:
            return ""
        return (
            "; a directory holding only an empty version directory is served with the "
            "config a load request carries (parameters.config, as Triton loads an "
            "ensemble), which the server keeps until it stops, not across a restart: load "
            "it with its config again, or write it as config.toml"
        )

    def config(
        self,
        version: int,
        override: Mapping[str, Any] | None = None,
        *,
        complete: Completer | None = None,
        auto_complete: bool = True,
    ) -> ModelConfig:
        """Return the [`ModelConfig`][trioinfer.ModelConfig] to load *version* with.

        Args:
            version: A version on disk (one of *versions*).
            override: Keys that replace those of ``config.toml`` for this load
                (each top-level key replaces the file's key whole, tables
                included), checked as ``config.toml`` keys are. ``name``, ``path``
                and ``version_policy`` come from the repository and cannot be
                overridden.
            complete: For a ``config.pbtxt`` model: what completes its
                configuration from the model's own code (Triton's
                ``auto_complete_config``; see `Completer`), run after the
                override. It blocks (it may import the model's code).
            auto_complete: False as Triton's ``--disable-auto-complete-config``:
                a ``config.pbtxt`` model's configuration is the file's alone.
                *complete* is not called, and the file must declare the
                model's input and output (an ONNX model's are not read from
                its graph either).

        Raises:
            ConfigError: For a version not on disk, a model file that has gone
                or now leads outside the repository, or an override that is not
                a table of valid [`ModelConfig`][trioinfer.ModelConfig] fields.
        """
        return self.config_and_triton(
            version, override, complete=complete, auto_complete=auto_complete
        )[0]

    def config_and_triton(
        self,
        version: int,
        override: Mapping[str, Any] | None = None,
        *,
        complete: Completer | None = None,
        auto_complete: bool = True,
    ) -> tuple[ModelConfig, TritonModel | None]:
        """`config()` and `triton_config()` of one load, *override* merged once for both.

        Raises:
            ConfigError: As `config()`.
        """
        data = dict(self.settings)
        triton = self.triton
        if override is not None:
            if not isinstance(override, Mapping) or not all(isinstance(k, str) for k in override):
                raise ConfigError(
                    f"model {self.name!r}: a config override must be a table of "
                    f"field = value, got {_shown(override)}"
                )
            # What GET .../config answers may come back whole (Triton's clients fetch the
            # config, change a field and load with it): the name and version policy it
            # holds are accepted when they are the repository's own, as they then are.
            fixed = sorted(
                key
                for key in {"name", "path", *_SERVER_KEYS} & set(override)
                if not self._unchanged(key, override[key])
            )
            if fixed:
                source = _TRITON_FILE if self.triton is not None else _CONFIG_FILE
                raise ConfigError(
                    f"model {self.name!r}: a config override may not set "
                    f"{', '.join(map(repr, fixed))} other than the repository's own; it "
                    "decides the name (the "
                    f"directory's, {self.name!r}), the file (<N>/{self.model_file}) and the "
                    f"versions ({source}'s version_policy, {self.policy})"
                )
            chosen = override.get("default_model_filename", "")
            if chosen not in ("", self.model_file):
                raise ConfigError(
                    f"model {self.name!r}: a config override may not change "
                    f"default_model_filename (to {_shown(chosen)}); the repository decides "
                    f"the file (<N>/{self.model_file})"
                )
            data, triton = self._overridden(data, override)
        if triton is not None and self.triton is not None:
            completed = self._completed(triton, version, complete if auto_complete else None)
            completed.check_complete(self._where_triton(), auto_complete=auto_complete)
            if completed is not triton:
                triton = completed
                data = dict(triton.settings)
        if triton is not None:
            # Which of the two says a tensor's shapes later: a load override's dims
            # replace config.toml's backend_options inputs/outputs, and its options
            # (a config.pbtxt's parameters) replace the file's dims.
            given = override if isinstance(override, Mapping) else {}
            options_key = "backend_options" if self.triton is None else "parameters"
            data = with_declared_shapes(
                data,
                triton,
                where=f"model {self.name!r}",
                dims_overridden=[k + "s" for k in ("input", "output") if k in given],
                options_overridden=options_key in given,
            )
        data["name"] = self.name
        data["path"] = self._model_file(version)
        try:
            # base: a warm-up sample's file is read from <model>/warmup/, as in Triton.
            return ModelConfig.from_dict(data, base=self.directory), triton
        except ConfigError as exc:
            raise ConfigError(f"model {self.name!r} version {version}: {exc}") from None

    def _unchanged(self, key: str, value: object) -> bool:
        # Whether an override's *key* repeats what the repository says already.
        if key == "name":
            return value == self.name
        if key == "version_policy":
            try:
                return VersionPolicy.parse(value) == self.policy
            except ConfigError:
                pass
            try:  # Triton's JSON form, 64-bit versions as strings included
                triton = TritonModel.parse({key: value}, name=self.name, where=key)
                return VersionPolicy.parse(triton.version_policy) == self.policy
            except ConfigError:
                return False
        return False

    def triton_config(self, override: Mapping[str, Any] | None = None) -> TritonModel | None:
        """The Triton configuration *version* is loaded with, after *override*; ``None`` if none.

        A ``config.toml`` model has one only when the override uses Triton's
        keys (``{"max_batch_size": 16}``): then it holds just those.

        Raises:
            ConfigError: The override is not a valid Triton configuration.
        """
        if override is None or not isinstance(override, Mapping):
            return self.triton
        where = f"model {self.name!r}: the config override"
        if self.triton is not None:
            return self.triton.merged(override, name=self.name, where=where)
        chosen = {k: v for k, v in override.items() if _in_tritons_form(k, v)}
        return TritonModel.parse(chosen, name=self.name, where=where) if chosen else None

    def _completed(
        self, triton: TritonModel, version: int, complete: Completer | None
    ) -> TritonModel:
        # A config.pbtxt model's configuration as its code completes it (Triton's
        # auto_complete_config).
        where = self._where_triton()
        backend = str(triton.settings.get("backend", ""))
        if complete is not None and backend and backend != PIPELINE:
            doc = complete(backend, triton.json_with_defaults(self.name), self._model_file(version))
            if doc is not None:
                if not isinstance(doc, Mapping):
                    raise ConfigError(
                        f"{where}: the {backend!r} backend completed it into "
                        f"{type(doc).__name__}, not a configuration"
                    )
                triton = TritonModel.parse(
                    doc, name=self.name, where=f"{where}, as the model's code completed it"
                )
        return triton

    def _where_triton(self) -> str:
        return f"{_TRITON_FILE} of model {self.name!r}"

    def _overridden(
        self, data: dict[str, Any], override: Mapping[str, Any]
    ) -> tuple[dict[str, Any], TritonModel | None]:
        # A config.pbtxt model's override holds config.pbtxt fields as JSON, which replace
        # the file's fields whole; a config.toml model's holds ModelConfig keys, and may
        # hold Triton's keys too (what Triton's clients send), read as Triton reads them.
        # Also returns the Triton configuration after the override (triton_config()).
        if self.triton is not None:
            unknown = sorted(set(override) - TRITON_FIELDS)
            if unknown:
                raise ConfigError(
                    f"model {self.name!r} is configured by {_TRITON_FILE}: a config override "
                    f'holds its fields as JSON, e.g. {{"max_batch_size": 16}}; unknown key '
                    f"{', '.join(map(repr, unknown))}; known keys are "
                    f"{', '.join(sorted(TRITON_FIELDS))}"
                    + (
                        " ('version' and 'trioinfer' are not Triton's: GET .../config "
                        f"answers trioinfer's own settings as parameters {OWN_PREFIX}*; "
                        "leave them out of an override)"
                        if {"version", "trioinfer"} & set(unknown)
                        else ""
                    )
                )
        triton = self.triton_config(override)
        if triton is None:
            return {**data, **override}, None
        if self.triton is not None:
            data = dict(triton.settings)
            if data.get("backend") == PIPELINE:
                data["path"] = _TRITON_FILE
            return data, triton
        # Triton's empty backend is "none given" (an ensemble's, say), not a plugin's name.
        rest = {
            k: v
            for k, v in override.items()
            if not _in_tritons_form(k, v) and not (k == "backend" and v == "")
        }
        return {**data, **triton.settings, **rest}, triton

    def labels(self, triton: TritonModel | None) -> dict[str, tuple[str, ...]]:
        """Each output's class labels, read from its ``label_filename`` (one label a line).

        Raises:
            ConfigError: A label file that is missing, unreadable, too large, or
                outside the model's directory.
        """
        out: dict[str, tuple[str, ...]] = {}
        files = {**self.label_files, **(triton.labels if triton is not None else {})}
        for output, file in files.items():
            where = f"model {self.name!r}: output {output!r} labels file {_shown(file)}"
            path = self.directory / file
            _check_path_key(file, self.directory, self._root, where, key="", example="labels.txt")
            try:
                with path.open("rb") as f:
                    raw = f.read(_MAX_LABELS_BYTES + 1)
            except OSError as exc:
                raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
            if len(raw) > _MAX_LABELS_BYTES:
                raise ConfigError(f"{where}: it is larger than {_MAX_LABELS_BYTES} bytes")
            out[output] = tuple(raw.decode("utf-8", "replace").splitlines())
        return out

    def fingerprint(self, version: int) -> tuple[int, ...]:
        """Return a cheap token that changes when *version* changes on disk.

        It is made of ``stat`` results (modification time in nanoseconds, size and
        inode) of the version's model file and of ``config.toml`` when there is
        one, so it notices a file rewritten in place or replaced by a rename.
        Compare two tokens for equality only.

        Raises:
            ConfigError: If the version is not on disk or its model file has gone.
        """
        parts: list[int] = []
        configs = (self.directory / _CONFIG_FILE, self.directory / _TRITON_FILE)
        for path in (self._model_file(version), *configs):
            try:
                st = path.stat()
            except FileNotFoundError:
                if path in configs:
                    parts += (0, -1, 0)  # a config.toml appearing later changes the token
                    continue
                raise ConfigError(  # pragma: no cover - _model_file checked it a moment ago
                    f"model {self.name!r} version {version}: {self.model_file} has gone"
                ) from None
            except OSError as exc:
                raise ConfigError(
                    f"model {self.name!r}: cannot stat {_relative(path, self._root)}: "
                    f"{exc.strerror or exc}"
                ) from None
            parts += (st.st_mtime_ns, st.st_size, st.st_ino)
        return tuple(parts)

    @property
    def _root(self) -> Path:
        # entry() builds directory as <resolved root>/<name>, so its parent is the root.
        return self.directory.parent

    def _model_file(self, version: int) -> Path:
        """The model file of a version on disk, checked again (files change after entry())."""
        if (
            not isinstance(version, int)
            or isinstance(version, bool)
            or version not in self.versions
        ):
            on_disk = ", ".join(map(str, self.versions)) or "none"
            raise ConfigError(
                f"model {self.name!r} has no version {_shown(version)}; versions on disk: {on_disk}"
            )
        if self.from_override:
            return self.directory  # an ensemble is its config (the override): no file
        if "path" in self.settings:
            path = self.directory / str(self.settings["path"])
        else:
            path = self.directory / str(version) / self.model_file
        _confine(path, self._root, f"model {self.name!r} version {version}")
        if not _is_file(path):
            raise ConfigError(
                f"model {self.name!r} version {version}: {_relative(path, self._root)} "
                "is gone or is not a file"
            )
        return path


def _versions_text(versions: Sequence[int]) -> str:
    if len(versions) == 1:
        return f"version {versions[0]}"
    return f"versions {', '.join(map(str, versions))}"


def _relative(path: Path, root: Path) -> str:
    """*path* relative to the repository: messages reach HTTP clients, who need no host paths."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:  # pragma: no cover - every path named is built under root
        return path.name


def _confine(path: Path, root: Path, what: str) -> Path:
    """Resolve *path* and refuse it if it leads outside *root* (which is resolved).

    Raises:
        ConfigError: If the path escapes, loops, or cannot be resolved.
    """
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        # Not str(exc): it holds absolute paths, and this message may reach a client.
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a symbolic link loop"
        raise ConfigError(f"{what}: cannot resolve {_relative(path, root)}: {why}") from None
    if not resolved.is_relative_to(root):
        raise ConfigError(
            f"{what}: {_relative(path, root)} leads outside the model repository (through a "
            "symbolic link or '..'); only files inside the repository are served"
        )
    return resolved


def _valid_name(name: str) -> bool:
    # fullmatch, not match: _NAME_RE ends in '$', which also matches before a final newline.
    return _NAME_RE.fullmatch(name) is not None and ".." not in name


def _check_model_name(name: object) -> str:
    if not isinstance(name, str) or not _valid_name(name):
        raise ConfigError(f"model name {_shown(name)} is not valid: it must be {_NAME_RULE}")
    return name


def _to_root(value: str | os.PathLike[str]) -> Path:
    # Checked when the repository is made, so that a mistyped --model-repository
    # fails at startup rather than at the first request.
    path = Path(value)
    try:
        root = path.resolve(strict=True)
    except FileNotFoundError:
        raise ConfigError(f"model repository {path} does not exist") from None
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"model repository {path} cannot be opened: {exc}") from None
    if not root.is_dir():
        raise ConfigError(
            f"model repository {path} is not a directory; expected a directory of "
            "<model>/<version>/model.onnx"
        )
    return root


# These answer False for a path that cannot be examined (no permission, say):
# such a path is skipped or reported as missing rather than crashing a listing.
def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


def _lexists(path: Path) -> bool:
    """Whether *path* exists, counting a dangling symbolic link (which must not be missed)."""
    try:
        path.lstat()
    except OSError:
        return False
    return True


def _has_config_file(directory: Path) -> bool:
    # A config.toml or a config.pbtxt, a dangling link counted (a file meant to be there).
    return _lexists(directory / _CONFIG_FILE) or _lexists(directory / _TRITON_FILE)


def _read_bytes(path: Path, shown: str) -> bytes:
    if not _is_file(path):
        raise ConfigError(f"{shown} is not a regular file")
    try:
        with path.open("rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {shown}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{shown} is larger than {_MAX_CONFIG_BYTES} bytes; is it a config?")
    return raw


def _read_text(path: Path, shown: str) -> str:
    try:
        return _read_bytes(path, shown).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{shown} is not valid protobuf text: it is not UTF-8 ({exc.reason})"
        ) from None


def _read_toml(path: Path, shown: str) -> dict[str, Any]:
    return parse_toml(_read_bytes(path, shown), shown)


@attrs.define(eq=False)
class ModelRepository:
    """A directory of models laid out as ``<root>/<model>/<version>/model.onnx``.

    Each model directory may hold a ``config.toml`` with
    [`ModelConfig`][trioinfer.ModelConfig] fields and a ``version_policy``.
    Nothing is cached: each call reads the disk again, so models added, changed
    or removed while the server runs are seen at the next call. The methods do
    blocking file I/O.

    Attributes:
        root: The repository directory, resolved.

    Raises:
        ConfigError: If *root* does not exist or is not a directory.
    """

    root: Path = attrs.field(converter=_to_root)
    # What has been logged already, so that a server polling the index does not
    # repeat the same notes at every poll.
    _logged: set[str] = attrs.field(factory=set, init=False, repr=False)

    def names(self) -> list[str]:
        """Return the names of the model directories, sorted.

        Hidden entries (names starting with ``.``) are skipped silently; files and
        directories whose names are not valid model names are skipped with a note
        in the log, once.

        Raises:
            ConfigError: If the repository directory cannot be listed.
        """
        try:
            children = sorted(self.root.iterdir())
        except OSError as exc:
            raise ConfigError(
                f"cannot list the model repository {self.root}: {exc.strerror or exc}"
            ) from None
        names: list[str] = []
        for child in children:
            name = child.name
            if name.startswith("."):
                continue
            if not _is_dir(child):
                self._log_once(
                    f"{self.root}: ignored {name} (not a directory; a model is a directory "
                    "<model>/<version>/model.onnx)"
                )
            elif not _valid_name(name):
                self._log_once(f"{self.root}: ignored {name}/ (a model name must be {_NAME_RULE})")
            else:
                names.append(name)
        return names

    def layout_hint(self) -> str | None:
        """Why the root may not be the model repository meant, or None when it looks like one.

        The first mistake with ``--model-repository``: naming one model's
        directory (it holds ``config.toml`` and version directories) rather
        than the directory of models above it; or a directory with no model.

        Raises:
            ConfigError: If the repository directory cannot be listed.
        """
        names = self.names()
        model_files = {_CONFIG_FILE, _TRITON_FILE, "model.onnx", "model.py"}
        here = sorted(
            child.name
            for child in self.root.iterdir()
            if child.name in model_files and _is_file(child)
        )
        if here or (names and all(name.isdigit() for name in names)):
            shown = ", ".join([*here, *(f"{name}/" for name in names if name.isdigit())])
            return (
                f"{self.root} looks like one model's directory (it holds {shown}), not a "
                "model repository: a repository holds one directory per model, "
                f"<repository>/<model>/<version>/model.onnx; try {self.root.parent}"
            )
        if not names:
            return (
                f"{self.root} holds no model directory: a model repository is laid out "
                "<repository>/<model>/<version>/model.onnx, with an optional "
                "<repository>/<model>/config.toml"
            )
        return None

    def entry(self, name: str, override: Mapping[str, Any] | None = None) -> ModelEntry:
        """Read one model's directory: its versions, policy and settings.

        A ``config.pbtxt`` is read with the fields of a load *override* of
        Triton's keys in place of its own (as Triton loads an override instead
        of the file), so that an override can replace a field the file gets
        wrong. Other overrides are applied by ``ModelEntry.config()``.

        Raises:
            ConfigError: If *name* is not a valid model name, the directory or a
                file in it leads outside the repository, or ``config.toml`` is not
                valid TOML or not a valid configuration.
            ModelNotFound: If there is no such model directory; the message lists
                the models there are.
        """
        _check_model_name(name)
        directory = self.root / name
        if not _is_dir(directory):
            raise ModelNotFound(f"no model {name!r} in the model repository; {self._listing()}")
        _confine(directory, self.root, f"model {name!r}")
        entry = _scan(name, directory, self.root, override)
        for note in entry.notes:
            self._log_once(f"model {name!r}: {note}")
        return entry

    def has_config_file(self, name: str) -> bool:
        """Whether model *name*'s directory holds a ``config.toml`` or a ``config.pbtxt``."""
        return _has_config_file(self.root / name)

    def index(self) -> list[IndexEntry]:
        """List every model, and every version of it on disk, for the repository index.

        A model that cannot be served as it stands is still listed, with the
        reason: one row with ``version=None`` when its directory or
        ``config.toml`` is broken or it has no version, and rows with a reason
        for versions its policy leaves out or when the policy names a version
        that is not on disk.

        Raises:
            ConfigError: If the repository directory cannot be listed.
        """
        rows: list[IndexEntry] = []
        for name in self.names():
            try:
                entry = self.entry(name)
            except ModelNotFound:
                continue  # removed between the listing and the read
            except ConfigError as exc:
                rows.append(IndexEntry(name, None, str(exc)))
                continue
            try:
                served = entry.selected()
                problem = ""
            except ConfigError as exc:
                if not entry.versions:
                    rows.append(IndexEntry(name, None, str(exc)))
                    continue
                served, problem = (), str(exc)
            for version in entry.versions:
                reason = problem
                if not reason and version not in served:
                    reason = (
                        f"not served: version_policy = {entry.policy} serves "
                        f"{_versions_text(served)}"
                    )
                rows.append(IndexEntry(name, version, reason))
        return rows

    def _listing(self) -> str:
        try:
            names = self.names()
        except ConfigError as exc:
            return str(exc)
        if not names:
            return "the repository holds no models"
        shown = ", ".join(names[:_LISTED_NAMES])
        more = len(names) - _LISTED_NAMES
        return f"models there: {shown}" + (f" and {more} more" if more > 0 else "")

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.info("%s", message)


def _other_backend_file(version_dir: Path, file_name: str) -> str:
    """What to add when *version_dir* lacks *file_name* but holds another backend's model file.

    A ``model.py`` without ``backend = "python"`` in ``config.toml`` (or a
    ``model.onnx`` under it) is the first model a newcomer writes: name the fix.
    """
    for backend, other in (("onnxruntime", "model.onnx"), *MODEL_FILES.items()):
        if other != file_name and _lexists(version_dir / other):
            default = " (the default)" if backend == "onnxruntime" else ""
            return (
                f', but a {other}, which is served with backend = "{backend}"{default} '
                f"in {_CONFIG_FILE}"
            )
    return ""


def _scan(
    name: str, directory: Path, root: Path, override: Mapping[str, Any] | None = None
) -> ModelEntry:
    """Read a model directory that is known to be inside *root*."""
    where = f"model {name!r}"
    notes: list[str] = []
    settings: dict[str, Any] = {}
    policy = VersionPolicy()
    traffic: dict[int, float] = {}
    triton: TritonModel | None = None
    label_files: dict[str, str] = {}
    from_override = False
    config_path = directory / _CONFIG_FILE
    triton_path = directory / _TRITON_FILE
    shown = _relative(config_path, root)
    source: str | None = None
    if _lexists(config_path):
        source = shown
        _confine(config_path, root, where)
        settings = _read_toml(config_path, shown)
        if settings.get("backend") == PIPELINE:
            # A pipeline has no model file or version directories: its config
            # is the whole of it, served as version 1.
            settings.setdefault("path", _CONFIG_FILE)
        policy = _policy_from(settings, shown)
        try:
            traffic = parse_traffic(settings.pop("traffic", {}))
        except ConfigError as exc:
            raise ConfigError(f"{shown}: {exc}") from None
        label_files = _label_files(settings.pop("labels", {}), shown)
        _check_settings(name, directory, root, settings, shown)
    elif _lexists(triton_path):
        _confine(triton_path, root, where)
        shown = source = _relative(triton_path, root)
        text = _read_text(triton_path, shown)
        if (
            isinstance(override, Mapping)
            and override
            and all(isinstance(k, str) for k in override)
            and set(override) <= TRITON_FIELDS
        ):
            # The override's fields replace the file's before the file is judged: a
            # field the file gets wrong (timeout_action: DELAY, say) is fixed by one.
            triton = TritonModel.parse(
                text, name=name, where=f"{shown} with the config override", override=override
            )
        else:
            triton = TritonModel.parse(text, name=name, where=shown)
        label_files = dict(triton.labels)
        notes.extend(triton.notes)
        settings = dict(triton.settings)
        if settings.get("backend") == PIPELINE:
            settings["path"] = _TRITON_FILE  # an ensemble is its config, served as version 1
        if triton.version_policy is not None:
            try:
                policy = VersionPolicy.parse(triton.version_policy)
            except ConfigError as exc:
                raise ConfigError(f"{shown}: {exc}") from None
        _check_settings(name, directory, root, settings, shown)

    elif _is_ensemble(override):
        # No config file: an ensemble given whole by the load override, as Triton loads
        # one into a directory that holds only a version directory (GET .../config of
        # another pipeline, say, under this name). It has no file: it is its config.
        shown = source = f"model {name!r}: the config override"
        triton = TritonModel.parse(override, name=name, where=shown)
        notes.extend(triton.notes)
        settings = dict(triton.settings)
        if triton.version_policy is not None:
            try:
                policy = VersionPolicy.parse(triton.version_policy)
            except ConfigError as exc:
                raise ConfigError(f"{shown}: {exc}") from None
        _check_settings(name, directory, root, settings, shown)
        from_override = True

    try:
        children = sorted(directory.iterdir())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot list its directory: {exc.strerror or exc}") from None

    fixed_file = "path" in settings
    file_name = default_file = model_file_name(settings.get("backend", "onnxruntime"))
    if triton is not None and triton.model_filename is not None:
        file_name = triton.model_filename
    versions: list[int] = []
    for child in children:
        child_name = child.name
        if child_name.startswith(".") or child_name == _CONFIG_FILE:
            continue
        if child_name in label_files.values():
            continue
        if child_name == _TRITON_FILE:
            if triton is None:
                notes.append(f"ignored {_TRITON_FILE} ({_CONFIG_FILE} is read; it wins)")
            continue
        if not (child_name.isascii() and child_name.isdigit() and _is_dir(child)):
            if not (fixed_file and child_name == PurePosixPath(str(settings["path"])).parts[0]):
                notes.append(
                    f"ignored {child_name} (trioinfer reads {_CONFIG_FILE} and "
                    f"<N>/{file_name} in a model directory)"
                )
            continue
        if not _is_version_name(child_name):
            notes.append(
                f"ignored directory {child_name} (a version is a positive integer below 2**63, "
                "written without leading zeros)"
            )
            continue
        if from_override:
            versions.append(int(child_name))  # Triton's empty version directory
            continue
        if fixed_file:
            if child_name == PurePosixPath(str(settings["path"])).parts[0]:
                continue
            if triton is not None:
                continue  # Triton wants a version directory beside an ensemble's config
            notes.append(
                f"ignored version directory {child_name} ({_CONFIG_FILE} sets path, which is "
                "served as version 1)"
            )
            continue
        _confine(child, root, where)
        model_file = child / file_name
        if not _lexists(model_file):
            # config.pbtxt's default_model_filename names the file: no other backend's is meant.
            other = "" if file_name != default_file else _other_backend_file(child, file_name)
            notes.append(f"ignored version directory {child_name} (it holds no {file_name}{other})")
            continue
        _confine(model_file, root, where)
        if not _is_file(model_file):
            notes.append(f"ignored version directory {child_name} (its {file_name} is not a file)")
            continue
        versions.append(int(child_name))

    if fixed_file:
        model_file = directory / str(settings["path"])
        _confine(model_file, root, where)
        if _is_file(model_file):
            versions = [1]
        else:
            notes.append(
                f"{_CONFIG_FILE} sets path = {_shown(settings['path'])}, which is not a file"
            )
    if from_override and not versions:
        versions = [1]  # served as version 1, as a pipeline's config.toml is
    return ModelEntry(
        name,
        directory,
        tuple(sorted(versions)),
        policy,
        settings,
        tuple(notes),
        traffic,
        triton,
        label_files,
        from_override,
        source,
    )


def _is_ensemble(override: Mapping[str, Any] | None) -> TypeGuard[Mapping[str, Any]]:
    # Whether a load override is a whole Triton ensemble config (JSON), which needs no file.
    return (
        isinstance(override, Mapping)
        and all(isinstance(k, str) for k in override)
        and set(override) <= TRITON_FIELDS
        and override.get("platform") == "ensemble"
    )


def _label_files(value: object, shown: str) -> dict[str, str]:
    """Read ``labels = { output = "labels.txt" }``: each output's labels file."""
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in value.items()
    ):
        raise ConfigError(
            f'{shown}: labels must be a table of output = "file", e.g. '
            f'{{ probabilities = "labels.txt" }}, got {_shown(value)}'
        )
    return dict(value)


def parse_traffic(value: object) -> dict[int, float]:
    """Read ``traffic = { "1" = 90, "2" = 10 }``: each served version's share of requests.

    Empty (the default) sends every request that names no version to the
    highest served one. Weights are relative: they need not add up to 100.

    Raises:
        ConfigError: Not a table of version = weight >= 0, or every weight 0.
    """
    if not isinstance(value, Mapping):
        raise ConfigError(
            f'traffic must be a table of version = weight, e.g. {{ "1" = 90, "2" = 10 }}, '
            f"got {_shown(value)}"
        )
    weights: dict[int, float] = {}
    for version, weight in value.items():
        # ASCII digits only, as a URL's version: str.isdigit() holds for "²", which int()
        # refuses (a load override's ValueError was a 500), and for a fullwidth "1", read as 1.
        # At most 19 of them (2**63-1 has 19): int() refuses 4301 or more (a 500 too).
        number = (
            int(version)
            if isinstance(version, str)
            and version.isascii()
            and version.isdigit()
            and len(version) <= 19
            else version
        )
        if (
            not isinstance(number, int)
            or isinstance(number, bool)
            or not 1 <= number <= _MAX_VERSION
        ):
            raise ConfigError(f"traffic: {_shown(version)} is not a version number")
        try:
            # An integer past a float's range (10**400) is no weight either.
            as_float = float(weight) if isinstance(weight, int | float) else math.nan
        except OverflowError:
            as_float = math.inf
        if isinstance(weight, bool) or not 0 <= as_float < math.inf:
            raise ConfigError(
                f"traffic: version {number} needs a finite weight >= 0, got {_shown(weight)}"
            )
        weights[number] = as_float
    if weights and not any(weights.values()):
        raise ConfigError("traffic: every weight is 0; give at least one version some traffic")
    return weights


def _policy_from(settings: dict[str, Any], shown: str) -> VersionPolicy:
    """Take the server's keys out of *settings* and return the version policy."""
    if "version_policy" not in settings:
        return VersionPolicy()
    try:
        return VersionPolicy.parse(settings.pop("version_policy"))
    except ConfigError as exc:
        raise ConfigError(f"{shown}: {exc}") from None


def _check_settings(
    name: str, directory: Path, root: Path, settings: Mapping[str, Any], shown: str
) -> None:
    """Refuse a config.toml that could not build a ModelConfig, before anyone loads it."""
    if "name" in settings and settings["name"] != name:
        raise ConfigError(
            f"{shown}: name = {_shown(settings['name'])} differs from the directory's name "
            f"{name!r}; a model in a repository is named by its directory, so leave name out "
            "or make the two equal"
        )
    if "path" in settings:
        _check_path_key(settings["path"], directory, root, shown)
    # The server's own keys were taken out already; a misspelt one is listed with them.
    fields = {f.name for f in attrs.fields(ModelConfig)}
    if set(settings) - fields:
        raise unknown_keys_error(shown, set(settings) - fields, fields | _SERVER_KEYS)
    try:
        # The path is a stand-in: only the fields' own checks matter here.
        ModelConfig.from_dict({**settings, "name": name, "path": directory / "model"})
    except ConfigError as exc:
        raise ConfigError(f"{shown}: {exc}") from None


def _check_path_key(
    value: object,
    directory: Path,
    root: Path,
    shown: str,
    *,
    key: str = "path",
    example: str = "weights/model.onnx",
) -> None:
    # *key* and *example* name what is checked: config.toml's path, or (key "") a labels
    # file, which *shown* names already and which must not be described as a model file.
    expected = f"a relative path to a file inside the model directory, e.g. {example!r}"
    named = f"{key} = {_shown(value)} " if key else ""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{shown}: {key or 'it'} must be {expected}; got {_shown(value)}")
    pure = PurePosixPath(value)
    # A backslash is refused too: it would be a separator on Windows and a
    # strange file name anywhere else.
    if pure.is_absolute() or "\\" in value or ".." in pure.parts or not pure.parts:
        raise ConfigError(
            f"{shown}: {named}must be {expected}: a file, not absolute, "
            "no '..', and '/' as the separator"
        )
    resolved = _confine(directory / value, root, shown)
    try:
        inside = resolved.is_relative_to(directory.resolve())
    except (OSError, RuntimeError):  # pragma: no cover - _confine resolved it already
        inside = False
    if not inside:
        raise ConfigError(
            f"{shown}: {named or 'it '}leads outside the model directory "
            "(through a symbolic link); it must stay inside it"
        )
