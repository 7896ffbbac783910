"""Tools for testing trioinfer plugins and the applications that use trioinfer.

- [`FakeBackend`][trioinfer.testing.FakeBackend]: a backend whose compute is a
  numpy function and whose latency runs on the event loop's clock (so
  `trio.testing.MockClock` drives it), with execution counts and injected failures.
- [`check_backend()`][trioinfer.testing.check_backend],
  [`check_scheduler()`][trioinfer.testing.check_scheduler],
  [`check_batcher()`][trioinfer.testing.check_batcher] and
  [`check_fallback()`][trioinfer.testing.check_fallback]: conformance checks a
  plugin author runs against their plugin, as trio's `check_two_way_stream`
  does for streams. trioinfer's own plugins pass them in its tests.
- [`FaultyBackend`][trioinfer.testing.FaultyBackend]: wraps any backend and
  injects errors, hangs, extra latency and crashes, reproducibly from a seed,
  for testing how an application copes.
- [`RequestLedger`][trioinfer.testing.RequestLedger],
  [`assert_all_ended()`][trioinfer.testing.assert_all_ended] and
  [`assert_no_tasks_left()`][trioinfer.testing.assert_no_tasks_left]: check
  that every request ended exactly once, from the caller's side and from the
  engine's counters, and that nothing was left running.
- [`make_request()`][trioinfer.testing.make_request]: a
  [`Request`][trioinfer.lowlevel.Request] for scheduler and batcher tests.
- [`simple_sequence_config()`][trioinfer.testing.simple_sequence_config],
  [`SimpleSequence`][trioinfer.testing.SimpleSequence] and
  [`SequenceAccumulator`][trioinfer.testing.SequenceAccumulator]: a stateful
  accumulator model (Triton's ``simple_sequence``) as a Python model.
- [`trioinfer.testing.models`][trioinfer.testing.models]: small real ONNX models
  (needs `onnx`).
"""

from ._checks import check_backend as check_backend
from ._checks import check_batcher as check_batcher
from ._checks import check_fallback as check_fallback
from ._checks import check_scheduler as check_scheduler
from ._checks import make_request as make_request
from ._fake import FakeBackend as FakeBackend
from ._fake import FakeInstance as FakeInstance
from ._faulty import FaultStatistics as FaultStatistics
from ._faulty import FaultyBackend as FaultyBackend
from ._faulty import FaultyInstance as FaultyInstance
from ._faulty import LedgerStatistics as LedgerStatistics
from ._faulty import RequestLedger as RequestLedger
from ._faulty import assert_all_ended as assert_all_ended
from ._faulty import assert_no_tasks_left as assert_no_tasks_left
from ._sequence import SequenceAccumulator as SequenceAccumulator
from ._sequence import SimpleSequence as SimpleSequence
from ._sequence import simple_sequence_config as simple_sequence_config
