"""Small pieces the core shares."""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

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
