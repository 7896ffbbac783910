"""Whether a graph proves its declared outputs, so that the engine may spare checking them.

ONNX Runtime holds an answer to the graph's declared output *types* (a node
whose output type differs fails the load), but not to its declared *shapes*:
a graph may declare ``y`` as ``[N, 3]`` and compute ``[N, 4]`` (a Reshape to a
computed shape, say), and ONNX Runtime only logs a warning per run
(``VerifyOutputSizes``) and hands the ``[N, 4]`` answer back. The declared
shape is what the session reports, and so what metadata tells clients.

So an instance says ``checks_outputs`` only when ONNX's own shape inference,
run over the graph with every declared shape but the inputs' set aside (the
outputs', value_info's, subgraphs': inference keeps a declared size it does not
compute, so a lie told there again would prove itself), derives every
output's rank and every size the signature fixes: then the answer's shape
follows from the inputs' (which the engine validated) by the operators'
definitions, whatever the graph declares. The signature proved is the
instance's: the graph's, with the sizes a config fixes (the ``inputs`` and
``outputs`` options, a config.pbtxt's dims) where the graph leaves them
symbolic, so a size only the config fixes is proved or checked like any other.
Anything else (no ``onnx`` package
here, a file too big to parse twice, an operator inference does not know, a
size inference leaves open or computes otherwise) leaves the engine's full
check on, which costs an execution about a microsecond.

ONNX Runtime's own metadata cannot stand in for ``onnx`` (the ``onnx`` extra,
not in a plain ``cpu`` install): its sessions report the graph's declared
shapes, and even with ``session.strict_shape_type_inference`` a load fails only
where its inference computes a size other than the declared one, not where it
leaves one open; such a graph still answers another shape than it reports.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Any, Final, NamedTuple

from trioinfer import ModelSignature

#: Model files bigger than this are not parsed a second time to prove their
#: outputs: their executions are long enough that the engine's check is noise,
#: and the parse would hold a second copy of the weights.
PROOF_MAX_BYTES: Final = 64 << 20

#: Answers kept, the most recently asked: a model's instances, loading side by side
#: or re-created later, ask the same question. Bounded, so that a server loading and
#: unloading models (or a repository whose files are replaced: each file is a new
#: question) does not keep them for the process's life; one asked again after it
#: was forgotten is answered again, at load.
PROOF_CACHE_ENTRIES: Final = 256


class Unproved(NamedTuple):
    """Why a graph does not prove its outputs."""

    #: What is missing, to follow "outputs not proved: " in a log line.
    reason: str
    #: Whether inference computes a rank or size other than the declared one: a
    #: graph whose answers will not fit its own declaration.
    contradicts: bool = False


#: What tells the file at a path from another put there: device, inode, size, mtime (ns).
Stamp = tuple[int, int, int, int]

# What _unproved said per (path, stamp, signature), the least recently asked first
# (changed under _proving_lock): every instance of a model asks the same question.
_proved: collections.OrderedDict[tuple[str, Stamp, ModelSignature], Unproved | None] = (
    collections.OrderedDict()
)
# The question being answered now, per key: a model's instances load side by side,
# and each parse holds a copy of the file (up to PROOF_MAX_BYTES), so the others
# wait for the first's answer.
_proving: dict[tuple[str, Stamp, ModelSignature], threading.Lock] = {}
_proving_lock = threading.Lock()


def file_stamp(path: Path) -> Stamp | None:
    """The `Stamp` of the file at *path*, or None if it cannot be read. Blocking."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def outputs_unproved(
    path: Path, signature: ModelSignature, read: Stamp | None = None
) -> Unproved | None:
    """Why the graph at *path* does not prove *signature*'s outputs, or None when it does.

    *read*: the file's `Stamp` from before ONNX Runtime read it, so that a file
    replaced since (a repository updated during the load) proves nothing of the
    session, which runs the graph read then.

    Blocking (it parses the file): call it off the event loop.
    """
    stamp = file_stamp(path)
    if stamp is None:
        return Unproved("its file cannot be read again")
    if read is not None and stamp != read:
        return Unproved("its file was replaced after ONNX Runtime read it")
    key = (str(path), stamp, signature)
    with _proving_lock:
        if key in _proved:
            _proved.move_to_end(key)
            return _proved[key]
        lock = _proving.setdefault(key, threading.Lock())
    with lock:
        with _proving_lock:
            known = key in _proved
            answer = _proved.get(key)
        if not known:  # (else another thread answered while this one waited)
            answer = _unproved(path, signature, stamp)
    with _proving_lock:
        _proving.pop(key, None)
        _proved[key] = answer
        _proved.move_to_end(key)
        while len(_proved) > PROOF_CACHE_ENTRIES:
            _proved.popitem(last=False)
    return answer


