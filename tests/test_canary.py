"""Weighted traffic between a model's versions: a canary, sticky keys, promote, roll back."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import trioinfer
from _serve import start_serving
from trioinfer import ConfigError, example_repository
from trioinfer.server._repository import parse_traffic

pytestmark = pytest.mark.canary

T = TypeVar("T")

ROW = trioinfer.digits_samples()[0][:1]
BODY = {
    "inputs": [
        {"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ROW.ravel().tolist()}
    ]
}


def repository(tmp_path: Path, traffic: str = '{ "1" = 90, "2" = 10 }') -> Path:
    """digits in versions 1 and 2, both served, split by *traffic*."""
    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    shutil.copytree(repo / "digits" / "1", repo / "digits" / "2")
    toml = repo / "digits" / "config.toml"
    toml.write_text(f'version_policy = "all"\ntraffic = {traffic}\n' + toml.read_text())
    return repo


async def serving(repo: Path, nursery: trio.Nursery) -> tuple[str, Any]:
    listening = await start_serving(nursery, repo)
    return listening.urls[0], listening


async def versions_of(client: httpx.AsyncClient, n: int, **headers: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for _ in range(n):
        answer = await client.post("/v2/models/digits/infer", json=BODY, headers=headers)
        assert answer.status_code == 200, answer.text
        counts[answer.json()["model_version"]] += 1
    return counts


def test_the_split_follows_the_weights_within_a_tolerance() -> None:
    from trioinfer.server._models import ServedModels

    served = ServedModels.__new__(ServedModels)  # only the routing table, no engine
    served._traffic = {}
    served.rng = random.Random(1)
    served._served = {"m": {1: "v1", 2: "v2", 3: "v3"}}  # type: ignore[dict-item]
    served._set_traffic("m", {1: 90, 2: 10, 3: 0})
    counts = Counter(served.resolve("m") for _ in range(10_000))
    assert set(counts) == {"v1", "v2"}  # weight 0: none
    assert counts["v2"] == pytest.approx(1_000, abs=100)  # 10% of 10,000, seeded
    assert served.traffic("m") == {1: 0.9, 2: 0.1}
    # A key picks one version, the same every time, and keys spread by the weights.
    assert len({served.resolve("m", key="alice") for _ in range(100)}) == 1
    keyed = Counter(served.resolve("m", key=f"user-{i}") for i in range(10_000))
    assert keyed["v2"] == pytest.approx(1_000, abs=150)
    # A version named in the request is that version, whatever the split.
    assert served.resolve("m", "3") == "v3"


def test_a_routing_key_hashed_to_the_top_of_the_range_still_picks_a_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A key whose 64-bit hash is within 2**10 of 2**64 read as 1.0 (a float rounds
    # it): past the split's last bound, an IndexError (a 500) for that user always.
    from trioinfer.server import _models
    from trioinfer.server._models import ServedModels

    class Top:
        def __init__(self, *_: object, **__: object) -> None: ...

        def digest(self) -> bytes:
            return b"\xff" * 8

    monkeypatch.setattr(_models.hashlib, "blake2b", Top)
    served = ServedModels.__new__(ServedModels)
    served._traffic = {}
    served._served = {"m": {1: "v1", 2: "v2"}}  # type: ignore[dict-item]
    served._set_traffic("m", {1: 50, 2: 50})
    assert served.resolve("m", key="unlucky") == "v2"


def test_weights_near_a_floats_limit_still_split() -> None:
    # 1e308 + 1e308 is infinity: the split read as {1: 0.0, 2: NaN} and every request
    # to the model failed with a 500 (IndexError) while picking its version.
    from trioinfer.server._models import ServedModels

    served = ServedModels.__new__(ServedModels)  # only the routing table, no engine
    served._traffic = {}
    served.rng = random.Random(1)
    served._served = {"m": {1: "v1", 2: "v2"}}  # type: ignore[dict-item]
    served._set_traffic("m", parse_traffic({"1": 1e308, "2": 1e308}))
    assert served.traffic("m") == {1: 0.5, 2: 0.5}
    assert Counter(served.resolve("m") for _ in range(100)).keys() == {"v1", "v2"}
    assert served.resolve("m", key="alice") in ("v1", "v2")


async def test_a_canary_over_http_and_its_promotion(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    async with trio.open_nursery() as nursery:
        url, _ = await serving(repo, nursery)
        async with httpx.AsyncClient(base_url=url) as client:
            split = await versions_of(client, 400)
            sticky = await versions_of(client, 50, **{"trioinfer-routing-key": "tenant-42"})
            # Promote: one load override sends everything to version 2.
            promoted = await client.post(
                "/v2/repository/models/digits/load",
                json={"parameters": {"config": '{"traffic": {"2": 100}}'}},
            )
            after = await versions_of(client, 50)
            named = (await client.post("/v2/models/digits/versions/1/infer", json=BODY)).json()[
                "model_version"
            ]
            refused = await client.post(
                "/v2/repository/models/digits/load",
                json={"parameters": {"config": '{"traffic": {"7": 100}}'}},
            )
            stats = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    assert 300 <= split["1"] <= 390  # 90% of 400, at random
    assert len(sticky) == 1
    assert promoted.status_code == 200, promoted.text
    assert after == {"2": 50}
    assert named == "1"  # a request that names its version gets it
    assert refused.status_code == 400
    assert "traffic names version 7, which is not served" in refused.json()["error"]
    assert 'version="2"' in stats  # per-version metrics to judge the rollout by


async def statuses_under_load(
    tmp_path: Path,
    requests: int,
    changes: Sequence[T],
    change: Callable[[httpx.AsyncClient, str, T], Awaitable[None]],
) -> Counter[int]:
    """Serve version 1 alone to 8 clients posting *requests* requests each, calling
    *change* for each of *changes* meanwhile; the statuses of their answers, counted."""
    repo = repository(tmp_path, '{ "1" = 100 }')
    outcomes: Counter[int] = Counter()
    async with trio.open_nursery() as nursery:
        url, _ = await serving(repo, nursery)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def load() -> None:
                for _ in range(requests):
                    answer = await client.post("/v2/models/digits/infer", json=BODY)
                    outcomes[answer.status_code] += 1

            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(load)
                for each in changes:
                    await trio.sleep(0.05)
                    await change(client, url, each)
        nursery.cancel_scope.cancel()
    return outcomes


async def test_a_failed_request_is_counted_on_the_version_that_served_it(tmp_path: Path) -> None:
    # The metrics picked the version of a failed request again, at random by the weights:
    # a canary failing every request showed most of its failures on the stable version.
    repo = repository(tmp_path, '{ "1" = 50, "2" = 50 }')
    key = {"trioinfer-routing-key": "tenant-7"}
    bad = {"inputs": [{"name": "input", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    async with trio.open_nursery() as nursery:
        url, _ = await serving(repo, nursery)
        async with httpx.AsyncClient(base_url=url) as client:
            (version,) = await versions_of(client, 1, **key)
            for _ in range(20):
                answer = await client.post("/v2/models/digits/infer", json=bad, headers=key)
                assert answer.status_code == 400
            scraped = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    invalid = {
        v: f'trioinfer_inference_requests_total{{model="digits",outcome="invalid_input",'
        f'version="{v}"}}'
        for v in ("1", "2")
    }
    lines = scraped.splitlines()
    counted = {
        v: sum(float(x.split()[-1]) for x in lines if x.startswith(s)) for v, s in invalid.items()
    }
    assert counted == {version: 20.0, "2" if version == "1" else "1": 0.0}


async def test_changing_the_weights_under_load_loses_no_request(tmp_path: Path) -> None:
    async def reload(client: httpx.AsyncClient, url: str, weights: str) -> None:
        answer = await client.post(
            "/v2/repository/models/digits/load",
            json={"parameters": {"config": f'{{"traffic": {weights}}}'}},
        )
        assert answer.status_code == 200, answer.text

    weights = ('{"1": 50, "2": 50}', '{"2": 100}', '{"1": 100}')
    assert await statuses_under_load(tmp_path, 40, weights, reload) == {200: 320}


async def test_a_model_being_unloaded_routes_no_request_to_a_version_gone_already() -> None:
    # unload() drains its versions one after another (version 1's in-flight requests
    # first) while the split still named them all: a request the split sent to
    # version 1, no longer served, failed with a 500 (KeyError), not version 2's answer.
    from trioinfer.server._models import ServedModels

    draining = trio.Event()
    release = trio.Event()

    class Engine:
        async def unload(self, name: str) -> None:
            if name == "m.v1":
                draining.set()
                await release.wait()

    served = ServedModels.__new__(ServedModels)
    served.engine = Engine()  # type: ignore[assignment]
    served._traffic = {}
    served._locks = {}
    served._errors = {}
    served.last_inference_ms = {}
    served.rng = random.Random(1)
    served._served = {"m": {1: _fake_version(1), 2: _fake_version(2)}}
    served._set_traffic("m", {1: 50, 2: 50})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served.unload, "m")
        await draining.wait()
        picked = {served.resolve("m").version for _ in range(100)}
        keyed = {served.resolve("m", key=f"user-{i}").version for i in range(100)}
        release.set()
    assert picked == keyed == {2}
    assert served.traffic("m") == {}  # and no split is left behind for the model


def _fake_version(number: int) -> Any:
    # A served version as far as routing and unloading look: its model, number and name.
    from trioinfer.server._models import ServedVersion

    return ServedVersion(  # type: ignore[arg-type]
        "m", number, f"m.v{number}", (), None, None, None, {}, None, None
    )


async def test_a_version_retired_while_a_request_body_arrives_is_routed_around(
    tmp_path: Path,
) -> None:
    # Version 1 was picked when the request's headers came; retiring it (the rollout's
    # last step) before its body had come answered 404 "no model named 'digits'
    # (version 1) is loaded", for a request that named no version.
    repo = repository(tmp_path, '{ "1" = 100 }')
    text = json.dumps(BODY).encode()
    started, go = trio.Event(), trio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield text[:10]
        started.set()
        await go.wait()
        yield text[10:]

    answers: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:
        url, _ = await serving(repo, nursery)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:

            async def post() -> None:
                answers.append(await client.post("/v2/models/digits/infer", content=body()))

            async with trio.open_nursery() as posting:
                posting.start_soon(post)
                await started.wait()
                await trio.sleep(0.2)  # the server routes it meanwhile (no timing asserted)
                toml = repo / "digits" / "config.toml"
                toml.write_text(
                    toml.read_text().replace(
                        'version_policy = "all"\ntraffic = { "1" = 100 }',
                        "version_policy = { specific = [2] }",
                    )
                )
                retired = await client.post("/v2/repository/models/digits/load")
                go.set()
        nursery.cancel_scope.cancel()
    assert retired.status_code == 200, retired.text
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["model_version"] == "2"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1], "traffic must be a table of version = weight"),
        ({"x": 1}, "'x' is not a version number"),
        # str.isdigit() holds for these, but int() refuses the first (a 500 from a load
        # override) and reads the second as 1, a version no URL can name.
        ({"\u00b2": 1}, "is not a version number"),
        ({"\uff11": 1}, "is not a version number"),
        ({"1" * 5000: 1}, "is not a version number"),  # past int()'s 4300 digits: a 500
        ({"9" * 19: 1}, "is not a version number"),  # past 2**63-1, as a directory's
        ({"1": -1}, "version 1 needs a finite weight >= 0"),
        ({"1": True}, "version 1 needs a finite weight >= 0"),
        ({"1": float("inf")}, "version 1 needs a finite weight >= 0"),
        ({"1": 10**400}, "version 1 needs a finite weight >= 0"),
        ({"1": 0, "2": 0}, "every weight is 0"),
    ],
)
def test_traffic_is_validated(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_traffic(value)


def test_an_unserved_version_in_the_file_is_refused_at_load(tmp_path: Path) -> None:
    repo = repository(tmp_path, '{ "1" = 50, "3" = 50 }')

    async def main() -> tuple[str, ...]:
        async with trio.open_nursery() as nursery:
            _, listening = await serving(repo, nursery)
            nursery.cancel_scope.cancel()
        return tuple(listening.failed)

    assert trio.run(main) == ("digits",)


# -- trioinfer traffic: the split from the command line ----------------------------------------


def traffic_cli(*args: str, env: dict[str, str] | None = None) -> Any:
    from click.testing import CliRunner

    from trioinfer.cli import main

    return CliRunner().invoke(main, ["traffic", *args], env=env or {"TRIOINFER_ADMIN_TOKEN": ""})


async def test_the_traffic_command_shows_sets_promotes_and_rolls_back(tmp_path: Path) -> None:
    repo = repository(tmp_path, '{ "1" = 90, "2" = 10 }')
    async with trio.open_nursery() as nursery:
        url, _ = await serving(repo, nursery)

        async def run(*args: str) -> Any:
            return await trio.to_thread.run_sync(lambda: traffic_cli(*args, "--url", url))

        shown = await run("digits")
        half = await run("digits", "1=1", "2=1")
        async with httpx.AsyncClient(base_url=url) as client:
            split = await versions_of(client, 200)
            promoted = await run("digits", "--promote", "2")
            after_promote = await versions_of(client, 20)
            rolled_back = await run("digits", "--rollback", "2")
            after_rollback = await versions_of(client, 20)
            named = await client.post("/v2/models/digits/versions/2/infer", json=BODY)
        canary = await run("digits", "1=80", "2=20")
        canary_out = await run("digits", "--rollback", "2")
        not_served = await run("digits", "--rollback", "5")
        unserved = await run("digits", "1=50", "7=50")
        unknown = await run("nope")
        bad = await run("digits", "1=lots")
        both = await run("digits", "1=1", "--promote", "2")
        nursery.cancel_scope.cancel()
    assert shown.exit_code == 0, shown.output
    assert shown.output == "digits: version 1 90.0%, version 2 10.0%\n"
    assert half.output == "digits: version 1 50.0%, version 2 50.0%\n"
    assert 60 <= split["1"] <= 140  # half of 200, at random
    assert promoted.output == "digits: version 2 100.0%\n"
    assert after_promote == {"2": 20}
    assert rolled_back.exit_code == 0, rolled_back.output
    assert rolled_back.output == "digits: version 1 100.0%\n"
    assert after_rollback == {"1": 20}
    assert named.json()["model_version"] == "2"  # a named version is still served
    assert canary.exit_code == 0, canary.output
    assert canary_out.output == "digits: version 1 100.0%\n"
    assert not_served.exit_code == 1
    assert "model 'digits' has no served version 5; served versions: 1, 2" in not_served.output
    assert unserved.exit_code == 1
    assert (
        "400 failed to load 'digits': model 'digits': traffic names version 7, which is not served"
        in unserved.output
    )
    assert unknown.exit_code == 1
    assert "404 Request for unknown model: 'nope' is not served" in unknown.output
    assert bad.exit_code == 2
    assert "'1=lots' is not VERSION=WEIGHT" in bad.output
    assert both.exit_code == 2
    assert "give one of weights, --promote, --rollback" in both.output


async def test_the_traffic_command_needs_the_admin_token(tmp_path: Path) -> None:
    from trioinfer.server import ServerConfig

    repo = repository(tmp_path)
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo, config=ServerConfig(admin_token="s3cret"))
        url = listening.urls[0]

        async def run(*args: str, env: dict[str, str] | None = None) -> Any:
            return await trio.to_thread.run_sync(
                lambda: traffic_cli("digits", *args, "--url", url, env=env)
            )

        refused = await run("--promote", "2")
        by_option = await run("--promote", "2", "--token", "s3cret")
        by_variable = await run("--rollback", "2", env={"TRIOINFER_ADMIN_TOKEN": "s3cret"})
        nursery.cancel_scope.cancel()
    assert refused.exit_code == 1
    assert "401" in refused.output
    assert by_option.output == "digits: version 2 100.0%\n"
    assert by_variable.output == "digits: version 1 100.0%\n"  # back to the one before


async def test_the_traffic_command_under_load_loses_no_request(tmp_path: Path) -> None:
    async def command(client: httpx.AsyncClient, url: str, args: tuple[str, ...]) -> None:
        done = await trio.to_thread.run_sync(lambda: traffic_cli("digits", *args, "--url", url))
        assert done.exit_code == 0, done.output

    changes = (("1=50", "2=50"), ("--promote", "2"), ("--rollback", "2"))
    assert await statuses_under_load(tmp_path, 30, changes, command) == {200: 240}


@pytest.mark.parametrize(
    "weights", [("1=lots",), ("1=5", "1=6"), ("1=0", "2=0")], ids=["bad", "twice", "zeros"]
)
def test_the_traffic_commands_weight_errors_name_what_the_usage_line_shows(
    weights: tuple[str, ...],
) -> None:
    # They said "Invalid value for WEIGHTS", a name the usage line
    # ("MODEL [VERSION=WEIGHT]...") and the help never show.
    result = traffic_cli("digits", *weights, "--url", "http://127.0.0.1:9")
    assert result.exit_code == 2
    assert "Invalid value for VERSION=WEIGHT: " in result.output


def test_the_traffic_command_cannot_reach_a_server() -> None:
    result = traffic_cli("digits", "--url", "http://127.0.0.1:9")
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.output
    result = traffic_cli("digits", "--url", "ftp://x")
    assert result.exit_code == 2
    assert "(write http://" not in result.output
    # HOST:PORT alone, as bench --url takes it: refused, saying how to write it.
    result = traffic_cli("digits", "--url", "127.0.0.1:9")
    assert result.exit_code == 2
    assert "'127.0.0.1:9' is not an http:// or https:// URL (write http://127.0.0.1:9)" in (
        " ".join(result.output.split())
    )
    for timeout in ("0", "-1", "nan"):
        result = traffic_cli("digits", "--timeout", timeout, "--url", "http://127.0.0.1:9")
        assert result.exit_code == 2, (timeout, result.output)
        assert "--timeout" in result.output
    # inf: no limit (nothing listens here, so the answer is at once)
    result = traffic_cli("digits", "--timeout", "inf", "--url", "http://127.0.0.1:9")
    assert result.exit_code == 1
    assert "cannot reach http://127.0.0.1:9" in result.output


@pytest.mark.streaming
async def test_the_traffic_command_waits_for_a_reload_as_long_as_its_timeout(
    tmp_path: Path,
) -> None:
    """A change queued behind a reload draining an open stream: --timeout bounds the wait,
    its message names it, and the change still takes effect when the reload ends."""
    import sys

    import test_streaming_http as streams
    from trioinfer.server import ServerConfig

    repo = tmp_path / "repo"
    for version in (1, 2):
        (repo / "watched" / str(version)).mkdir(parents=True)
        (repo / "watched" / str(version) / "model.py").write_text(streams.WATCHED)
    (repo / "watched" / "config.toml").write_text(
        'version_policy = "all"\nbackend = "python"\n[backend_options]\ndecoupled = true\n'
        + streams.SIGNATURE
    )
    sys.modules[streams.PROBE] = watched = streams.probe()
    try:
        async with trio.open_nursery() as nursery:
            listening = await start_serving(nursery, repo, config=ServerConfig(drain_period=60.0))
            url = listening.urls[0]
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                # A stream on version 1 that holds its 4th response until let go.
                async with client.stream(
                    "POST", "/v2/models/watched/versions/1/generate_stream", json={"n": 5}
                ) as stream:
                    with trio.fail_after(10):
                        await watched.holding.wait()
                    # A reload (the file changed): it waits for the open stream to end.
                    changed = streams.WATCHED + "\nprobe.imported = True\n"
                    (repo / "watched" / "1" / "model.py").write_text(changed)
                    reloaded: list[int] = []

                    async def reload() -> None:
                        answer = await client.post("/v2/repository/models/watched/load")
                        reloaded.append(answer.status_code)

                    nursery.start_soon(reload)
                    with trio.fail_after(10):  # the reload holds the model's loads from here
                        while not getattr(watched, "imported", False):  # noqa: ASYNC110
                            await trio.sleep(0.01)
                    late = await trio.to_thread.run_sync(
                        lambda: traffic_cli(
                            "watched", "1=1", "2=3", "--url", url, "--timeout", "0.5"
                        )
                    )
                    watched.go_on.set()  # the stream ends; so does the reload
                    text = await stream.aread()

                async def split() -> Any:
                    return (await client.get("/v2/models/watched/traffic")).json()["traffic"]

                # The change sent by the command that gave up applies once the reload ends.
                with trio.fail_after(10):
                    while await split() != {"1": 0.25, "2": 0.75}:  # noqa: ASYNC110 - no event
                        await trio.sleep(0.01)
            prompt = await trio.to_thread.run_sync(
                lambda: traffic_cli("watched", "--promote", "2", "--url", url)
            )
            nursery.cancel_scope.cancel()
    finally:
        del sys.modules[streams.PROBE]
    assert [e["i"] for e in streams.events(text.decode())] == [0, 1, 2, 3, 4]
    assert reloaded == [200]
    assert late.exit_code == 1
    assert "no answer within --timeout 0.5 s" in late.output
    assert "waiting for a load of model 'watched' already in progress" in late.output
    assert "cannot reach" not in late.output
    assert prompt.exit_code == 0, prompt.output
    assert prompt.output == "watched: version 2 100.0%\n"


async def test_a_request_refused_before_routing_is_counted_on_no_version(tmp_path: Path) -> None:
    # A body that cannot be read as a request, or inputs refused before any version's
    # signature is looked at, reach no version: under a split they were counted on one
    # drawn at random (a canary's error share was the stable one's noise). They count
    # on the model, with no version, over HTTP and gRPC alike; what a version refuses
    # (its signature's shapes) counts on it.
    import grpc
    from tritonclient.grpc import service_pb2

    repo = repository(tmp_path, '{ "1" = 50, "2" = 50 }')
    bad_input = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [1]}]}
    grpc_bad = service_pb2.ModelInferRequest(model_name="digits")
    grpc_bad.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    grpc_bad.raw_input_contents.append(b"\x00" * 31)  # not 64 floats
    grpc_typo = service_pb2.ModelInferRequest(model_name="digits")
    grpc_typo.inputs.add(name="input", datatype="FLOAT", shape=[1, 64])  # no such datatype
    grpc_typo.raw_input_contents.append(b"\x00" * 256)

    def grpc_infer(where: str, body: bytes) -> grpc.StatusCode:
        with grpc.insecure_channel(where) as channel:
            method = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            try:
                method(body, timeout=30)
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo, grpc_port=0)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            for _ in range(10):
                answer = await client.post("/v2/models/digits/infer", content=b"{not json")
                assert answer.status_code == 400
                answer = await client.post("/v2/models/digits/infer", json=bad_input)
                assert answer.status_code == 400
                for body in (grpc_bad.SerializeToString(), grpc_typo.SerializeToString()):
                    code = await trio.to_thread.run_sync(grpc_infer, listening.grpc, body)
                    assert code == grpc.StatusCode.INVALID_ARGUMENT
            scraped = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    counted = {
        s.labels["version"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "trioinfer_inference_requests_total"
        and s.labels["model"] == "digits"
        and s.labels["outcome"] == "invalid_input"
    }
    assert counted == {"": 40.0}
