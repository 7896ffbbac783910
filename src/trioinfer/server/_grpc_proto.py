"""The gRPC protocol's messages: ``grpc_service.proto`` compiled when this module is imported.

grpcio-tools' protoc turns the project's own ``grpc_service.proto`` (beside
this module) into descriptors, which go into a descriptor pool of their own:
tritonclient registers Triton's copy of the same names (``inference.*``) in
protobuf's default pool, and both must be importable in one process (the
tests use both). Compiling takes a few tens of milliseconds, once.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

#: The service's full name, as clients call it.
SERVICE: Final = "inference.GRPCInferenceService"

_PROTO: Final = Path(__file__).with_name("grpc_service.proto")


def _compile() -> descriptor_pool.DescriptorPool:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory(prefix="trioinfer-proto-") as tmp:
        out = Path(tmp) / "grpc_service.pb"
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"--proto_path={_PROTO.parent}",
                f"--descriptor_set_out={out}",
                _PROTO.name,
            ]
        )
        if code != 0:  # pragma: no cover - the file is ours and compiles; a broken install
            raise RuntimeError(f"protoc could not compile {_PROTO.name} (exit code {code})")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


POOL: Final = _compile()
FILE: Final = POOL.FindFileByName(_PROTO.name)


def message(name: str) -> Any:
    """The generated message class for ``inference.<name>`` (nested names with dots)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"inference.{name}"))


ServerLiveResponse: Final = message("ServerLiveResponse")
ServerReadyResponse: Final = message("ServerReadyResponse")
ModelReadyResponse: Final = message("ModelReadyResponse")
ServerMetadataResponse: Final = message("ServerMetadataResponse")
ModelMetadataResponse: Final = message("ModelMetadataResponse")
ModelInferRequest: Final = message("ModelInferRequest")
ModelInferResponse: Final = message("ModelInferResponse")
ModelStreamInferResponse: Final = message("ModelStreamInferResponse")
ModelConfigResponse: Final = message("ModelConfigResponse")
ModelStatisticsResponse: Final = message("ModelStatisticsResponse")
RepositoryIndexResponse: Final = message("RepositoryIndexResponse")
