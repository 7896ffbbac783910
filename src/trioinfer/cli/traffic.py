"""``trioinfer traffic``: read or change a running server's split of traffic between versions.

It speaks HTTP to the server (the standard library's client, so the core
install is enough): ``GET /v2/models/{model}/traffic`` reads the split in
force, and a repository load with a ``{"traffic": ...}`` config override
changes it. Changing the split drops no request: the new weights apply from
the next request on, and requests already routed finish on their version.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import click

from ._params import Seconds

#: Seconds to wait for each answer of the server, unless --timeout says otherwise. A load
#: that changes only the split is quick, but it waits for any load of the model already in
#: progress: a reload lets the replaced version's requests and streams finish first, for up
#: to the server's drain period.
TIMEOUT_S = 30.0


def _weight(text: str) -> tuple[int, float]:
    version, sep, weight = text.partition("=")
    try:
        number, value = int(version), float(weight)
    except ValueError:
        number, value = -1, math.nan
    if not sep or number < 1 or not (value >= 0 and math.isfinite(value)):
        raise click.BadParameter(
            f"{text!r} is not VERSION=WEIGHT (a version number >= 1 and a weight >= 0, "
            "e.g. 1=90 2=10)",
            param_hint="VERSION=WEIGHT",
        )
    return number, value


@click.command(short_help="Read or change a running server's traffic split between versions.")
@click.argument("model")
@click.argument("weights", nargs=-1, metavar="[VERSION=WEIGHT]...")
@click.option(
    "--promote",
    type=click.IntRange(min=1),
    default=None,
    metavar="VERSION",
    help="Send every request that names no version to VERSION (weight 100, the others 0).",
)
@click.option(
    "--rollback",
    type=click.IntRange(min=1),
    default=None,
    metavar="VERSION",
    help="Take VERSION out of the split (weight 0): the other versions keep their "
    "weights relative to each other, or, if VERSION had all the traffic, the highest "
    "served version below it gets it all (with none below it, the highest other one).",
)
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="The server's base URL.",
)
@click.option(
    "--timeout",
    type=Seconds(never=True),
    default=TIMEOUT_S,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for each answer of the server. A change waits for any load of "
    "the model already in progress there (a reload lets the replaced version's requests "
    "and streams finish first, for up to the server's --drain-period); give more than "
    "that, or inf to wait as long as it takes.",
)
@click.option(
    "--token",
    envvar="TRIOINFER_ADMIN_TOKEN",
    default=None,
    metavar="TOKEN",
    help="The server's admin token, if it has one (also read from $TRIOINFER_ADMIN_TOKEN).",
)
def traffic(
    model: str,
    weights: tuple[str, ...],
    promote: int | None,
    rollback: int | None,
    url: str,
    timeout: float,
    token: str | None,
) -> None:
    """Show MODEL's traffic split on a running server, or change it.

    With no weights, prints each served version's share of the requests that
    name no version. "trioinfer traffic digits 1=90 2=10" sends 90% to
    version 1 and 10% to version 2 (weights are relative; a version left out
    gets none); --promote 2 sends all to version 2; --rollback 2 takes
    version 2 out and leaves the others as they were. Requests that name a
    version still get it, and one with a trioinfer-routing-key header stays
    on one version while the weights stay. The change goes through the
    repository API (a load whose config override is only "traffic"), which
    drops no request; it reloads no version, unless an earlier load gave
    the model other override keys, which this load (like any) replaces. The
    weights hold until the next change or the next load of the model (which
    reads config.toml's traffic again).

    The change waits for any load of the model already in progress on the
    server; --timeout bounds each wait for the server's answer. A change the
    command gave up waiting for is not withdrawn: the server makes it when
    the load before it ends.

    Exit status: 0 when done, 1 when the server refused, could not be
    reached or did not answer within --timeout (its message is printed), 2
    for invalid arguments.
    """
    chosen = [name for name, given in (("weights", weights), ("--promote", promote),
                                       ("--rollback", rollback)) if given]  # fmt: skip
    if len(chosen) > 1:
        raise click.UsageError(
            f"give one of weights, --promote, --rollback; got {' and '.join(chosen)}"
        )
    server = _Server(url.rstrip("/"), token, timeout)
    split: dict[int, float] | None = None
    if weights:
        split = {}
        for text in weights:
            version, weight = _weight(text)
            if version in split:
                raise click.BadParameter(
                    f"version {version} is given twice", param_hint="VERSION=WEIGHT"
                )
            split[version] = weight
        if not any(split.values()):
            raise click.BadParameter(
                "every weight is 0; give at least one version some traffic",
                param_hint="VERSION=WEIGHT",
            )
    elif promote is not None:
        split = {promote: 100.0}
    elif rollback is not None:
        now, served = server.split(model), server.versions(model)
        if rollback not in served:
            raise click.ClickException(
                f"model {model!r} has no served version {rollback}; served versions: "
                f"{', '.join(map(str, served))}"
            )
        split = {v: share for v, share in now.items() if v != rollback}
        if not split:
            # It had everything (promoted): back to the version before it.
            others = [v for v in served if v != rollback]
            if not others:
                raise click.ClickException(
                    f"version {rollback} is the only served version of model {model!r}: "
                    "there is no version to roll back to"
                )
            below = [v for v in others if v < rollback]
            split = {max(below or others): 100.0}
    if split is not None:
        server.set_split(model, split)
    click.echo(f"{model}: {_shown(server.split(model))}")


def _shown(split: dict[int, float]) -> str:
    return ", ".join(f"version {v} {share:.1%}" for v, share in sorted(split.items()))


class _Server:
    """The few requests `traffic` makes, with the server's error messages as ClickExceptions."""

    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            # HOST:PORT alone, as `trioinfer bench --url` takes it, says how to write it.
            hint = f" (write http://{url})" if "://" not in url else ""
            raise click.BadParameter(
                f"{url!r} is not an http:// or https:// URL{hint}", param_hint="--url"
            )
        self.url = url
        self.token = token
        # urllib's timeout bounds each wait on the socket; None waits without one.
        self.timeout = None if math.isinf(timeout) else timeout
        self._timeout_text = f"--timeout {timeout:g} s"

    def split(self, model: str) -> dict[int, float]:
        answer = self._request("GET", f"/v2/models/{_quoted(model)}/traffic")
        return {int(v): float(share) for v, share in answer["traffic"].items()}

    def versions(self, model: str) -> list[int]:
        answer = self._request("GET", f"/v2/models/{_quoted(model)}/traffic")
        return sorted(int(v) for v in answer["versions"])

    def set_split(self, model: str, split: dict[int, float]) -> None:
        override = json.dumps({"traffic": {str(v): w for v, w in sorted(split.items())}})
        self._request(
            "POST",
            f"/v2/repository/models/{_quoted(model)}/load",
            {"parameters": {"config": override}},
            late=(
                f"the server is most likely waiting for a load of model {model!r} already in "
                "progress to end before it changes the split (a reload lets the replaced "
                "version's requests and streams finish first, for up to the server's "
                "--drain-period). The change is not withdrawn: the server makes it when "
                "that load ends. Run "
                f"'trioinfer traffic {model}' to see the split in force, or give a longer "
                "--timeout (inf waits as long as it takes)"
            ),
        )

    def _request(self, method: str, path: str, body: Any = None, late: str = "") -> Any:
        headers = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            raise click.ClickException(
                f"{method} {path}: {exc.code} {_message(exc.read()) or exc.reason}"
            ) from exc
        except TimeoutError as exc:
            # Connected and sent, then no answer in time (a timeout while connecting
            # comes as a URLError: the server cannot be reached).
            raise click.ClickException(
                f"{method} {path}: no answer within {self._timeout_text}"
                + (f": {late}" if late else "")
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise click.ClickException(f"cannot reach {self.url}: {reason}") from exc
        return json.loads(text) if text else None


def _quoted(model: str) -> str:
    return urllib.parse.quote(model, safe="")


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]
