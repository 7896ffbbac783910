"""Small pieces the core shares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

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