def _unproved(path: Path, signature: ModelSignature, stamp: Stamp) -> Unproved | None:
    try:
        import onnx
        import onnx.shape_inference
    except ImportError:
        return Unproved(
            "the onnx package, which infers the graph's shapes, is not installed here: the "
            "'onnx' extra installs it, e.g. pip install -e '.[cpu,onnx]'"
        )
    file_size = stamp[2]
    if file_size > PROOF_MAX_BYTES:
        return Unproved(
            f"its file is {file_size >> 20} MiB, over the {PROOF_MAX_BYTES >> 20} MiB "
            "parsed to prove them"
        )
    try:
        model = onnx.load(str(path), load_external_data=False)
        if file_stamp(path) != stamp:
            return Unproved("its file was replaced while it was read")
        declared = {output.name: output.type for output in model.graph.output}
        _forget_shapes(model)
        _fix_inputs(model, signature)
        inferred_model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as exc:  # an operator or file onnx cannot read: nothing proved
        return Unproved(f"ONNX shape inference failed on the graph ({type(exc).__name__}: {exc})")
    inferred = {output.name: output.type for output in inferred_model.graph.output}
    for spec in signature.outputs:
        got = inferred.get(spec.name)
        want = declared.get(spec.name)
        if got is None or want is None or not got.HasField("tensor_type"):
            return Unproved(f"shape inference says nothing of output {spec.name!r}")
        tensor = got.tensor_type
        if tensor.elem_type != want.tensor_type.elem_type:
            return Unproved(
                f"shape inference types output {spec.name!r} otherwise than its declaration", True
            )
        if not tensor.HasField("shape"):
            return Unproved(f"shape inference leaves the rank of output {spec.name!r} open")
        dims = [_dim(dim) for dim in tensor.shape.dim]
        if len(dims) != spec.rank:
            return _lie(spec.name, spec.describe(), dims)
        for axis, (fixed, size) in enumerate(zip(spec.shape, dims, strict=True)):
            if isinstance(fixed, int) and not isinstance(fixed, bool) and fixed >= 0:
                if not isinstance(size, int):
                    return Unproved(
                        f"shape inference leaves size {axis} of output {spec.name!r} open, "
                        f"which the signature declares {fixed}"
                    )
                if size != fixed:
                    return _lie(spec.name, spec.describe(), dims)
    return None


def _forget_shapes(model: Any) -> None:
    # Inference merges what it computes with every shape the file declares on the way,
    # keeping a declared size where it computes none: a lie told again in value_info or
    # in a subgraph's (an If branch's, a Loop body's) inputs and outputs would prove
    # itself. So only the graph's inputs keep theirs (ONNX Runtime holds requests to
    # them); the rest is computed from those or not known.
    top = model.graph
    for value in [*top.value_info, *top.output]:
        _forget_shape(value.type)
    graphs = _subgraphs(top.node)
    for function in model.functions:
        for value in getattr(function, "value_info", ()):  # IR 10 and later
            _forget_shape(value.type)
        graphs.extend(_subgraphs(function.node))
    while graphs:
        graph = graphs.pop()
        for value in [*graph.value_info, *graph.output, *graph.input]:
            _forget_shape(value.type)
        graphs.extend(_subgraphs(graph.node))


def _forget_shape(kind: Any) -> None:
    # The shape of a tensor, or of the tensors a sequence, optional or map holds;
    # through WhichOneof, as touching tensor_type would make a sequence type a tensor's.
    while kind is not None:
        which = kind.WhichOneof("value")
        if which == "tensor_type":
            kind.tensor_type.ClearField("shape")
        if which in ("sequence_type", "optional_type"):
            kind = getattr(kind, which).elem_type
        elif which == "map_type":
            kind = kind.map_type.value_type
        else:
            kind = None


def _subgraphs(nodes: Any) -> list[Any]:
    return [
        graph
        for node in nodes
        for attribute in node.attribute
        for graph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs)
    ]


def _fix_inputs(model: Any, signature: ModelSignature) -> None:
    # Inference starts from the sizes the signature fixes, not only the graph's: the
    # engine refuses any request of another size (a config's narrowed inputs).
    shapes = {spec.name: spec.shape for spec in signature.inputs}
    for tensor in model.graph.input:
        shape = shapes.get(tensor.name)
        kind = tensor.type.tensor_type
        if shape is None or not kind.HasField("shape") or len(kind.shape.dim) != len(shape):
            continue
        for dim, size in zip(kind.shape.dim, shape, strict=True):
            if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
                dim.dim_value = size  # dim_param and dim_value are one field (a oneof)


def _dim(dim: Any) -> int | str | None:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    return dim.dim_param or None


def _lie(name: str, declared: str, dims: list[int | str | None]) -> Unproved:
    computed = ", ".join("?" if d is None else str(d) for d in dims)
    return Unproved(
        f"the signature declares output {name!r} {declared}, but its operators compute "
        f"[{computed}]",
        True,
    )
