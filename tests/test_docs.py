"""The docs site: its tutorial programs run, and what its pages say stays true."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

import trioinfer
import trioinfer.testing
from trioinfer_fallback import Resilient
from trioinfer_onnxruntime import OPTIONS
from trioinfer_ray import OPTIONS as RAY_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.py"))
PAGES = sorted(DOCS.rglob("*.md"))
# pymdownx.snippets' base_path in mkdocs.yml: include paths are tried against each in turn.
SNIPPET_BASES = (DOCS, ROOT)
SNIPPET = re.compile(r'^\s*--8<-- "([^"]+)"\s*$', re.MULTILINE)

# Lines each tutorial must print: the outcomes its page promises (not its timings).
EXPECTED_OUTPUT = {
    "scheduling.py": [
        "priority: ['chat-1', 'chat-2', 'search', 'default', 'report']",
        "aging: the low-priority request ran while some high-priority work was still queued",
        "queue_timeouts: the background request gave up after 30 ms in the queue",
        "deadline: ['within 10 s', 'within 30 s', 'within 50 s', 'no deadline']",
        # 0.002s away; less on a busy machine, or even past (-0.004s): a process held off
        # the CPU for a few ms between trio.fail_after and the admission. Refused all the same.
        "was refused at admission: its deadline is ",
        "refuse_late: 1 refused in the model's statistics",
        "fifo: alice's request ended 31 of 31",
        "fair: alice's request ended 2 of 31",
        "weights: of the first 16, gold 12, free 4",
    ],
    "batching.py": [
        "step 1: dynamic-max-8: 640 of 640 answers match the unbatched model",
        "step 1: dynamic-max-32: 640 of 640 answers match the unbatched model",
        "step 2: dynamic-0ms: no lone request came back before the delay: True",
        "step 2: dynamic-10ms: no lone request came back before the delay: True",
        "step 4: both answers are views of one (2, 10) array: True",
        "step 4: a copy owns its data: True",
    ],
    "ray_cluster.py": [
        "step 1: two instances, one per node",
        "; some via a failover: True",
        "step 3: a new node joins; the instance is re-created there",
    ],
    "quickstart.py": [
        "loaded 'digits' (version 1) on ['cpu']",
        "  input: float32[batch, 64]",
        "20 of 20 correct",
        "succeeded 20, failed 0, executions 20",
    ],
    "deadlines.py": [
        "step 1: answered within the scope: y has shape (1, 256)",
        "step 2: impatient caller 0 gave up after 0.1 s",
        "step 2: 4 requests, 1 execution; 4 cancelled, 0 expired",
        "step 3: gave up on BIG after",
        "6 answered in the end",
        "step 5: small request: answered during the drain",
        "step 5: BIG request: EngineClosed (still running when the drain period ended)",
        "step 5: a request after the block: EngineClosed",
    ],
    "plugin.py": [
        "ShortestJobFirst passes check_scheduler",
        "MatmulBackend passes check_backend",
        "FixedSizeBatcher passes check_batcher",
        "DefaultAnswer passes check_fallback",
        "matmul model: [[18.0, 22.0, 26.0], [18.0, 22.0, 26.0]]",
        "rows in execution order, fifo: [8, 2, 4]",
        "rows in execution order, sjf:  [2, 4, 8]",
        "rows per execution, fixed: [4, 2]",
        "failing backend, default answer: [[0.0, 0.0, 0.0, 0.0]]",
    ],
    "python_models.py": [
        "names: ['two (1.00)', 'eight (0.95)', 'two (1.00)', 'six (1.00)', 'six (1.00)', "
        "'seven (1.00)']",
        "names: 6 answered in ",  # 1 execution, or a few on a busy machine
        "pipeline: ['two', 'eight', 'two', 'six', 'six', 'seven']",
        "async model: cancelled 1 time at the caller's deadline",
        "reader: ['two', 'eight', 'two', 'six', 'six', 'seven']",
        "initial: ['e']",
    ],
    "sequences.py": [
        "sequence 1000: [0, 11, 18, 23, 26, 28, 28, 29]",
        "sequence 'speaker-b': [100, 89, 82, 77, 74, 72, 72, 71]",
        "instances: 1000 on 1 instance, 'speaker-b' on 1 instance",
        "unknown: model 'accumulator' has no sequence 42 in progress",
        "idle: sequence 7 of model 'accumulator' was released after 0.2s without a request",
    ],
    "streaming.py": [
        "stream: ended at its end; succeeded 1, in flight 0",
        "early stop: read 2, the model made 3 and stopped at its yield",
        "was stopped by Cancelled while it waited",
        "slow reader: read 6; the model was never more than 2 ahead",
        "aclose: read ['a', 'b'], the model made 3 (3) and stopped at its yield",
        "generate_stream: 200 text/event-stream; charset=utf-8",
        "  event: {'model_name': 'repeat_int32', 'model_version': '1', 'OUT': 1, 'IDX': 3}",
        "generate: 200 {'model_name': 'repeat_int32', 'model_version': '1', 'OUT': 7, 'IDX': 0}",
        "generate: 400 model 'repeat_int32' sent more than one response",
    ],
    "failover.py": [
        "instance 0: asked for cuda:0 (capacity 8), runs on",  # cpu here; cuda:0 with a GPU
        "instance 1: asked for cpu (capacity 1), runs on cpu",
        "  image 4: 6 (expected 6) from instance 0, fallbacks []",
        "  image 5: 7 (expected 7) from instance 1, fallbacks ['failover instance 1 (cpu)']",
        "  image 7: 9 (expected 9) from instance 1, fallbacks ['failover instance 1 (cpu)']",
        "  instance 0: out; executions 8, failures 3, taken out 1, re-created 0",
        "    reason: circuit breaker open after 3 consecutive failures; last: injected fault",
        "  image 8: 8 (expected 8) from instance 1, fallbacks []",
        "  instance 0 is still out: circuit open: a probe failed: injected fault",
        "requests sent while it was out were answered by instance 1: True",
        "  instance 0: serving; executions 11, failures 4, taken out 1, re-created 0",
        "  image 199: 4 (expected 4) from instance 0, fallbacks []",
        "  fallback steps taken: {'failover': 3}",
        "  instance 0: serving; executions 10, failures 3, taken out 1, re-created 1",
        "  image 8: 8 (expected 8) from instance 0, fallbacks []",
        "  image 0: BackendError: injected fault: fail_on on call 1 of 0/digits/cpu/1",
        "  image 1: CircuitOpen, retry after 30 s",
        "  instance 1: out; executions 1, failures 1, taken out 1, re-created 0",
    ],
    "serving.py": [
        "serving {'digits': (2, 3), 'mlp': (1,)} at http://127.0.0.1:",
        "health: live 200, ready 200",
        "digits: versions ['2', '3'], inputs [('input', 'FP32', [-1, 64])]",
        "digits config: max_batch_size 32, {'preferred_batch_size': [], "
        "'max_queue_delay_microseconds': 5000, 'preserve_ordering': False, "
        "'priority_levels': 0, 'default_priority_level': 0, 'priority_queue_policy': {}}",
        "mlp config: max_batch_size 0, {'scheduler': 'fifo', 'batcher': 'none',",
        "infer: labels [2, 8, 2, 6], expected [2, 8, 2, 6]",
        "infer: version 2 answered [2, 8, 2, 6]",
        "binary: INT64 [4], {'binary_data_size': 32}",
        "binary: labels [2, 8, 2, 6], expected [2, 8, 2, 6]",
        "batching: 32 one-row requests ran in",
        "digits   1 UNAVAILABLE  not served: version_policy = { latest = 2 } serves versions 2, 3",
        "slow     1 UNAVAILABLE  unloaded",
        "load slow: 200",
        "load digits again: 200, now serving versions ['3', '4']",
        "timeout: 504 the request's timeout of 100000 µs passed before it finished",
        "priority: order of answers ['high', 'low']",
        "metrics: slow v1 cancelled: 1",
        "metrics: slow v1 deadline_exceeded: 1",
        "metrics: slow v1 success: 2",
        "stats: slow v1: 2 succeeded, 2 executions,",
        "unload slow: 200",
        "errors: 404 Request for unknown model: 'slow' is not served; served models: 'digits', "
        "'mlp'",
        "errors: 400 input 'input' of model",
    ],
}


def test_every_tutorial_has_expected_output() -> None:
    assert sorted(EXPECTED_OUTPUT) == [path.name for path in TUTORIALS]


# Pages whose code blocks, pasted in order, are a program: the tutorial file it
# shows (for EXPECTED_OUTPUT), and how a reader runs it.
PROGRAM_PAGES = {
    "index.md": None,
    "quickstart.md": "quickstart.py",
    "tutorials/deadlines.md": "deadlines.py",
    "tutorials/batching.md": "batching.py",
    "tutorials/scheduling.md": "scheduling.py",
    "tutorials/serving.md": "serving.py",
    "tutorials/failover.md": "failover.py",
    "tutorials/python_models.md": "python_models.py",
    "tutorials/sequences.md": "sequences.py",
    "tutorials/streaming.md": "streaming.py",
    "tutorials/ray_cluster.md": "ray_cluster.py",
    "how-to/plugins.md": "plugin.py",
    "how-to/testing.md": None,  # a test module: run with pytest
    "how-to/from-triton.md": None,  # a tritonclient program, against `trioinfer serve`
    "how-to/from-ray-serve.md": None,
}
# A Python block titled "... for comparison" shows another system's code (Ray
# Serve's): it must parse, but it is not part of the page's program.
FOR_COMPARISON = "for comparison"
# Pages whose program logs warnings on stderr, as the page says it does.
LOGS_ON_STDERR = {"tutorials/failover.md", "tutorials/ray_cluster.md"}
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SNIPPET_LINE = re.compile(r'^[ \t]*--8<-- "([^"]+)"[ \t]*$', re.MULTILINE)


def expand(body: str) -> str:
    """A code block as the rendered page shows it, its snippet lines replaced (pymdownx)."""

    def include(match: re.Match[str]) -> str:
        path, section = resolve_snippet(match.group(1))
        source = path.read_text()
        if section is None:
            return source.rstrip("\n")
        start = source.index(f"# --8<-- [start:{section}]\n")
        start = source.index("\n", start) + 1
        return source[start : source.index(f"# --8<-- [end:{section}]")].rstrip("\n")

    return SNIPPET_LINE.sub(include, body)


def page_blocks(page: str) -> list[tuple[str, str, str]]:
    """Each fenced block of *page*, in order: (language, options, text as rendered)."""
    text = (DOCS / page).read_text()
    return [(lang, options, expand(body)) for lang, options, body in FENCE.findall(text)]


def shown_output(page: str) -> list[str]:
    """The lines of the page's ``text`` blocks that show what its program prints.

    A text block after a shell block shows that command's output, and one with
    a title (``text title="the log"``) says what else it shows.
    """
    lines, previous = [], ""
    for lang, options, body in page_blocks(page):
        if lang == "text" and "title=" not in options and previous not in {"sh", "console"}:
            lines += [line for line in body.splitlines() if line.strip()]
        previous = lang
    return lines


def shape(line: str) -> str:
    # What may vary between runs and machines: numbers (a time left may be past, below 0),
    # and the spacing that aligns them.
    line = re.sub(r"-?\d+(\.\d+)?", "N", line)
    return re.sub(r"\s+", " ", line).strip()


def test_a_time_left_that_is_past_has_the_shape_of_one_that_is_not() -> None:
    # scheduling.md shows 0.002s left at admission; on a busy machine the program printed
    # -0.004s (the process held off the CPU), and the page's line was "not printed".
    assert shape("its deadline is -0.004s away") == shape("its deadline is 0.002s away")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served_tutorial_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[int, int, Path]]:
    """`trioinfer serve` on the bundled repository: its HTTP and gRPC ports (free ones),
    and the file its stdout goes to."""
    port, grpc_port = _free_port(), _free_port()
    stdout = tmp_path_factory.mktemp("serve") / "stdout"
    with stdout.open("wb") as out:
        server = subprocess.Popen(
            [
                *(sys.executable, "-m", "trioinfer", "serve", "--host", "127.0.0.1"),
                *("--port", str(port), "--grpc-port", str(grpc_port)),
            ],
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready") as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("trioinfer serve did not become ready within 60 s")
        yield port, grpc_port, stdout
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def tutorial_server(served_tutorial_server: tuple[int, int, Path]) -> tuple[int, int]:
    """`trioinfer serve` on the bundled repository: its HTTP and gRPC ports (free ones)."""
    return served_tutorial_server[:2]


def test_serving_tutorial_shows_what_trioinfer_serve_prints(
    served_tutorial_server: tuple[int, int, Path],
) -> None:
    # Step 1's console, up to numbers (ports, times) and the install's path: the page once
    # showed one model and no gRPC line, for a server that serves five and gRPC.
    block = (DOCS / "tutorials" / "serving.md").read_text().split("$ trioinfer serve\n", 1)[1]
    shown = [
        line
        for line in block.split("```", 1)[0].splitlines()
        if not re.match(r"\d{4}-\d\d-\d\d ", line)  # the log, on stderr
    ]
    stdout = served_tutorial_server[2]
    deadline = time.monotonic() + 30  # printed just after the server is ready
    while "try: curl" not in stdout.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    printed = stdout.read_text().splitlines()
    printed = [
        line.replace(str(trioinfer.example_repository()), "/.../trioinfer/examples/repository")
        for line in printed
        if line
    ]
    assert [shape(line) for line in shown] == [shape(line) for line in printed]


@pytest.mark.parametrize("page", sorted(PROGRAM_PAGES))
def test_page_runs_as_pasted(page: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The page's Python blocks, concatenated in page order, run in a fresh process.

    Every line the page shows as output is printed, up to the numbers in it
    (timings, counts that vary from run to run); the tutorial's outcomes
    (EXPECTED_OUTPUT) are printed exactly.
    """
    code = "\n\n".join(
        body
        for lang, options, body in page_blocks(page)
        if lang == "python" and FOR_COMPARISON not in options
    )
    if "127.0.0.1:8000" in code or "127.0.0.1:8001" in code:
        # A client of the `trioinfer serve` the page started on 127.0.0.1:8000 (HTTP) and
        # 8001 (gRPC); here, on free ports.
        port, grpc_port = request.getfixturevalue("tutorial_server")
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        code = code.replace("127.0.0.1:8001", f"127.0.0.1:{grpc_port}")
    program = tmp_path / "test_page.py"
    program.write_text(code)
    if page == "how-to/testing.md":
        (tmp_path / "pytest.ini").write_text("[pytest]\ntrio_mode = true\n")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(program)]
    else:
        command = [sys.executable, str(program)]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    if page not in LOGS_ON_STDERR:
        assert result.stderr == ""
    printed = result.stdout + result.stderr
    shapes = {shape(line) for line in printed.splitlines()}
    missing = [line for line in shown_output(page) if shape(line) not in shapes]
    assert missing == [], f"the page shows lines the program does not print:\n{printed}"
    tutorial = PROGRAM_PAGES[page]
    for line in EXPECTED_OUTPUT.get(tutorial or "", []):
        assert line in result.stdout


