"""Request headers forwarded to the model as string parameters, as Triton forwards them.

``--http-header-forward-pattern`` and ``--grpc-header-forward-pattern`` name a
regular expression; each header of an HTTP request (infer, generate,
generate_stream), or each metadata key of a gRPC call (ModelInfer,
ModelStreamInfer), whose name it matches reaches the model as a string
parameter of that name. As Triton's:

- the pattern is searched for anywhere in the name (RE2's ``PartialMatch``;
  anchor it with ``^...$`` for whole names), case-insensitively as HTTP reads
  header names; a leading ``(?-i)`` turns that off. The names arrive in lower
  case (HTTP/1.1 as this server reads them, and gRPC metadata always), so a
  case-sensitive pattern matches lower-case names only;
- an empty pattern forwards nothing (the default);
- a forwarded header wins over a body parameter of the same name (Triton adds
  the headers after the body's parameters, and the later value is the one a
  Python model reads).

Never forwarded: HTTP/2's pseudo-headers (``:path``) and gRPC's own
``grpc-*`` names (the transport's, not the client's), binary ``-bin``
metadata (a parameter is a string; its bytes would not survive), and the
names of the parameters the server reads itself (``priority``, ``timeout``,
``sequence_*``, ``headers``, ``binary_data_output``, any ``triton_*``): a
header cannot set them, and the model never sees them, as a body's. An HTTP
header sent more than once is forwarded once, its values joined with ``", "``
(RFC 9110 5.3); a repeated gRPC key keeps its last value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .._exceptions import ConfigError

#: The switch Triton's (RE2's) patterns use to match case-sensitively; Python's ``re``
#: only knows it scoped (``(?-i:...)``), so it is read here.
_CASE_SENSITIVE = "(?-i)"


def forward_regex(pattern: object, *, option: str) -> re.Pattern[str] | None:
    """*pattern* compiled as Triton reads a header forward pattern; None for none.

    Raises:
        ConfigError: *pattern* is not a string or not a valid regular expression,
            naming *option* (the setting's name) and what is wrong with it.
    """
    if pattern is None or pattern == "":
        return None  # Triton's empty pattern: nothing is forwarded
    if not isinstance(pattern, str):
        raise ConfigError(f"{option} must be a regular expression (a string), got {pattern!r}")
    flags = re.IGNORECASE
    text = pattern
    if text.startswith(_CASE_SENSITIVE):
        text = text.removeprefix(_CASE_SENSITIVE)
        flags = re.NOFLAG
    try:
        return re.compile(text, flags)
    except re.error as exc:
        raise ConfigError(
            f"{option} {pattern!r} is not a valid regular expression: {exc} (a Python "
            f"regular expression, matched against header names case-insensitively; "
            f"{_CASE_SENSITIVE} at its start makes it case-sensitive, as Triton's)"
        ) from None


def forwarded_headers(
    regex: re.Pattern[str], headers: Iterable[tuple[str, str]], reserved: frozenset[str]
) -> dict[str, str] | None:
    """The headers (lower-case name, value) whose names *regex* matches, as parameters.

    None when none matches. *reserved* are the parameter names the server reads
    itself, which no header may set (with every ``triton_*`` one).
    """
    found: dict[str, str] = {}
    search = regex.search
    for name, value in headers:
        if (
            name.startswith((":", "grpc-", "triton_"))
            or name.endswith("-bin")
            or name in reserved
            or search(name) is None
        ):
            continue
        before = found.get(name)
        found[name] = value if before is None else f"{before}, {value}"
    return found or None
