"""Serving over HTTP: the KServe V2 (Open Inference Protocol) server behind ``trioinfer serve``.

```python
import trio
import trioinfer.server

trio.run(trioinfer.server.serve_http, trioinfer.example_repository())
```

`serve_http` opens an engine, loads a model repository
(``<repo>/<model>/[config.toml]``, ``<repo>/<model>/<version>/model.onnx``) and
serves it over trioinfer's own HTTP/1.1 server (on Trio, or on asyncio under
``anyio.run(..., backend="asyncio")``) until SIGINT/SIGTERM. `create_app`
gives the ASGI app alone, for embedding.
"""

from ._app import ServerConfig as ServerConfig
from ._app import ServerState as ServerState
from ._app import create_app as create_app
from ._app import status_for as status_for
from ._codec import InferRequest as InferRequest
from ._codec import Limits as Limits
from ._codec import PayloadTooLarge as PayloadTooLarge
from ._codec import RequestedOutput as RequestedOutput
from ._codec import RequestError as RequestError
from ._codec import UnsupportedEncoding as UnsupportedEncoding
from ._codec import decode_infer_request as decode_infer_request
from ._codec import encode_infer_request as encode_infer_request
from ._codec import v2_datatype as v2_datatype
from ._codec import v2_numpy_dtype as v2_numpy_dtype
from ._repository import ModelRepository as ModelRepository
from ._repository import VersionPolicy as VersionPolicy
from ._serve import Listening as Listening
from ._serve import serve_http as serve_http
from ._tls import TlsFiles as TlsFiles
