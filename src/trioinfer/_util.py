"""Small pieces the core shares."""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast
from urllib.parse import SplitResult, urlsplit

from ._exceptions import ConfigError

T = TypeVar("T")


class NoPublicConstructor(type):
    """A metaclass for classes only the engine creates: ``Cls(...)`` raises TypeError.

    The engine's one way in is ``Cls._create(...)``. As in trio's ``_util.py``,
    except that ``_create`` is ``type.__call__`` itself, not a method calling
    it: an `Execution` is created per batch, and this way costs no more than
    an ordinary constructor call.
    """

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} has no public constructor: only the engine "
            "creates one, and hands it to the plugins that need it"
        )

    if TYPE_CHECKING:

        def _create(cls: type[T], *args: Any, **kwargs: Any) -> T: ...

    else:
        _create = type.__call__


@types.coroutine
def resume(coro: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """Go on awaiting *coro*, which has run to its first suspension and yielded *yielded*.

    What ``await coro`` would have done from there (``yield from``): every
    value the event loop sends or throws goes to *coro*, and what it yields to
    the loop. With it, a caller that started a coroutine by hand, to run it
    without a frame of its own when it finishes without suspending
    (``coro.send(None)`` raises StopIteration), can await it after all when
    it does suspend.
    """
    value = yielded
    while True:
        try:
            sent = yield value
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # the loop's cancellation, or a throw() into us
            try:
                value = coro.throw(exc)
            except StopIteration as stop:
                return cast(T, stop.value)
        else:
            try:
                value = coro.send(sent)
            except StopIteration as stop:
                return cast(T, stop.value)


def server_url(url: str, *, schemes: tuple[str, ...] = ("http",)) -> SplitResult:
    """*url*, a server's ``--url``, split; ``HOST:PORT`` alone is ``http://HOST:PORT``.

    As perf_analyzer's ``-u`` and tritonclient take an address. One parser for
    every command's ``--url``, so that each takes the same forms and refuses
    the others in the same words.

    Args:
        url: What the user gave.
        schemes: The schemes the command speaks, the first the one a bare
            ``HOST:PORT`` gets.

    Raises:
        ValueError: Not such a URL (no host, another scheme, a port that is no
            number from 0 to 65535); the message names ``--url`` and the forms
            it takes.
    """
    # (urlsplit reads "localhost:8000" as the scheme "localhost".)
    parts = urlsplit(url if "://" in url else f"{schemes[0]}://{url}")
    try:
        parts.port  # noqa: B018  # raises ValueError for "h:x" and "h:99999"
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in schemes or not parts.hostname:
        forms = " or ".join(f"{scheme}://HOST:PORT" for scheme in schemes)
        raise ValueError(f"--url must look like {forms}, got {url!r}")
    return parts


def check_token(value: object, *, name: str = "admin_token") -> None:
    """Refuse an admin token that no client could send, or that would let anyone in.

    One check for the server's token (`ServerConfig.admin_token`, serve's
    ``--admin-token``) and a client's (``trioinfer traffic --token``), the
    message naming the setting as the user gave it (*name*).

    Raises:
        ConfigError: *value* is empty, or not a string, or has whitespace around
            it or a control character in it.
    """
    # An empty token would let "Authorization: Bearer " in; one with spaces around it
    # could never match (header values lose them); a control character cannot be sent
    # in a header at all.
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{name} must be a non-empty string (an empty token would let "
            "'Authorization: Bearer ' through); leave it out for no token"
        )
    if value != value.strip() or not value.isprintable():
        raise ConfigError(
            f"{name} must not start or end with whitespace nor hold control characters: no "
            "client could send it in an Authorization header"
        )