def test_tutorials_run_as_scripts() -> None:
    for path in TUTORIALS:
        tree = ast.parse(path.read_text())
        main = [
            node
            for node in tree.body
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "main"
        ]
        assert main, f"{path.name} defines no async def main()"
        assert ast.unparse(tree.body[-1]) == "if __name__ == '__main__':\n    trio.run(main)"


def test_the_tutorials_type_check_strictly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The code readers copy passes mypy --strict against this tree's trioinfer and plugins.

    One run over every tutorial (mypy's start-up is most of its time). It caught the
    quickstart reading config.path.parent (ModelConfig.path is Path | None: a pipeline
    has none), and call options passed as **dict[str, object] in scheduling.py.
    """
    from mypy import api

    monkeypatch.setenv("MYPYPATH", os.pathsep.join([str(ROOT / "src"), str(ROOT / "plugins")]))
    stdout, stderr, status = api.run(
        [
            "--strict",
            "--no-error-summary",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "mypy"),
            *map(str, TUTORIALS),
        ]
    )
    assert (status, stdout, stderr) == (0, "", "")


def snippets(page: Path) -> list[str]:
    return SNIPPET.findall(page.read_text())


def resolve_snippet(name: str) -> tuple[Path, str | None]:
    path, _, section = name.partition(":")
    for base in SNIPPET_BASES:
        if (base / path).is_file():
            return base / path, section or None
    raise AssertionError(f"snippet {path!r} is in none of {[str(b) for b in SNIPPET_BASES]}")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_snippets_exist(page: Path) -> None:
    text = page.read_text()
    # ruff format reads Python fences; unguarded, it rewrites `--8<--` to `--8 < --`.
    assert "--8 < --" not in text
    for name in snippets(page):
        path, section = resolve_snippet(name)
        if section is not None:
            source = path.read_text()
            assert f"# --8<-- [start:{section}]" in source, name
            assert f"# --8<-- [end:{section}]" in source, name


def test_every_tutorial_appears_on_a_page() -> None:
    included = {resolve_snippet(name)[0] for page in PAGES for name in snippets(page)}
    assert set(TUTORIALS) <= included


def test_every_onnxruntime_option_is_documented() -> None:
    page = (DOCS / "how-to" / "models.md").read_text()
    section = page.split("## ONNX Runtime backend options", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)
    assert sorted(rows) == sorted(OPTIONS)


def test_every_model_config_field_is_documented() -> None:
    # The configuration reference: one row per ModelConfig field (it once lacked sequence).
    import attrs

    page = (DOCS / "how-to" / "models.md").read_text()
    section = page.split("## Describe a model in Python", 1)[1].split("\n## ", 1)[0]
    rows = {
        name
        for cell in re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", section, re.MULTILINE)
        for name in re.findall(r"`([a-z_]+)`", cell)
    }
    assert rows == {field.name for field in attrs.fields(trioinfer.ModelConfig)}


def test_every_ray_option_is_documented() -> None:
    page = (DOCS / "how-to" / "ray.md").read_text()
    section = page.split("## Options", 1)[1]
    rows = re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)
    assert sorted(rows) == sorted(RAY_OPTIONS)


def test_example_config_toml_loads(tmp_path: Path) -> None:
    model_dir = tmp_path / "classifier"
    for version in (1, 2):
        (model_dir / str(version)).mkdir(parents=True)
        (model_dir / str(version) / "model.onnx").write_bytes(b"")
    (model_dir / "config.toml").write_text((DOCS / "how-to" / "config.toml").read_text())
    config = trioinfer.ModelConfig.from_toml(model_dir / "config.toml")
    assert config.name == "classifier"
    assert config.path == model_dir / "2" / "model.onnx"
    assert [str(p.device) for p in config.placements()] == ["cuda:0", "cuda:0", "cpu"]
    assert set(config.backend_options) <= set(OPTIONS)


def test_failover_config_toml_loads(tmp_path: Path) -> None:
    # The tutorial's config.toml is what `trioinfer serve` would read: it must load,
    # place the instances as the program does, and give the fallback options it accepts.
    (block,) = fences(DOCS / "tutorials" / "failover.md", "toml")
    model_dir = tmp_path / "digits"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.onnx").write_bytes(b"")
    (model_dir / "config.toml").write_text(block)
    config = trioinfer.ModelConfig.from_toml(model_dir / "config.toml")
    assert config.fallback == "resilient"
    assert [(str(p.device), p.capacity) for p in config.placements()] == [
        ("cuda:0", 8.0),
        ("cpu", 1.0),
    ]
    Resilient(**config.fallback_options)


def test_triton_translation_loads(tmp_path: Path) -> None:
    # "Coming from Triton" translates a config.pbtxt; what it says each key does must hold.
    from trioinfer.server import ModelRepository
    from trioinfer_batching import DynamicBatcher
    from trioinfer_scheduling import PriorityScheduler

    (block,) = fences(DOCS / "how-to" / "from-triton.md", "toml")
    model_dir = tmp_path / "classifier"
    for version in (1, 2, 3):
        (model_dir / str(version)).mkdir(parents=True)
        (model_dir / str(version) / "model.onnx").write_bytes(b"")
    (model_dir / "config.toml").write_text(block)
    entry = ModelRepository(tmp_path).entry("classifier")
    assert entry.selected() == (2, 3)  # version_policy = { latest = 2 }
    config = entry.config(3)
    assert (config.scheduler, config.batcher, config.max_queue_size) == (
        "priority",
        "dynamic",
        1024,
    )
    assert config.queue_sizes == {0: 768, 1: 256}
    assert config.queue_timeouts == {0: 0.5}
    assert [(str(p.device), p.threads) for p in config.placements()] == [
        ("cuda:0", 0),
        ("cuda:0", 0),
        ("cpu", 4),
    ]
    DynamicBatcher(**config.batcher_options)
    assert PriorityScheduler(**config.scheduler_options).max_wait is None  # strict priority


def fences(page: Path, language: str) -> list[str]:
    pattern = rf"^( *)```{language}\b[^\n]*\n(.*?)^\1```"
    blocks = re.findall(pattern, page.read_text(), re.MULTILINE | re.DOTALL)
    return [
        "\n".join(line[len(indent) :] for line in body.splitlines())
        for indent, body in blocks
        if "--8<--" not in body
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(DOCS)))
def test_code_blocks_parse(page: Path) -> None:
    for block in fences(page, "python"):
        compile(block, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    for block in fences(page, "toml"):
        tomllib.loads(block)


def reference_targets() -> set[str]:
    text = "\n".join(path.read_text() for path in (DOCS / "reference").glob("*.md"))
    return set(re.findall(r"^::: ([\w.]+)$", text, re.MULTILINE))


def public_names(module: object) -> set[str]:
    names = getattr(module, "__all__", None) or dir(module)
    return {
        name
        for name in names
        if not name.startswith("_")
        and not isinstance(getattr(module, name), type(trioinfer))
        and name not in {"annotations", "TYPE_CHECKING"}
    }


def test_every_public_name_is_in_the_reference() -> None:
    targets = reference_targets()
    missing = [
        f"{module.__name__}.{name}"
        for module in (trioinfer, trioinfer.testing)
        for name in sorted(public_names(module))
        if f"{module.__name__}.{name}" not in targets
    ]
    assert missing == []
    # trioinfer.abc is rendered whole: its __all__ lists the contracts.
    assert {"trioinfer.abc", "trioinfer.testing.models", "trioinfer_onnxruntime.OPTIONS"} <= targets


# -- installing -----------------------------------------------------------------------

README = ROOT / "README.md"
# `pip install trioinfer`, `pip install 'trioinfer[cpu]'`: an install from PyPI, where no
# release exists yet. Installs from a clone (`-e '.[cpu]'`, `path/to/trioinfer`) or a built
# wheel do not match.
PYPI_INSTALL = re.compile(r"pip install (?:-\S+ )*['\"]?trioinfer\b")
# The extras an install line names: `.[dev,cpu]`, `...-any.whl[cpu]`, `trioinfer[cpu]`.
EXTRAS = re.compile(r"(?:\.|\.whl|trioinfer)\[([a-z,]+)\]")
ORT_EXTRAS = {"cpu", "gpu", "cuda"}


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_installs_trioinfer_from_pypi(page: Path) -> None:
    assert PYPI_INSTALL.findall(page.read_text()) == []


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda page: str(page.relative_to(ROOT)))
def test_install_lines_name_real_extras_and_one_onnx_runtime(page: Path) -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for names in EXTRAS.findall(page.read_text()):
        extras = set(names.split(","))
        assert extras <= set(declared), f"{page.name}: [{names}] names no such extra"
        assert len(extras & ORT_EXTRAS) <= 1, f"{page.name}: [{names}] names two ONNX Runtimes"


def test_the_readme_says_which_install_line_to_use_where() -> None:
    install = README.read_text().split("## Install\n", 1)[1].split("\n## ", 1)[0]
    for line in ["'.[cpu]'", "'.[gpu]'", "'.[cpu,serve]'", "make test", "python -m build"]:
        assert line in install


# -- the command line as the pages show it ---------------------------------------------


def _plugins_output(monkeypatch: pytest.MonkeyPatch | None = None) -> list[str]:
    from click.testing import CliRunner

    from trioinfer.cli import main

    if monkeypatch is not None:
        # As on the quickstart's install (the cpu extra alone): Ray is not installed.
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, package=None: None if name == "ray" else real(name, package),
        )
    result = CliRunner().invoke(main, ["plugins"], prog_name="trioinfer")
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def test_quickstart_shows_what_trioinfer_plugins_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first command a reader runs after installing: its table must be today's, every
    # first-party plugin in it (a stale copy once left out python, ray and sequence), and
    # the ray backend not "ok" on the quickstart's install, which has no Ray.
    text = (DOCS / "quickstart.md").read_text()
    shown = text.split("```sh\ntrioinfer plugins\n```\n\n```text\n", 1)[1].split("```", 1)[0]
    assert shown.splitlines() == _plugins_output(monkeypatch)


def test_plugin_howto_shows_trioinfer_plugins_with_the_new_plugins() -> None:
    # "Package it": after installing trioinfer-sjf, the same table plus its four plugins.
    text = (DOCS / "how-to" / "plugins.md").read_text()
    shown = text.split('```text title="trioinfer plugins"\n', 1)[1].split("```", 1)[0]
    rows = shown.splitlines()
    added = [row for row in rows if "trioinfer-sjf" in row]
    assert [row.split()[:2] for row in added] == [
        ["backends", "matmul"],
        ["batchers", "fixed"],
        ["fallbacks", "default"],
        ["schedulers", "sjf"],
    ]
    real = _plugins_output()
    assert [row.split() for row in rows if row not in added] == [row.split() for row in real]


# `trioinfer serve --model-repository DIR ...` in a page, up to a comment, the code span's end
# or the line's end: the command and its arguments.
COMMAND_LINE = re.compile(r"\btrioinfer (serve|bench|demo|traffic|plugins)\b([^\n`#|]*)")


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda page: str(page.relative_to(ROOT)))
def test_command_lines_use_real_options(page: Path) -> None:
    # A reader pastes these: an option the command does not have fails at once (ray.md
    # once said `trioinfer serve --repository`).
    from trioinfer.cli import main

    wrong = []
    for command, arguments in COMMAND_LINE.findall(page.read_text()):
        params = main.commands[command].params  # type: ignore[attr-defined]
        known = {opt for p in params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
        wrong += [
            f"trioinfer {command} {option}"
            for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", arguments)
            if option not in known
        ]
    assert wrong == []


def test_the_server_reference_lists_every_serve_option_and_config_key() -> None:
    # The reference once lacked --cache-size, and its --config keys lacked grpc, grpc_port,
    # cache_size and loop.
    from trioinfer.cli import serve

    page = (DOCS / "reference" / "server.md").read_text()
    table = page.split("## Command line: `trioinfer serve`", 1)[1].split("\n#", 1)[0]
    rows = set(re.findall(r"^\| `(--[a-z-]+)", table, re.MULTILINE))
    options = {p.opts[0] for p in serve.serve.params if p.opts[0].startswith("--")}
    assert rows == options
    keys_text = page.split("### The `--config` file", 1)[1].split("```", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", keys_text.split("and a `[limits]` table", 1)[0]))
    assert listed == serve._SERVE_KEYS - {"limits"}


# What a tutorial program needs beyond `pip install -e '.[cpu]'`, by what it imports: the
# extra (or package) its page must name in a `pip install` line.
NEEDS = {
    "httpx": "httpx",
    "tritonclient": "tritonclient",
    "prometheus_client": "serve",
    "trioinfer.server": "serve",
    "trioinfer.testing.models": "onnx",
    "ray": "ray",
}


def _needs(program: Path) -> set[str]:
    needed = set()
    for node in ast.walk(ast.parse(program.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for module in modules:
            needed |= {
                need
                for name, need in NEEDS.items()
                if module == name or module.startswith(f"{name}.")
            }
    return needed


@pytest.mark.parametrize(
    "page", [page for page, program in PROGRAM_PAGES.items() if program is not None]
)
def test_a_tutorial_says_what_to_install_for_its_program(page: str) -> None:
    # A reader with only the cpu extra once met "No module named 'onnx'" (deadlines,
    # batching, serving) and "No module named 'httpx'" (serving, streaming) unwarned.
    program = DOCS / "tutorials" / str(PROGRAM_PAGES[page])
    installs = " ".join(re.findall(r"pip install [^`\n]*", (DOCS / page).read_text()))
    missing = [
        need
        for need in sorted(_needs(program))
        if not re.search(rf"[\[,]{need}[\],]|\b{need}\b", installs)
    ]
    assert missing == [], f"{page} never says to install {missing}"


def test_the_server_reference_lists_every_metric_family(tutorial_server: tuple[int, int]) -> None:
    # The Metrics table once lacked the response cache's five families, which /metrics
    # declares on every server (their samples come with a model's response_cache).
    port = tutorial_server[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        scraped = response.read().decode()
    # The server's own: a model's custom families (a Python model's metrics) are its
    # author's to document, and can never be named trioinfer_* (InvalidMetric).
    exported = set(re.findall(r"^# TYPE (trioinfer_\S+) ", scraped, re.MULTILINE))
    page = (DOCS / "reference" / "server.md").read_text()
    table = page.split("### Metrics", 1)[1].split("\n#", 1)[0]
    rows = set(re.findall(r"^\| `(trioinfer_[a-z_]+)` \|", table, re.MULTILINE))
    # Served only with --workers; the same section documents it.
    assert "trioinfer_worker_inference_requests_total" in table
    # The GPUs' families come where NVML finds GPUs: here, from a fake one.
    from prometheus_client import CollectorRegistry, generate_latest

    from test_host_metrics import FakeNVML
    from trioinfer.server._host_metrics import HostMetrics

    async def sampled() -> str:
        host = HostMetrics(proc=DOCS / "no-proc-here", nvml=FakeNVML())
        async with trio.open_nursery() as nursery:
            await nursery.start(host.run)
            registry = CollectorRegistry(auto_describe=False)
            registry.register(host)
            nursery.cancel_scope.cancel()
            return generate_latest(registry).decode()

    gpus = set(re.findall(r"^# TYPE (\S+) ", trio.run(sampled), re.MULTILINE))
    assert gpus
    assert rows == exported | gpus


def test_the_server_reference_lists_every_request_outcome() -> None:
    # The outcome table once said a missing token (401) and a server shutting down
    # (503) were counted as "other"; they are "unauthorized" and "unavailable".
    from trioinfer.server._errors import NotReady, Unauthorized
    from trioinfer.server._metrics import _OUTCOMES, outcome_of

    page = (DOCS / "reference" / "server.md").read_text()
    table = page.split("The `outcome` label of", 1)[1].split("\n\n", 2)[1]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", table, re.MULTILINE))
    rows.pop("outcome")  # the header
    labels = {outcome for _, outcome in _OUTCOMES} | {"success", "cancelled", "other"}
    assert set(rows) == labels
    assert "401" in rows[outcome_of(Unauthorized("no token"))]
    assert "shutting down" in rows[outcome_of(NotReady("stopping"))]


def test_benchmark_commands_use_real_options() -> None:
    # The commands the Benchmarks page gives to rerun its figures: each script must take
    # every option the page passes it (its --help lists them).
    commands = [
        " ".join(block.replace("\\\n", " ").split())
        for lang, _, block in page_blocks("benchmarks.md")
        if lang == "sh"
    ]
    used: dict[str, set[str]] = {}
    for text in commands:
        for script, arguments in re.findall(r"benchmarks/(\w+)\.py([^\n]*?)(?=\.venv/|$)", text):
            used.setdefault(script, set()).update(
                re.findall(r"(?<![\w-])--[a-z][a-z-]*", arguments)
            )
    assert used, "the page gives no benchmark command"
    wrong = []
    for script, options in sorted(used.items()):
        shown = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        known = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", shown))
        wrong += [f"{script}.py {option}" for option in sorted(options - known)]
    assert wrong == []


@pytest.mark.bench
def test_benchmarking_howto_python_program_runs_and_prints_the_table(tmp_path: Path) -> None:
    # "From Python": the page named run_http, run_in_process and print_table with no
    # program to show how they go together.
    (program,) = [
        body for lang, _, body in page_blocks("how-to/benchmarking.md") if lang == "python"
    ]
    (tmp_path / "program.py").write_text(program)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "program.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shown = (DOCS / "how-to" / "benchmarking.md").read_text().split("## From Python", 1)[1]
    header = next(line for line in shown.splitlines() if line.startswith("concurrency "))
    printed = result.stdout.splitlines()
    assert printed[0] == header
    assert [line.split()[0] for line in printed[1:3]] == ["1", "16"]
    assert re.fullmatch(r"best: concurrency (1|16), [\d,]+ requests/s", printed[-1])


@pytest.mark.tracing
def test_tracing_howto_program_traces_the_request_under_the_callers_span(tmp_path: Path) -> None:
    # "Trace an engine in your own program": the request's spans are children of the
    # caller's span, even at trace_rate=0.01 (a request under a sampled span follows it).
    pytest.importorskip("opentelemetry.sdk")
    (block,) = fences(DOCS / "how-to" / "tracing.md", "python")
    program = tmp_path / "traced.py"
    program.write_text(block)
    result = subprocess.run(
        [sys.executable, str(program)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    spans = {
        span["name"]: span
        for span in json.loads("[" + re.sub(r"\}\s*\{", "},{", result.stdout) + "]")
    }
    assert set(spans) == {
        "handle order",
        "infer digits",
        "queue digits",
        "batch digits",
        "compute digits",
    }
    assert spans["infer digits"]["parent_id"] == spans["handle order"]["context"]["span_id"]


def test_every_instance_field_is_documented() -> None:
    import attrs

    page = (DOCS / "how-to" / "models.md").read_text()
    section = page.split("## Instances and devices", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| `?([^`|]+?)`? \|", section, re.MULTILINE)
    assert [name for name, _ in rows] == [f.name for f in attrs.fields(trioinfer.Instance)]
    defaults = {name: default for name, default in rows}
    instance = trioinfer.Instance()
    assert str(instance.device) == defaults["device"].strip('"')
    assert (str(instance.count), str(instance.threads), str(instance.capacity)) == (
        defaults["count"],
        defaults["threads"],
        defaults["capacity"],
    )


def test_the_server_reference_lists_every_limit_with_its_default() -> None:
    import attrs

    from trioinfer.server import Limits

    page = (DOCS / "reference" / "server.md").read_text()
    section = page.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| ([0-9.]+)", section, re.MULTILINE)
    assert [name for name, _ in rows] == [f.name for f in attrs.fields(Limits)]
    limits = Limits()
    assert {name: float(default) for name, default in rows} == {
        name: float(getattr(limits, name)) for name, _ in rows
    }


def test_python_reference_parameters_model_runs_as_shown(tmp_path: Path) -> None:
    # The page's model read parameters.get(...), as if it always got one dict; a
    # batched model (x and y of [-1, 4], as most are) gets one per row, and it failed
    # with AttributeError on the first request.
    (block,) = [
        body
        for lang, _, body in page_blocks("reference/python.md")
        if lang == "python" and "parameters" in body
    ]
    (tmp_path / "model.py").write_text(block)
    spec = {"dtype": "float32", "shape": [-1, 4]}
    config = trioinfer.ModelConfig(
        name="scale",
        path=tmp_path / "model.py",
        backend="python",
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.01},
        backend_options={"inputs": [{"name": "x", **spec}], "outputs": [{"name": "y", **spec}]},
    )
    x = np.ones((2, 4), np.float32)

    async def main() -> list[list[float]]:
        async with trioinfer.open_engine() as engine:
            await engine.load(config)
            answers: list[list[float]] = [[], [], []]

            async def ask(i: int, parameters: dict[str, float] | None) -> None:
                outputs = await engine.infer("scale", {"x": x}, parameters=parameters)
                answers[i] = outputs["y"][:, 0].tolist()

            async with trio.open_nursery() as nursery:  # in one batch, mostly
                for i, parameters in enumerate([{"scale": 2.0}, None, {"scale": 0.5}]):
                    nursery.start_soon(ask, i, parameters)
            return answers

    assert trio.run(main) == [[2.0, 2.0], [1.0, 1.0], [0.5, 0.5]]


def test_fallbacks_reference_config_loads_on_the_digits_model(tmp_path: Path) -> None:
    # The page's config (ten probabilities, digits_small next) on the bundled digits
    # model: its default gave no 'label', and the load failed saying so.
    (block,) = fences(DOCS / "reference" / "fallbacks.md", "toml")
    model_dir = tmp_path / "digits"
    (model_dir / "1").mkdir(parents=True)
    model = trioinfer.example_repository() / "digits" / "1" / "model.onnx"
    (model_dir / "1" / "model.onnx").write_bytes(model.read_bytes())
    (model_dir / "config.toml").write_text(block)
    config = trioinfer.ModelConfig.from_toml(model_dir / "config.toml")

    async def main() -> list[str]:
        async with trioinfer.open_engine() as engine:
            await engine.load(trioinfer.ModelConfig(name="digits_small", path=model))
            info = await engine.load(config)  # a cuda:0 not usable here runs on the CPU
            x = trioinfer.digits_samples()[0][:1]
            outputs = await engine.infer("digits", {"input": x})
            return sorted(outputs) + sorted(spec.name for spec in info.signature.outputs)

    assert trio.run(main) == ["label", "probabilities"] * 2
