"""trioinfer plugins from a template: the ``lifo`` scheduler and the ``scale`` backend.

The engine finds them through the entry points in this distribution's
``pyproject.toml``; this package imports only trioinfer's public API.
"""

from ._backend import ScaleBackend as ScaleBackend
from ._backend import ScaleInstance as ScaleInstance
from ._scheduler import LifoScheduler as LifoScheduler

__all__ = ["LifoScheduler", "ScaleBackend", "ScaleInstance"]
