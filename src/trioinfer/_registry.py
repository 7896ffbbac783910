"""The plugin registry: finds plugins through entry points and loads them on first use.

Discovery reads installed distributions' metadata without importing anything;
a plugin's module is imported the first time a model asks for it. A plugin
that fails to import is reported (with its distribution and the error) and
does not stop the others from loading.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Literal

import attrs

from ._exceptions import PluginError, PluginLoadError, TrioInferError
from .abc import Backend, Batcher, Fallback, Scheduler

Kind = Literal["backends", "schedulers", "batchers", "fallbacks"]

#: The entry-point groups, by the short kind names used in configs and the CLI.
GROUPS: Final[Mapping[Kind, str]] = {
    "backends": "trioinfer.backends",
    "schedulers": "trioinfer.schedulers",
    "batchers": "trioinfer.batchers",
    "fallbacks": "trioinfer.fallbacks",
}


#: The contract of each kind, a Protocol of trioinfer.abc.
CONTRACTS: Final[Mapping[Kind, type]] = {
    "backends": Backend,
    "schedulers": Scheduler,
    "batchers": Batcher,
    "fallbacks": Fallback,
}


@attrs.frozen
class PluginInfo:
    """What the registry knows of one plugin before importing it.

    Attributes:
        kind: ``"backends"``, ``"schedulers"``, ``"batchers"`` or ``"fallbacks"``.
        name: The name configs use.
        target: ``module:attribute`` the entry point names, or ``"(in-process)"``.
        distribution: ``name version`` of the distribution that declared it, if any.
    """

    kind: Kind
    name: str
    target: str
    distribution: str | None


@attrs.define(eq=False)
class Registry:
    """Plugins by kind and name, from entry points and from in-process additions.

    Args:
        extra: Plugins to add without packaging, by kind then name (a test's fake
            backend, say). They shadow entry points of the same name.
        entry_points: Where to look; by default every installed distribution's
            entry points. A name declared twice is an error when loaded.
    """

    _extra: Mapping[str, Mapping[str, object]] = attrs.field(factory=dict, alias="extra")
    _entry_points: Iterable[importlib.metadata.EntryPoint] | None = attrs.field(
        default=None, alias="entry_points"
    )
    _found: dict[tuple[str, str], list[importlib.metadata.EntryPoint]] | None = attrs.field(
        default=None, init=False
    )
    _loaded: dict[tuple[str, str], object] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        for kind in self._extra:
            _check_kind(kind)

    def _discover(self) -> dict[tuple[str, str], list[importlib.metadata.EntryPoint]]:
        if self._found is None:
            eps: Iterable[importlib.metadata.EntryPoint] = (
                self._entry_points
                if self._entry_points is not None
                else [
                    ep
                    for group in GROUPS.values()
                    for ep in importlib.metadata.entry_points(group=group)
                ]
            )
            groups = {group: kind for kind, group in GROUPS.items()}
            found: dict[tuple[str, str], list[importlib.metadata.EntryPoint]] = {}
            for ep in eps:
                kind = groups.get(ep.group)
                if kind is not None:
                    found.setdefault((kind, ep.name), []).append(ep)
            self._found = found
        return self._found

    def _strays(self, name: str, group: str) -> list[tuple[str | None, str]]:
        # The distributions and groups of entry points named *name* in a group that
        # looks like *group* but is not one of trioinfer's ("trioinfer.scheduler"),
        # each once (an editable install is found twice): read only to explain an
        # unknown name.
        eps: Iterable[importlib.metadata.EntryPoint] = (
            self._entry_points
            if self._entry_points is not None
            else (ep for dist in importlib.metadata.distributions() for ep in dist.entry_points)
        )
        found = {
            (_dist_of(ep), ep.group): None
            for ep in eps
            if ep.name == name
            and ep.group not in GROUPS.values()
            and difflib.get_close_matches(ep.group, [group], n=1)
        }
        return list(found)

    def plugins(self, kind: Kind | None = None) -> list[PluginInfo]:
        """Every plugin found, sorted by kind and name; nothing is imported."""
        infos = [
            PluginInfo(k, name, ep.value, _dist_of(ep))  # type: ignore[arg-type]
            for (k, name), eps in self._discover().items()
            for ep in eps
        ]
        infos += [
            PluginInfo(k, name, "(in-process)", None)  # type: ignore[arg-type]
            for k, table in self._extra.items()
            for name in table
        ]
        return sorted(
            (info for info in infos if kind is None or info.kind == kind),
            key=lambda info: (info.kind, info.name, info.target),
        )

    def names(self, kind: Kind) -> list[str]:
        """The names of the plugins of one kind, sorted."""
        return sorted({info.name for info in self.plugins(kind)})

    def load(self, kind: Kind, name: str) -> object:
        """Import (once) and return the plugin's entry-point target.

        Raises:
            PluginError: If no plugin of that kind has that name; the message lists
                the known names.
            PluginLoadError: If the plugin fails to import, naming its distribution.
        """
        group = GROUPS[_check_kind(kind)]
        key = (kind, name)
        if key in self._loaded:
            return self._loaded[key]
        table = self._extra.get(kind, {})
        if name in table:
            target = table[name]
        else:
            eps = self._discover().get(key)
            if not eps:
                names = self.names(kind)
                known = ", ".join(map(repr, names)) or "none"
                message = f"no {kind[:-1]} plugin named {name!r}; known {kind}: {known}"
                # A package that declared it in a misspelt group, which nothing reads;
                # else a name misspelt in the config, the usual cause: the near one.
                if strays := self._strays(name, group):
                    for dist, stray_group in strays:
                        message += (
                            f"; {dist or 'a distribution'} declares {name!r} in the "
                            f"entry-point group {stray_group!r}, which trioinfer does not "
                            f"read: the group is {group!r}"
                        )
                elif close := difflib.get_close_matches(name, names, n=1):
                    message += f"; did you mean {close[0]!r}?"
                raise PluginError(message)
            if len(eps) > 1:
                dists = ", ".join(str(_dist_of(ep)) for ep in eps)
                raise PluginError(
                    f"{kind[:-1]} plugin {name!r} is declared by several distributions "
                    f"({dists}); uninstall all but one"
                )
            ep = eps[0]
            try:
                target = ep.load()
            except Exception as exc:
                dist = _dist_of(ep)
                raise PluginLoadError(
                    f"{kind[:-1]} plugin {name!r} ({ep.value}, from {dist or 'unknown'}) "
                    f"failed to import: {type(exc).__name__}: {exc}",
                    group=group,
                    name=name,
                    distribution=dist,
                ) from exc
        self._loaded[key] = target
        return target

    def create(self, kind: Kind, name: str, options: Mapping[str, Any] | None = None) -> Any:
        """Load a plugin and call its target with *options* as keyword arguments.

        Raises:
            PluginError: Unknown name (see `load()`).
            PluginLoadError: The plugin fails to import, is not callable, refuses the
                options, or raises anything else but a `TrioInferError` (which passes as
                it is) while created.
        """
        target = self._load_callable(kind, name)
        factory: Callable[..., Any] = target
        try:
            return factory(**(options or {}))
        except TrioInferError:
            raise  # the plugin's own word (a ConfigError for a value it refuses, say)
        except TypeError as exc:
            raise PluginLoadError(
                _refused_options(kind, name, factory, options or {}, exc),
                group=GROUPS[kind],
                name=name,
                distribution=self._distribution(kind, name),
            ) from exc
        except Exception as exc:
            # A value it refuses (a ValueError for max_batch_size = 0), or its own bug:
            # either way the model cannot load with it, and the operator must hear which.
            dist = self._distribution(kind, name)
            # A backend is created with no options (its backend_options go to load()):
            # "with options {}" would send its author looking for options it never got.
            given = "" if options is None else f" with options {dict(options)!r}"
            raise PluginLoadError(
                f"{kind[:-1]} plugin {name!r}{f' (from {dist})' if dist else ''} failed to "
                f"start{given}: {type(exc).__name__}: {exc}",
                group=GROUPS[kind],
                name=name,
                distribution=dist,
            ) from exc

    def _load_callable(self, kind: Kind, name: str) -> Callable[..., Any]:
        # load(), and the check that the target can be called to create the plugin.
        target = self.load(kind, name)
        if not callable(target):
            # The package's fault, as an import error is: name the package.
            dist = self._distribution(kind, name)
            raise PluginLoadError(
                f"{kind[:-1]} plugin {name!r}{f' (from {dist})' if dist else ''} cannot be "
                f"created: its entry point names {target!r}, which is not callable (expected "
                "a class or a function taking the model's options)",
                group=GROUPS[kind],
                name=name,
                distribution=dist,
            )
        return target

    def _distribution(self, kind: Kind, name: str) -> str | None:
        # The distribution that declared the plugin loaded as (kind, name); None for
        # an in-process one (they shadow entry points) or an unknown distribution.
        if name in self._extra.get(kind, {}):
            return None
        eps = self._discover().get((kind, name))
        return _dist_of(eps[0]) if eps else None

    def check(self, info: PluginInfo) -> str | None:
        """Try to load one plugin; return ``None`` if it loads, else the error message.

        A target that loads but cannot be called (an entry point naming a
        constant, say), or a class that lacks a method of its kind's contract,
        is an error too: every model that names it would fail. (A factory
        function's result is known only when a model creates it.)
        """
        try:
            target = self._load_callable(info.kind, info.name)
        except PluginError as exc:
            return str(exc)
        if isinstance(target, type):
            protocol = CONTRACTS[info.kind]
            if lacks := missing_members(target, protocol):
                return (
                    f"{info.kind[:-1]} plugin {info.name!r} does not implement "
                    f"trioinfer.abc.{protocol.__name__}: {target.__name__} lacks "
                    f"{', '.join(lacks)}"
                )
        return None

    def missing(self, info: PluginInfo) -> str | None:
        """What a plugin that loads still lacks to run here, or ``None`` if nothing.

        A plugin that imports a dependency only on first use (the ray backend
        imports Ray, the onnxruntime backend ONNX Runtime) loads without it, and
        fails only when a model uses it. Its entry-point target may say so at
        once: a callable attribute ``missing_requirements()``, taking no
        arguments and importing nothing heavy, that returns ``None`` when the
        plugin can run here, or a sentence naming what is missing and how to
        install it. ``trioinfer plugins`` shows that sentence as the status.

        Raises:
            PluginError: The plugin does not load (see `check()`).
        """
        target = self.load(info.kind, info.name)
        probe = getattr(target, "missing_requirements", None)
        if not callable(probe):
            return None
        try:
            what = probe()
        except Exception as exc:
            return (
                f"{info.kind[:-1]} plugin {info.name!r}: missing_requirements() raised "
                f"{type(exc).__name__}: {exc}"
            )
        if what is None:
            return None
        return str(what)


def _refused_options(
    kind: str, name: str, factory: Callable[..., Any], options: Mapping[str, Any], exc: TypeError
) -> str:
    """Say which options a plugin's constructor refused, and which it takes.

    Read from its signature where it has one; a constructor that takes
    ``**kwargs`` (or has no signature) is reported by its own ``TypeError``.
    """
    what = f"{kind[:-1]} plugin {name!r}"
    params: list[inspect.Parameter] | None
    try:
        init = getattr(factory, "__init__", None) if isinstance(factory, type) else None
        if init is not None and init is not object.__init__:
            # __init__ takes the options (a __new__ may take **kwargs and pass them on).
            params = list(inspect.signature(init).parameters.values())[1:]
        else:
            params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin or C type without a signature
        params = None
    if params is None or any(p.kind is p.VAR_KEYWORD for p in params):
        return f"{what} does not accept options {sorted(options)}: {exc}"
    accepted = sorted(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
    unknown = sorted(set(options) - set(accepted))
    if not unknown:  # every name is known: a required one missing, or a value it refused
        required = sorted(
            p.name
            for p in params
            if p.default is p.empty
            and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.name not in options
        )
        if required:
            return (
                f"{what} needs options {required}, which the model's {kind[:-1]}_options "
                f"do not set (it takes: {', '.join(accepted)})"
            )
        return f"{what} refused its options {sorted(options)}: {exc}"
    takes = ", ".join(accepted) if accepted else "none"
    message = f"{what} does not accept options {unknown}; it takes: {takes}"
    for key in unknown:
        if close := difflib.get_close_matches(key, accepted, n=1):
            message += f"; did you mean {close[0]!r} for {key!r}?"
    return message


def missing_members(plugin: object, protocol: type) -> list[str]:
    """The methods and attributes of *protocol* that *plugin* lacks (or sets to None), sorted.

    What ``isinstance(plugin, protocol)`` checks on a runtime-checkable Protocol,
    spelt out, so that an error can tell a plugin's author what to add rather than
    only that something is missing. Methods are named with ``()``.
    """
    members: dict[str, bool] = {}
    for klass in protocol.__mro__:
        if klass.__module__ in ("typing", "builtins"):  # Protocol, Generic, object
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") and attr != "__len__":
                continue
            members.setdefault(attr, callable(value) and not isinstance(value, property))
        for attr in getattr(klass, "__annotations__", {}):
            members.setdefault(attr, False)
    return [
        f"{attr}()" if method else attr
        for attr, method in sorted(members.items())
        if getattr(plugin, attr, None) is None
    ]


def _check_kind(kind: str) -> Kind:
    if kind not in GROUPS:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(GROUPS)}")
    return kind  # type: ignore[return-value]


def plugin_label(kind: Kind, name: str, dist: str | None) -> str:
    """How an error names a plugin: ``scheduler 'lifo' (from acme-trioinfer 1.2)``.

    *dist* is the distribution that declared it (`Registry._distribution`), None for
    an in-process plugin or an unknown distribution: then no "(from ...)". One
    wording for every error that blames a plugin, so that an operator always learns
    which installed package to report it to.
    """
    return f"{kind[:-1]} {name!r}{f' (from {dist})' if dist else ''}"


def _dist_of(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None
    return f"{dist.metadata['Name']} {dist.version}"
