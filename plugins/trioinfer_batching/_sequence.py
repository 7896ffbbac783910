"""The ``sequence`` batcher: stateful models, each sequence on one instance, in order.

What it keeps per sequence: the instance (and, under ``direct``, the batch
slot) it is bound to, its requests not yet run, the one running, and its
implicit state. Requests are checked against their sequence when the engine
admits them (``admit``), so a request for an unknown, ended or released
sequence is refused at once. Workers form batches per instance
(``next_batch_for``); ``assemble`` lays out the inputs with the control and
state tensors, and the ``split`` it returns stores each sequence's new state.

A request that ends without being computed (its instance failed, its caller
left, its deadline passed) ends its sequence: the model's state would
otherwise have skipped a step. So does one computed after its caller left
(a model that ignores cancellation): its caller saw no answer, and a state
carried past it would hold a step the client believes never ran. The
sequence's waiting requests and any later ones are refused with
``SequenceError`` saying why; nothing restarts it but a new
``sequence_start``.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any, final

import anyio
import numpy as np

from trioinfer import ConfigError, QueueFull, SequenceConfig, SequenceError, TensorSpec
from trioinfer.abc import Arrays, Outputs, Split
from trioinfer.lowlevel import Replica, Request, RequestQueue, SequenceContext, Status

#: How many ended sequences are remembered, to say why their next request is refused.
REMEMBERED = 4096

SequenceId = int | str
_NOT_RUN = "was cancelled or expired before it ran"


@final
class _Sequence:
    __slots__ = ("end", "id", "last", "pending", "replica", "running", "slot", "state")

    def __init__(self, sequence_id: SequenceId, now: float) -> None:
        self.id = sequence_id
        self.last = now  # the latest activity: a request admitted or computed
        self.pending: collections.deque[Request] = collections.deque()
        self.running: Request | None = None
        self.replica: int | None = None
        self.slot = 0
        self.state: dict[str, np.ndarray[Any, Any]] | None = None
        self.end = False  # its last request (sequence_end) was admitted


@final
class SequenceBatcher:
    """The sequence batcher (Triton's sequence batcher): see the ``[sequence]`` config.

    Takes no options: the model's ``[sequence]`` table
    ([`SequenceConfig`][trioinfer.SequenceConfig]) configures it. Under
    ``oldest`` each batch takes the next request of up to ``max_batch_size``
    sequences bound to the instance (or new ones, which it binds), oldest
    request first; under ``direct`` each sequence holds a slot of its
    instance, and a batch has a row per slot up to the highest one in use.
    Neither waits to fill a batch: a batch leaves as soon as an instance is
    free (Triton's ``max_queue_delay`` is not implemented). A model's optional
    inputs may be sent or left out by any request; as in Triton, a batch holds
    requests that send the same inputs (the oldest request's set), and the
    others wait for the next batch (under ``direct``, as padding rows).
    """

    def __init__(self) -> None:
        self._context: SequenceContext | None = None
        self._config = SequenceConfig()
        self._model = ""
        self._batched = True
        self._size = 1
        # Every sequence in progress, least recently active first (for idle release).
        self._sequences: collections.OrderedDict[SequenceId, _Sequence] = collections.OrderedDict()
        # Why recently ended sequences ended, for the message their next request gets.
        self._gone: collections.OrderedDict[SequenceId, str] = collections.OrderedDict()
        self._of: dict[Request, _Sequence] = {}  # requests held or running
        self._computed: set[Request] = set()
        # Computed requests whose state output did not fit the state: why, to end the sequence.
        self._spoiled: dict[Request, str] = {}
        self._slots: dict[int, list[_Sequence | None]] = {}
        self._changed: anyio.Event | None = None
        self._changes = 0  # counts _wake() calls, so a worker sees its own changes too
        self._controls: list[tuple[str, TensorSpec, tuple[int, ...]]] = []
        self._states: list[tuple[str, str, np.dtype[Any], tuple[int, ...], float]] = []
        self._hidden_outputs: frozenset[str] = frozenset()
        # The string inputs whose elements reach the model as bytes (TensorSpec.utf8
        # false): their padding rows are b"", as their other rows are bytes.
        self._bytes_inputs: frozenset[str] = frozenset()
        self._sets_differ = False

    @property
    def max_batch_size(self) -> int | None:
        """The model's ``sequence.max_batch_size``; None before attach or without a batch axis."""
        return self._size if self._context is not None and self._batched else None

    # -- set up --------------------------------------------------------------------

    def attach(self, context: SequenceContext) -> None:
        """Read the model's ``[sequence]`` config and check it against the model's signature."""
        config = context.config.sequence
        if config is None:  # pragma: no cover  # the engine attaches stateful models only
            raise ConfigError(f"model {context.model!r} has no [sequence] config")
        self._context, self._config, self._model = context, config, context.model
        signature = context.signature
        self._batched = signature.batched
        self._bytes_inputs = frozenset(
            spec.name
            for spec in signature.inputs
            if spec.dtype is not None and spec.dtype.kind == "O" and not spec.utf8
        )
        if not self._batched and config.max_batch_size != 1:
            raise ConfigError(
                f"model {self._model!r} has no batch dimension, so sequence.max_batch_size "
                f"must be 1, got {config.max_batch_size}"
            )
        # Requests may send different sets of inputs (some optional ones left out);
        # the control and state inputs are the batcher's own, filled in every batch.
        self._sets_differ = any(
            spec.optional and spec.name not in config.hidden_inputs for spec in signature.inputs
        )
        self._size = config.max_batch_size
        names = {spec.name for spec in signature.inputs}
        outputs = {spec.name: spec for spec in signature.outputs}
        skip = 1 if self._batched else 0
        for kind, name in config.control.items():
            if name not in names:
                raise ConfigError(
                    f"model {self._model!r}: sequence.control.{kind} names input {name!r}, but "
                    f"the model's inputs are {', '.join(sorted(names))}"
                )
            spec = signature.input(name)
            kinds = "iub" + ("O" if kind == "corrid" else "f")
            if spec.dtype is None or spec.dtype.kind not in kinds:
                raise ConfigError(
                    f"model {self._model!r}: control input {name!r} ({kind}) is "
                    f"{spec.describe()}; expected "
                    + ("an integer or string type" if kind == "corrid" else "an int, float or bool")
                )
            shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape[skip:])
            self._controls.append((kind, spec, shape))
        for state in config.state:
            if state.input not in names:
                raise ConfigError(
                    f"model {self._model!r}: sequence.state input {state.input!r} is not an "
                    f"input of the model ({', '.join(sorted(names))})"
                )
            if state.output not in outputs:
                raise ConfigError(
                    f"model {self._model!r}: sequence.state output {state.output!r} is not an "
                    f"output of the model ({', '.join(sorted(outputs))})"
                )
            spec = signature.input(state.input)
            dims = spec.shape[skip:]
            if state.shape is not None:
                shape = state.shape
                if len(shape) != len(dims) or any(
                    isinstance(d, int) and d != size for d, size in zip(dims, shape, strict=False)
                ):
                    # The state is fed in this shape, unchecked (no caller sends it): one
                    # the model's input does not take would fail each execution or, where
                    # only the config fixes the size, answer in sizes the model's outputs
                    # were not declared (and proved) for.
                    raise ConfigError(
                        f"model {self._model!r}: sequence.state gives state input "
                        f"{state.input!r} the shape {list(shape)}, but the input is "
                        f"{spec.describe()}; give its sizes"
                        + (" after the batch dimension" if skip else "")
                        + " (or leave shape out where the input fixes them all)"
                    )
            elif all(isinstance(d, int) for d in dims):
                shape = tuple(int(d) for d in dims if d is not None)
            else:
                raise ConfigError(
                    f"model {self._model!r}: state input {state.input!r} is {spec.describe()}, "
                    "with sizes left open; give the state's shape in sequence.state"
                )
            dtype = spec.dtype if spec.dtype is not None else np.dtype(np.float32)
            produced = outputs[state.output]
            out_dims = produced.shape[skip:]
            if (produced.dtype is not None and produced.dtype != dtype) or (
                len(out_dims) != len(shape)
                or any(
                    isinstance(d, int) and d != size
                    for d, size in zip(out_dims, shape, strict=False)
                )
            ):
                # The output is fed back as the input unchecked by any caller: in another
                # dtype it would be cast (1.7 became 1 in an int32 state), in another shape
                # it fails the next batch of every sequence in it (Triton too gives a
                # state's input and output one data type and shape).
                raise ConfigError(
                    f"model {self._model!r}: sequence.state output {state.output!r} is "
                    f"{produced.describe()}, but its state input {state.input!r} is "
                    f"{spec.describe()} (a state of shape {list(shape)}"
                    + (" after the batch dimension" if skip else "")
                    + "): a state's output must have its input's dtype and the state's shape"
                )
            self._states.append((state.input, state.output, dtype, shape, state.initial))
        self._hidden_outputs = config.hidden_outputs
        self._changed = anyio.Event()

    # -- admission -----------------------------------------------------------------

    def admit(self, request: Request) -> None:
        """Check *request* against its sequence and queue it behind the sequence's others.

        Raises:
            QueueFull: The model's ``max_queue_size`` requests wait or run already
                (the queue no longer counts those the batcher took from it).
            SequenceError: No sequence id; no sequence of that id in progress and
                no ``sequence_start``; the sequence ended, was released or broke;
                a new start while the sequence still has requests; more than one row.
        """
        context = self._ctx()
        flags = request.sequence_flags
        if flags is None:
            raise SequenceError(
                f"model {self._model!r} is stateful: each request needs a sequence_id, and a "
                "sequence's first request sequence_start"
            )
        if self._batched and request.rows != 1:
            raise SequenceError(
                f"each request of a sequence of model {self._model!r} carries one row (batch "
                f"size 1), got {request.rows}"
            )
        for kind, spec, _shape in self._controls:
            if kind == "corrid" and spec.dtype is not None and spec.dtype.kind != "O":
                if not isinstance(flags.id, int):
                    raise SequenceError(
                        f"model {self._model!r} takes integer sequence ids (its CORRID input "
                        f"{spec.name!r} is {spec.describe()}), got {flags.id!r}"
                    )
                if not np.can_cast(np.min_scalar_type(flags.id), spec.dtype):
                    raise SequenceError(
                        f"sequence_id {flags.id} does not fit the CORRID input {spec.name!r} "
                        f"of model {self._model!r} ({spec.describe()})"
                    )
        bound = context.config.max_queue_size
        if len(self._of) >= bound:
            raise QueueFull(
                f"model {self._model!r} has {len(self._of)} requests of sequences waiting or "
                f"running, its max_queue_size; retry later",
                retry_after=context.retry_after(),
            )
        now = context.current_time()
        self._sweep(now)
        sequence = self._sequences.get(flags.id)
        if flags.start:
            if sequence is not None:
                if sequence.pending or sequence.running is not None:
                    raise SequenceError(
                        f"sequence {flags.id!r} of model {self._model!r} has requests not yet "
                        "answered; it cannot start again (sequence_start) before they end"
                    )
                self._release(sequence, None)  # a finished-with sequence begins anew
            sequence = _Sequence(flags.id, now)
            self._sequences[flags.id] = sequence
            self._gone.pop(flags.id, None)
        elif sequence is None:
            why = self._gone.get(flags.id)
            if why is not None:
                raise SequenceError(
                    f"sequence {flags.id!r} of model {self._model!r} {why}; start a new one "
                    "with sequence_start"
                )
            raise SequenceError(
                f"model {self._model!r} has no sequence {flags.id!r} in progress: a "
                "sequence's first request must set sequence_start"
            )
        elif sequence.end:
            raise SequenceError(
                f"sequence {flags.id!r} of model {self._model!r} already had its last request "
                "(sequence_end); start a new one with sequence_start"
            )
        if flags.end:
            sequence.end = True
        sequence.pending.append(request)
        self._of[request] = sequence
        sequence.last = now
        self._sequences.move_to_end(flags.id)
        self._wake()

    def withdrawn(self, request: Request) -> None:
        """End the sequence of *request*, which ended while it waited here (see the module)."""
        sequence = self._of.get(request)
        if sequence is None or not sequence.pending or sequence.pending[0] is not request:
            # Not ours; dispatched already (_over() sees it when its batch is over); or
            # behind earlier requests of its sequence, which still run for their callers:
            # the sequence ends when it reaches this one (_form()).
            return
        self._break(sequence, request, _NOT_RUN)

    # -- forming batches -----------------------------------------------------------

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        """Not used: the engine calls `next_batch_for()` for a sequence batcher."""
        raise RuntimeError(
            "the sequence batcher forms batches per instance (next_batch_for); "
            "the engine calls that for models with a [sequence] config"
        )

    async def next_batch_for(
        self, queue: RequestQueue, replica: Replica, previous: Sequence[Request]
    ) -> list[Request]:
        """Wait for the next requests of sequences on *replica*, at most one per sequence."""
        context = self._ctx()
        self._over(previous, context.current_time())
        while True:
            changes = self._changes
            self._drain(queue)
            now = context.current_time()
            self._sweep(now)
            # New sequences start only on an instance that serves: one taken out while
            # its worker waited here would hold them, unrun. (One gone that the engine
            # has not seen yet still takes them: forming a batch is how it sees it, and
            # the batch then fails, saying so, rather than every new sequence waiting.)
            batch = self._form(replica.index, replica.serving)
            if batch:
                return batch
            if self._changes != changes:
                # A sequence ended while forming (a slot came free, say): look again.
                continue
            changed = self._changed
            assert changed is not None
            # Wake for new work, or when the least recently active sequence goes idle.
            with anyio.move_on_after(self._next_idle() - now):
                await changed.wait()

    def _drain(self, queue: RequestQueue) -> None:
        # Each admitted request waits in its sequence; the queue is emptied only to keep
        # its count true (and it fails the expired ones on the way).
        while True:
            try:
                queue.pop_nowait()
            except anyio.WouldBlock:
                return

    def _form(self, replica: int, takes_new: bool) -> list[Request]:
        # *takes_new*: whether sequences bound to no instance yet may be bound to this one.
        if self._config.strategy == "direct":
            candidates = self._bound_slots(replica, takes_new)
        else:
            candidates = self._oldest_candidates(replica, takes_new)
        ready: list[_Sequence] = []
        for sequence in candidates:
            head = sequence.pending[0]
            if head.status is not Status.QUEUED:
                # Its caller left or its deadline passed while it waited: the state would
                # skip a step, so the sequence ends here.
                self._break(sequence, head, _NOT_RUN)
            else:
                ready.append(sequence)
        if self._config.strategy == "oldest":
            ready.sort(key=lambda s: s.pending[0].arrival)
        if self._sets_differ and len(ready) > 1:
            # A batch holds requests that send the same inputs, as in Triton: the
            # oldest request's set. Others wait for a later batch (under direct, their
            # slots are padding rows meanwhile): their inputs could not be laid out
            # beside these, with no rows for an input some left out.
            names = min(ready, key=lambda s: s.pending[0].arrival).pending[0].inputs.keys()
            ready = [s for s in ready if s.pending[0].inputs.keys() == names]
        if self._config.strategy == "oldest":
            ready = ready[: self._size]
        batch = []
        for sequence in ready:
            sequence.replica = replica
            request = sequence.running = sequence.pending.popleft()
            batch.append(request)
        return batch

    def _oldest_candidates(self, replica: int, takes_new: bool) -> list[_Sequence]:
        # Sequences on this instance with a request to run, and new ones up to
        # max_candidate_sequences in progress here, the longest waiting first.
        bound: list[_Sequence] = []
        new: list[_Sequence] = []
        in_progress = 0
        for s in self._sequences.values():
            if s.replica == replica:
                in_progress += 1
                if s.running is None and s.pending:
                    bound.append(s)
            elif s.replica is None and s.pending and takes_new:
                new.append(s)
        limit = self._config.max_candidate_sequences
        if limit is not None:
            new.sort(key=lambda s: s.pending[0].arrival)
            new = new[: max(limit - in_progress, 0)]
        return bound + new

    def _bound_slots(self, replica: int, takes_new: bool) -> list[_Sequence]:
        # Sequences in this instance's slots with a request to run, after giving each
        # free slot to the sequence waiting longest for one (*takes_new*).
        slots = self._slots.setdefault(replica, [None] * self._size)
        free = [i for i, s in enumerate(slots) if s is None]
        if free and takes_new:
            waiting = sorted(
                (s for s in self._sequences.values() if s.replica is None and s.pending),
                key=lambda s: s.pending[0].arrival,
            )
            for sequence, slot in zip(waiting, free, strict=False):
                sequence.replica, sequence.slot = replica, slot
                slots[slot] = sequence
        return [s for s in slots if s is not None and s.running is None and s.pending]

    def _over(self, previous: Sequence[Request], now: float) -> None:
        # The worker's last batch has run: advance each sequence, or end it if its
        # request was not computed.
        for request in previous:
            sequence = self._of.pop(request, None)
            computed = request in self._computed
            self._computed.discard(request)
            spoiled = self._spoiled.pop(request, None)
            if sequence is None:
                continue  # its sequence ended while it ran (its instance gone: replica_gone)
            sequence.running = None
            if spoiled is not None:
                self._break(sequence, request, spoiled)
            elif computed and not request.abandoned:
                sequence.last = now
                if self._sequences.get(sequence.id) is sequence:
                    self._sequences.move_to_end(sequence.id)
                    flags = request.sequence_flags
                    if flags is not None and flags.end:
                        self._release(sequence, "ended with its last request (sequence_end)")
            else:
                # A request whose caller left is never part of the sequence, even when
                # the model computed it (code that ignores cancellation, a thread's answer
                # arriving as the caller leaves): its caller saw no answer, so a state
                # carried on past it would hold a step the client believes never ran.
                why = (
                    "was cancelled before its answer was delivered"
                    if request.abandoned
                    else "failed, or expired, before it was computed"
                )
                self._break(sequence, request, why)
        if previous:
            self._wake()

    def _break(self, sequence: _Sequence, request: Request, why: str) -> None:
        reason = f"ended because its request {request.id!r} {why}"
        self._of.pop(request, None)
        self._fail_waiting(sequence, reason, but=request)
        if self._sequences.get(sequence.id) is sequence:
            self._release(sequence, reason)

    def _fail_waiting(self, sequence: _Sequence, reason: str, but: Request | None = None) -> None:
        # Fail the requests *sequence* holds, unrun (*but* that one: its caller ends it).
        context = self._ctx()
        for waiting in sequence.pending:
            self._of.pop(waiting, None)
            if waiting is not but:
                context.fail(
                    waiting,
                    SequenceError(
                        f"sequence {sequence.id!r} of model {self._model!r} {reason}; request "
                        f"{waiting.id!r} was not run: start a new sequence with sequence_start"
                    ),
                )
        sequence.pending.clear()

    def replica_gone(self, replica: Replica) -> None:
        """End the sequences on *replica*, whose instance is gone: their state went with it.

        The engine calls it once it has taken the instance out of service (its
        ``reason`` says why). Each sequence's waiting requests fail with
        ``SequenceError`` saying so, and later ones are refused; a request
        that was running there ends with its batch. A re-created instance
        starts with no sequence.
        """
        reason = (
            f"ended because {replica.label}, which held it, is out of service: {replica.reason}"
        )
        for sequence in [s for s in self._sequences.values() if s.replica == replica.index]:
            self._fail_waiting(sequence, reason)
            if sequence.running is not None:
                self._of.pop(sequence.running, None)  # (_over finds it ended)
            self._release(sequence, reason)

    # -- idle sequences ------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        idle = self._config.max_sequence_idle
        for _ in range(len(self._sequences)):
            sequence = next(iter(self._sequences.values()))
            if sequence.last + idle > now:
                return
            if sequence.pending or sequence.running is not None:
                # A sequence with a request waiting or running is not idle.
                sequence.last = now
                self._sequences.move_to_end(sequence.id)
                continue
            self._release(
                sequence,
                f"was released after {idle:g}s without a request (max_sequence_idle), with its "
                "state",
            )

    def _next_idle(self) -> float:
        for sequence in self._sequences.values():
            return sequence.last + self._config.max_sequence_idle
        return math.inf

    def _release(self, sequence: _Sequence, why: str | None) -> None:
        del self._sequences[sequence.id]
        if sequence.replica is not None and self._config.strategy == "direct":
            slots = self._slots[sequence.replica]
            if slots[sequence.slot] is sequence:
                slots[sequence.slot] = None
        sequence.state = None
        if why is not None:
            self._gone[sequence.id] = why
            self._gone.move_to_end(sequence.id)
            if len(self._gone) > REMEMBERED:
                self._gone.popitem(last=False)
        self._wake()

    def _wake(self) -> None:
        changed = self._changed
        if changed is not None:
            changed.set()
        self._changed = anyio.Event()
        self._changes += 1

    def _ctx(self) -> SequenceContext:
        if self._context is None:
            raise RuntimeError("the sequence batcher was not attached to a model")
        return self._context

    # -- the backend's inputs and outputs ---------------------------------------------

    def computed(self, requests: Sequence[Request]) -> None:
        """Note *requests* computed by an instance that read them itself, so their sequences go on.

        What ``assemble``'s split does for them, with no inputs laid out: such an
        instance (a `trioinfer.abc.RequestsInstance`) feeds each request's
        controls itself, and a model with implicit state is refused with it.
        """
        self._computed.update(requests)

    def assemble(self, requests: Sequence[Request]) -> tuple[Arrays, Split]:
        """Lay out the batch's inputs with their control and state tensors; see the module."""
        sequences = [self._of[r] for r in requests]
        if not self._batched:
            positions = [0]
            rows = 0
        elif self._config.strategy == "direct":
            positions = [s.slot for s in sequences]
            rows = max(positions) + 1
        else:
            positions = list(range(len(requests)))
            rows = len(requests)
        inputs: dict[str, np.ndarray[Any, Any]] = {}
        for name, first in requests[0].inputs.items():
            if not self._batched:
                inputs[name] = first
                continue
            array = _blank((rows, *first.shape[1:]), first.dtype, name in self._bytes_inputs)
            for request, position in zip(requests, positions, strict=True):
                array[position] = request.inputs[name][0]
            inputs[name] = array
        lead = (rows,) if self._batched else ()
        for kind, spec, shape in self._controls:
            assert spec.dtype is not None
            raw = spec.name in self._bytes_inputs
            array = _blank((*lead, *shape), spec.dtype, raw)
            for request, position in zip(requests, positions, strict=True):
                flags = request.sequence_flags
                assert flags is not None
                value: object = {
                    "start": flags.start,
                    "end": flags.end,
                    "ready": True,
                    "corrid": flags.id,
                }[kind]
                if kind == "corrid" and spec.dtype.kind == "O":
                    # A string CORRID holds the id as text (an int id in decimal), as
                    # the model's other string tensors: bytes where those are bytes.
                    text = value if isinstance(value, str) else str(value)
                    value = text.encode("utf-8", "surrogatepass") if raw else text
                if self._batched:
                    array[position] = value
                else:
                    array[...] = value
            inputs[spec.name] = array
        for name, _output, dtype, shape, initial in self._states:
            array = np.full((*lead, *shape), initial, dtype=dtype)
            for sequence, position in zip(sequences, positions, strict=True):
                if sequence.state is not None:
                    if self._batched:
                        array[position] = sequence.state[name]
                    else:
                        array[...] = sequence.state[name]
            inputs[name] = array
        live = list(requests)

        def split(outputs: Arrays) -> list[Outputs]:
            shares: list[Outputs] = []
            for request, sequence, position in zip(live, sequences, positions, strict=True):
                if self._batched:
                    share = {
                        k: v[position : position + 1]
                        for k, v in outputs.items()
                        if k not in self._hidden_outputs
                    }
                else:
                    share = {k: v for k, v in outputs.items() if k not in self._hidden_outputs}
                if self._states:
                    state = {}
                    for name, output, dtype, shape, _initial in self._states:
                        value = np.array(
                            outputs[output][position] if self._batched else outputs[output]
                        )
                        if value.shape != shape:
                            # An output with sizes left open, in sizes the state is not: the
                            # answer is whole, but the sequence cannot go on from it. (Its
                            # dtype is the input's: checked at attach, and the runner's
                            # output check holds outputs to their declared dtypes.)
                            self._spoiled[request] = (
                                f"left its state {name!r} as output {output!r} gave it, "
                                f"{value.dtype}{list(value.shape)}, which is not the state's "
                                f"{dtype}{list(shape)}"
                            )
                            break
                        state[name] = value
                    sequence.state = state
                self._computed.add(request)
                shares.append(share)
            return shares

        return inputs, split


def _blank(shape: tuple[int, ...], dtype: np.dtype[Any], raw: bool = False) -> np.ndarray[Any, Any]:
    # Padding rows (and the base of control tensors): zeros, or empty strings (*raw*:
    # bytes, for an input whose elements reach the model as bytes).
    if dtype.kind == "O":
        return np.full(shape, b"" if raw else "", dtype=object)
    return np.zeros(shape, dtype=dtype)
