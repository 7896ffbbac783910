"""Tools for testing trioinfer plugins and the applications that use trioinfer.

- [`FakeBackend`][trioinfer.testing.FakeBackend]: a backend whose compute is a
  numpy function and whose latency runs on the event loop's clock (so
  `trio.testing.MockClock` drives it), with execution counts and injected failures.
- [`check_backend()`][trioinfer.testing.check_backend] and
  [`check_scheduler()`][trioinfer.testing.check_scheduler]: conformance checks a
  plugin author runs against their plugin, as trio's `check_two_way_stream`
  does for streams. trioinfer's own plugins pass them in its tests.
- [`make_request()`][trioinfer.testing.make_request]: a
  [`Request`][trioinfer.Request] for scheduler tests.
- [`trioinfer.testing.models`][trioinfer.testing.models]: small real ONNX models
  (needs `onnx`).
"""

from ._checks import check_backend as check_backend
from ._checks import check_scheduler as check_scheduler
from ._checks import make_request as make_request
from ._fake import FakeBackend as FakeBackend
from ._fake import FakeInstance as FakeInstance
