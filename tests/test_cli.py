"""The trioinfer command line: help, version, plugins, and the demo on the bundled model."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result

import trioinfer
from trioinfer._examples import digits_samples, example_repository
from trioinfer.cli import main, plugins, serve
from trioinfer.cli._params import needs_extra


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(
        main, list(args), prog_name="trioinfer", catch_exceptions=False, env=env
    )


def count(section: str, label: str) -> int:
    match = re.search(rf"^\s+{label}\s+(\d+)", section, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{section}"
    return int(match.group(1))


def has_line(section: str, pattern: str) -> bool:
    return re.search(f"^{pattern}", section, re.MULTILINE) is not None


def test_help_lists_the_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    assert re.search(r"^\s+demo\s", result.output, re.MULTILINE)
    assert re.search(r"^\s+plugins\s", result.output, re.MULTILINE)
    assert re.search(r"^\s+serve\s", result.output, re.MULTILINE)
    assert re.search(r"^\s+bench\s", result.output, re.MULTILINE)
    assert re.search(r"^\s+traffic\s", result.output, re.MULTILINE)


@pytest.mark.parametrize("command", ["demo", "plugins", "serve", "bench", "traffic"])
def test_command_help(command: str) -> None:
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert result.output.startswith(f"Usage: trioinfer {command} [OPTIONS]")


def test_demo_help_shows_defaults() -> None:
    output = invoke("demo", "--help").output
    for option, default in [
        ("--requests", "2000"),
        ("--concurrency", "64"),
        ("--instances", "2"),
        ("--deadline", "0.05"),
    ]:
        assert re.search(rf"{option} .*?\[default:\s+{default}[;\]]", output, re.DOTALL), option


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output == f"trioinfer {trioinfer.__version__}\n"


def test_plugins_lists_first_party_plugins_that_load() -> None:
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "TARGET", "DISTRIBUTION", "STATUS"]
    rows = {(line.split()[0], line.split()[1]): line for line in lines[1:]}
    for kind, name, target in [
        ("backends", "onnxruntime", "trioinfer_onnxruntime:OnnxRuntimeBackend"),
        ("schedulers", "fifo", "trioinfer_scheduling:FifoScheduler"),
        ("batchers", "none", "trioinfer_batching:NoBatcher"),
        ("fallbacks", "none", "trioinfer_fallback:NoFallback"),
    ]:
        row = rows[kind, name]
        assert target in row
        assert f"trioinfer {trioinfer.__version__}" in row
        assert row.endswith("  ok")
    # Aligned: every row's STATUS starts in the same column.
    column = lines[0].index("STATUS")
    assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines[1:])


def test_plugins_reports_one_that_fails_and_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = importlib.metadata.EntryPoint(
        name="broken", value="no_such_module_here:Backend", group="trioinfer.backends"
    )
    monkeypatch.setattr(plugins, "Registry", lambda: trioinfer.Registry(entry_points=[broken]))
    result = invoke("plugins")
    assert result.exit_code == 1
    row = result.output.splitlines()[1]
    assert row.split()[:3] == ["backends", "broken", "no_such_module_here:Backend"]
    assert "ModuleNotFoundError" in row
    assert "1 of 1 plugins failed to load" in result.output


@pytest.mark.parametrize(
    ("module", "backend", "said"),
    [
        ("ray", "ray", "Ray is not installed: install trioinfer with the 'ray' extra"),
        (
            "onnxruntime",
            "onnxruntime",
            "ONNX Runtime is not installed: install trioinfer with the 'cpu' extra",
        ),
    ],
)
def test_plugins_says_what_a_backend_lacks_and_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, module: str, backend: str, said: str
) -> None:
    # Both backends import their dependency on first use, so they import without it:
    # the table said "ok" for ray on an install without Ray.
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == module else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    result = invoke("plugins")
    assert result.exit_code == 0, result.output  # an install without an extra is a normal one
    rows = {tuple(line.split()[:2]): line for line in result.output.splitlines()[1:]}
    assert said in rows["backends", backend]
    assert "pip install -e '.[" in rows["backends", backend]
    assert rows["backends", "python"].endswith("  ok")
    assert re.search(r"\b1 of \d+ plugins lack a dependency", result.output)


def test_demo_runs_and_reports() -> None:
    result = invoke("demo", "--requests", "50", "--concurrency", "8")
    assert result.exit_code == 0, result.output
    phase1, phase2 = result.output.split("\nphase 2")
    assert has_line(phase1, r"runs on\s+2 x cpu\b")
    accuracy = re.search(r"^\s+accuracy\s+([0-9.]+)", phase1, re.MULTILINE)
    assert accuracy is not None, phase1
    assert float(accuracy.group(1)) > 0.9
    assert count(phase1, "ok") + count(phase1, "timed out") + count(phase1, "errors") == 50
    assert has_line(phase1, r"\s+latency\s+p50 [0-9.]+ ms\s+p90 [0-9.]+ ms\s+p99 [0-9.]+ ms")
    assert has_line(phase1, r"\s+engine\s+executions \d+\s+expired \d+\s+cancelled \d+")
    # Phase 2: 64 requests, each computed or not, each answered, timed out or failed.
    assert count(phase2, "ok") + count(phase2, "timed out") + count(phase2, "errors") == 64
    assert count(phase2, "computed") + count(phase2, "never computed") == 64
    assert count(phase2, "ok") <= count(phase2, "computed")


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--requests", "-1"], "--requests"),
        (["--instances", "0"], "--instances"),
        (["--instances", "300"], "--instances"),  # more than a model may have
        (["--deadline", "0"], "--deadline"),
        (["--deadline", "nan"], "--deadline"),
    ],
)
def test_demo_refuses_bad_values(args: list[str], option: str) -> None:
    result = invoke("demo", *args)
    assert result.exit_code == 2
    assert f"Invalid value for '{option}'" in result.output


def test_python_m_trioinfer() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trioinfer", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout
    assert "plugins" in result.stdout


def test_example_repository_and_samples() -> None:
    repository = example_repository()
    assert (repository / "digits" / "config.toml").is_file()
    assert (repository / "digits" / "1" / "model.onnx").is_file()
    images, labels = digits_samples()
    assert images.shape == (200, 64)
    assert images.dtype == "float32"
    assert labels.shape == (200,)
    assert labels.dtype == "int64"
    assert 0 <= images.min() <= images.max() <= 16
    assert set(labels.tolist()) == set(range(10))


def test_serve_refuses_bad_settings_with_a_usage_error(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text('port = 8000\ncolour = "blue"\n')
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2
    assert "unknown key 'colour'" in result.output
    config.write_text("[limits]\nmax_body_bytes = 0\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2
    assert "max_body_bytes" in result.output
    result = invoke("serve", "--protect-inference")
    assert result.exit_code == 2
    # It said "protect_inference needs an admin_token", a flag's config key.
    assert "--protect-inference needs an admin token to check: give --admin-token" in (
        " ".join(result.output.split())
    )
    config.write_text("protect_inference = true\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2
    assert "protect_inference = true in " in result.output
    config.write_text("[limits]\nhead_timeout = 0\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2
    assert "head_timeout must be a number of seconds from 1e-06" in result.output
    result = invoke("serve", "--trace-rate", "nan")
    assert result.exit_code == 2
    assert "not nan" in result.output
    config.write_text("trace_exporter = 'console'\ntrace_rate = 3\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2
    assert "trace_rate = 3: 3.0 is not in the range 0<=x<=1" in result.output


@pytest.mark.parametrize(
    ("line", "message"),
    [
        # Each once went through unchecked: a traceback, or worse, a server.
        ('port = "x"', "port = 'x': 'x' is not a valid integer"),
        ("port = true", "port = true: expected an integer, not a boolean"),
        ("grpc_port = 70000", "grpc_port = 70000: 70000 is not in the range 0<=x<=65535"),
        ("log_level = 3", "log_level = 3: 3 is not one of 'debug'"),
        (
            'log_format = "syslog"',
            "log_format = 'syslog': 'syslog' is not one of 'default', 'ISO8601', 'json'",
        ),
        ('access_log = "x"', "access_log = 'x': 'x' is not a valid boolean"),
        ('loop = "uvloop"', "loop = 'uvloop': 'uvloop' is not one of 'trio', 'asyncio'"),
        ("models = [1]", "models must be a list of strings, got [1]"),
        ('trace_rate = "x"', "trace_rate = 'x': 'x' is not a valid float"),
        ('grpc = "maybe"', "grpc = 'maybe': 'maybe' is not a valid boolean"),
        ('rate_limit = "on"', "rate_limit = 'on': 'on' is not one of 'off', 'execution_count'"),
        ("rate_limit_resource = [1]", "rate_limit_resource must be a list of strings, got [1]"),
        # click would have cut it to 1 ms.
        ("metrics_interval_ms = 1.5", "metrics_interval_ms = 1.5: expected an integer"),
        ('allow_gpu_metrics = "x"', "allow_gpu_metrics = 'x': 'x' is not a valid boolean"),
        ("host = 5", "host must be a string, got 5"),
        # click said only "Value must be an iterable".
        ('models = "digits"', """models must be a list of strings, got 'digits' (write models"""),
        ("model_repository = 5", "model_repository must be a string, got 5"),
        ("limits = 5", "limits must be a table ([limits]) of body_timeout"),
        ("[limits]\nbogus = 1", "unknown key 'bogus' in [limits]; known keys are body_timeout"),
        # A bad value in [limits] says which file it is in, as the others do.
        (
            "[limits]\nhead_timeout = -1.0",
            "server.toml: [limits] head_timeout must be a number of seconds from 1e-06",
        ),
        ('[limits]\nbody_timeout = "x"', "server.toml: [limits] body_timeout must be a number"),
        # A typo says which key was meant.
        ("prot = 8000", "unknown key 'prot'; known keys are"),
        ("prot = 8000", "did you mean 'port' for 'prot'?"),
        ("[limits]\nmax_body_byte = 1", "did you mean 'max_body_bytes' for 'max_body_byte'?"),
        # A limit's value was "invalid server settings: head_timeout ...", naming neither
        # the file nor the table.
        ("[limits]\nhead_timeout = 0", "server.toml: [limits] head_timeout must be a number"),
        ("[limits]\nmax_body_bytes = 'x'", "server.toml: [limits] max_body_bytes must be a"),
        # tomllib's words alone ("Cannot overwrite a value") do not say the file is the fault.
        ("port = 8000\nport = 8001", "server.toml is not valid TOML: Cannot overwrite a value"),
        ('host = "127.0.0.1', "server.toml is not valid TOML: "),
        # tomllib's RecursionError was a traceback, exit status 1.
        ("port = " + "[" * 5000 + "]" * 5000, "server.toml is not valid TOML: it nests too deeply"),
    ],
)
def test_serve_checks_each_config_file_value_as_its_option(
    tmp_path: Path, line: str, message: str
) -> None:
    config = tmp_path / "server.toml"
    config.write_text(line + "\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2, result.output
    assert "Invalid value for --config" in result.output
    assert message in " ".join(result.output.split()), result.output


def test_serve_checks_a_config_file_value_the_command_line_overrides(tmp_path: Path) -> None:
    # The reference says a value its option would refuse is an error: `port = "x"`
    # beside --port was taken without a word, and failed once the flag was dropped.
    config = tmp_path / "server.toml"
    config.write_text('port = "x"\n')
    # (A repository that is not there: were the file's value let through, serve would
    # stop on that, not serve.)
    nowhere = str(tmp_path / "nowhere")
    result = invoke("serve", "--config", str(config), "--port", "0", "--model-repository", nowhere)
    assert result.exit_code == 2, result.output
    assert "server.toml: port = 'x': 'x' is not a valid integer" in (
        " ".join(result.output.split())
    )


def test_serve_refuses_a_config_file_that_is_not_utf8(tmp_path: Path) -> None:
    # tomllib decodes the file itself: its UnicodeDecodeError was a traceback, exit status 1.
    config = tmp_path / "server.toml"
    config.write_bytes(b'host = "caf\xe9"\n')
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2, result.output
    assert "Invalid value for --config" in result.output
    assert "server.toml is not valid TOML: it is not UTF-8 (invalid continuation byte)" in (
        " ".join(result.output.split())
    )


@pytest.mark.parametrize(
    ("lines", "args", "said", "unsaid"),
    [
        # Each names the setting the way it was given: a config file's key (and the
        # file), or the command line's flag; never a flag nobody typed.
        (
            "port = 9005\ngrpc_port = 9005\n",
            (),
            [
                "grpc_port = 9005 in {file} is also the HTTP port (port = 9005 in {file})",
                "pick another grpc_port in {file}",
            ],
            ["--grpc-port", "--port"],
        ),
        (
            "grpc_port = 9006\n",
            ("--port", "9006"),
            ["grpc_port = 9006 in {file} is also the HTTP port (--port 9006)"],
            ["--grpc-port"],
        ),
        (
            'host = "localhost:8000"\n',
            (),
            [
                "host = 'localhost:8000' in {file} is not an address",
                "and the port with its own key, port",
            ],
            ["--host", "--port"],
        ),
    ],
)
def test_serve_errors_name_the_setting_as_it_was_given(
    tmp_path: Path, lines: str, args: tuple[str, ...], said: list[str], unsaid: list[str]
) -> None:
    config = tmp_path / "server.toml"
    config.write_text(lines)
    result = invoke("serve", "--config", str(config), *args)
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    for fragment in said:
        assert fragment.format(file=config) in output
    for fragment in unsaid:
        assert fragment.format(file=config) not in output


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "invalid server settings: metrics_interval_s must be a number of seconds above 0"),
        ("-5", "gives in milliseconds, 1 to 86400000; got -0.005"),
        ("86400001", "and at most a day (86400)"),
        ("1.5", "Invalid value for '--metrics-interval-ms': '1.5' is not a valid integer"),
        ("x", "Invalid value for '--metrics-interval-ms': 'x' is not a valid integer"),
    ],
)
def test_serve_metrics_interval_is_a_positive_whole_number_of_ms(value: str, message: str) -> None:
    result = invoke("serve", "--metrics-interval-ms", value)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_serve_metrics_interval_from_a_config_file_is_checked_as_the_options(
    tmp_path: Path,
) -> None:
    # ServerConfig checks it, wherever it came from; the message names the file's key.
    config = tmp_path / "server.toml"
    config.write_text("metrics_interval_ms = 0\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "invalid server settings: metrics_interval_s must be a number of seconds" in said
    assert "--metrics-interval-ms (metrics_interval_ms in a --config file)" in said


def test_serve_host_metrics_settings_reach_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    async def serving(repository: Path, **options: Any) -> None:
        seen.append(options["config"])

    monkeypatch.setattr(serve, "_serve", serving)
    assert invoke("serve").exit_code == 0
    assert (seen[0].metrics_interval_s, seen[0].allow_cpu_metrics) == (2.0, True)
    assert seen[0].allow_gpu_metrics is True
    config = tmp_path / "server.toml"
    config.write_text("metrics_interval_ms = 500\nallow_cpu_metrics = false\n")
    result = invoke("serve", "--config", str(config), "--no-allow-gpu-metrics")
    assert result.exit_code == 0, result.output
    assert (seen[1].metrics_interval_s, seen[1].allow_cpu_metrics) == (0.5, False)
    assert seen[1].allow_gpu_metrics is False
    # The command line wins over the file.
    result = invoke("serve", "--config", str(config), "--metrics-interval-ms", "250")
    assert result.exit_code == 0, result.output
    assert seen[2].metrics_interval_s == 0.25


def test_serve_command_line_model_repository_wins_over_the_config_file(tmp_path: Path) -> None:
    # --help says options on the command line win; model_repository in the file once did.
    config = tmp_path / "server.toml"
    config.write_text('model_repository = "from_file"\n')
    result = invoke(
        "serve", "--config", str(config), "--model-repository", str(tmp_path / "from_cli")
    )
    assert result.exit_code == 1, result.output
    assert "from_cli does not exist" in result.output
    assert "from_file" not in result.output


@pytest.mark.parametrize("token", ["", "   ", " padded", "tab\there"])
def test_serve_refuses_an_admin_token_nobody_could_send(token: str) -> None:
    # An empty token would let "Authorization: Bearer " through. The error named
    # ServerConfig's field, admin_token, not the flag typed.
    result = invoke("serve", "--admin-token", token)
    assert result.exit_code == 2
    assert "invalid server settings: --admin-token must " in result.output
    if token.strip():
        assert token not in result.output  # a token is not shown


@pytest.mark.parametrize("token", ["", " padded"])
def test_serve_names_where_a_bad_admin_token_came_from(tmp_path: Path, token: str) -> None:
    result = invoke("serve", env={"TRIOINFER_ADMIN_TOKEN": token})
    assert result.exit_code == 2, result.output
    assert "invalid server settings: $TRIOINFER_ADMIN_TOKEN must " in result.output
    config = tmp_path / "server.toml"
    config.write_text(f"admin_token = {token!r}\n")
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2, result.output
    assert f"invalid server settings: admin_token in {config} must " in " ".join(
        result.output.split()
    )


def test_serve_names_the_host_flag_of_an_empty_host() -> None:
    result = invoke("serve", "--host", "")
    assert result.exit_code == 2
    assert "invalid server settings: --host '' is not an address" in result.output


def test_serve_config_help_names_every_key_a_config_file_takes() -> None:
    # The help once left out "loop", which --config accepts.
    text = " ".join(invoke("serve", "--help").output.split())
    listed = text.split("--config FILE A TOML file with any of these options (", 1)[1]
    keys = listed.split(")", 1)[0].split(", ")
    assert sorted(keys) == sorted(serve._SERVE_KEYS - {"limits"})


def test_serve_help_says_the_default_repository_serves_more_than_digits() -> None:
    text = " ".join(invoke("serve", "--help").output.split())
    from trioinfer.server import ModelRepository

    served = {row.name for row in ModelRepository(example_repository()).index()}
    assert len(served) > 1
    assert "With no options it serves the bundled example repository" in text
    # Each bundled model is named, so the help stays true when one is added.
    assert [name for name in sorted(served) if f'"{name}"' not in text] == []


def test_serve_has_no_http_layer_option() -> None:
    # One HTTP stack: Hypercorn and uvicorn are gone, and so is the option that chose them.
    result = invoke("serve", "--help")
    # (--http-ssl-cert and --http-ssl-key are HTTPS's, not a choice of layer.)
    assert re.search(r"--http(?![-\w])", result.output) is None
    assert "--loop" in result.output
    result = invoke("serve", "--http", "hypercorn")
    assert result.exit_code == 2
    assert "No such option '--http'" in result.output


def test_serve_says_why_it_cannot_start(tmp_path: Path) -> None:
    result = invoke("serve", "--model-repository", str(tmp_path / "missing"))
    assert result.exit_code == 1
    assert "ConfigError" in result.output
    assert "does not exist" in result.output
    result = invoke("serve", "--loop", "asyncio", "--model-repository", str(tmp_path / "missing"))
    assert result.exit_code == 1
    assert "does not exist" in result.output


def test_ctrl_c_while_models_load_is_aborted_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Ctrl+C before serve_http watches signals (while models load, or a second one as the
    # server finishes stopping) is trio's KeyboardInterrupt, wrapped by the nurseries it
    # crosses into a BaseExceptionGroup: click's "Aborted!" only knows a bare one.
    async def interrupted(*args: Any, **kwargs: Any) -> None:
        async def load() -> None:
            raise KeyboardInterrupt

        async with anyio.create_task_group() as outer:
            async with anyio.create_task_group() as inner:
                inner.start_soon(load)
            outer.start_soon(anyio.sleep_forever)

    monkeypatch.setattr(serve, "_serve", interrupted)
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        main,
        ["serve", "--no-grpc", "--port", "0", "--model-repository", str(tmp_path / "empty")],
        prog_name="trioinfer",
    )
    assert result.exit_code == 1, result.output
    assert result.output.strip() == "Aborted!"
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_an_error_beside_ctrl_c_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    async def interrupted_and_broken(*args: Any, **kwargs: Any) -> None:
        async def fail() -> None:
            raise RuntimeError("a bug, not the user")

        async def interrupt() -> None:
            raise KeyboardInterrupt

        async with anyio.create_task_group() as tg:
            tg.start_soon(fail)
            tg.start_soon(interrupt)

    monkeypatch.setattr(serve, "_serve", interrupted_and_broken)
    with pytest.raises(BaseExceptionGroup) as raised:
        CliRunner().invoke(main, ["serve", "--no-grpc"], prog_name="trioinfer")
    assert raised.value.subgroup(RuntimeError) is not None


def test_serve_given_the_repository_as_an_argument_says_which_option_takes_it(
    tmp_path: Path,
) -> None:
    # `trioinfer serve models/`, as other servers take it: click's "Got unexpected extra
    # argument (models/)" said what was wrong but not what was expected.
    (tmp_path / "models").mkdir()
    result = invoke("serve", str(tmp_path / "models"))
    assert result.exit_code == 2, result.output
    assert "trioinfer serve takes no arguments" in result.output
    assert f"--model-repository {tmp_path / 'models'}" in result.output
    # Not a directory: perhaps a model's name.
    result = invoke("serve", "--no-grpc", "digits")
    assert result.exit_code == 2, result.output
    assert "got 'digits'" in result.output
    assert "--model digits" in result.output
    # Unknown options are still click's own error.
    assert "No such option '--prot'" in invoke("serve", "--prot", "1").output


def test_bench_given_the_model_as_an_argument_says_to_use_m() -> None:
    result = invoke("bench", "digits")
    assert result.exit_code == 2, result.output
    assert "trioinfer bench takes no arguments, got 'digits'" in result.output
    assert "-m digits" in result.output


def test_serve_on_a_port_in_use_says_which_address(tmp_path: Path) -> None:
    import socket

    (tmp_path / "empty").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke(
            *("serve", "--no-grpc", "--port", str(port)),
            *("--model-repository", str(tmp_path / "empty")),
        )
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in result.output
    # What to do about it, not just the errno's words.
    assert "choose another --port; --port 0 picks a free one" in result.output


def test_serve_says_a_port_is_in_use_before_loading_models(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import socket

    caplog.set_level(logging.INFO)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The bundled repository: without the check its models load, and say so, first.
        result = invoke("serve", "--no-grpc", "--port", str(port), "--log-level", "info")
    assert result.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{port}: " in result.output
    assert not [r for r in caplog.records if r.getMessage().startswith("loaded model")]


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000"])
def test_serve_refuses_a_host_with_a_port(host: str) -> None:
    result = invoke("serve", "--host", host)
    assert result.exit_code == 2
    assert f"--host {host!r} is not an address: give the address alone" in result.output


@pytest.mark.parametrize("host", ["::1", "fe80::1", "localhost", "0.0.0.0"])
def test_an_ipv6_address_or_a_name_is_a_host(host: str) -> None:
    serve._check_host(host)  # no error


def test_serve_on_an_address_not_of_this_host_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): no host has it, so the bind fails.
    result = invoke(
        *("serve", "--no-grpc", "--host", "192.0.2.1", "--port", "0"),
        *("--model-repository", str(tmp_path / "empty")),
    )
    assert result.exit_code == 1
    assert "(it is not an address of this host; 0.0.0.0 listens on all of them)" in result.output


def test_settle_gc_freezes_and_raises_the_first_threshold_only() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        serve._settle_gc()
        assert gc.get_threshold() == (serve.SERVE_GC_THRESHOLD, 10, 10)
        assert gc.get_freeze_count() > 0
        gc.set_threshold(50_000, 10, 10)
        serve._settle_gc()  # never lowers a threshold someone raised further
        assert gc.get_threshold() == (50_000, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.parametrize(("command", "missing"), [("serve", "starlette"), ("bench", "httptools")])
def test_a_command_without_its_extra_says_which_in_one_line(command: str, missing: str) -> None:
    # A fresh interpreter in which the extra's module does not import, as on a lean install.
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from trioinfer.cli import main\n"
        f"main([{command!r}], prog_name='trioinfer')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(
        f"Error: trioinfer {command} needs the {command!r} extra, which is not installed "
        f"(no module named {missing!r}): install trioinfer with it"
    )
    assert done.stderr.count("\n") == 1


def test_a_missing_module_of_trioinfer_itself_is_not_blamed_on_an_extra() -> None:
    with pytest.raises(ModuleNotFoundError):
        needs_extra("serve", ModuleNotFoundError("gone", name="trioinfer.server._gone"))


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("1048576", 1 << 20), ("512KiB", 512 << 10), ("256MiB", 256 << 20), ("1GB", 10**9)],
)
def test_cache_size_takes_bytes_and_units(text: str, size: int) -> None:
    from trioinfer.cli._params import ByteSize

    assert ByteSize().convert(text, None, None) == size


def test_a_rate_limit_resource_that_is_not_one_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke("serve", "--rate-limit-resource", "R1:lots")
    assert result.exit_code == 2
    assert "rate limit resource 'R1:lots' must be NAME:COUNT[:DEVICE]" in result.output
    config = tmp_path / "server.toml"
    config.write_text('rate_limit_resource = ["R1:1:0", "R1:2:0"]\n')
    result = invoke("serve", "--config", str(config))
    assert result.exit_code == 2
    assert "rate limit resource 'R1' is sized twice for cuda:0" in result.output


def test_a_cache_size_that_is_not_one_is_a_usage_error() -> None:
    result = invoke("serve", "--cache-size", "lots")
    assert result.exit_code == 2
    assert "'lots' is not a size" in result.output


@pytest.mark.parametrize("protect", [False, True])
def test_the_banners_request_to_try_sends_the_token_the_index_needs(
    monkeypatch: pytest.MonkeyPatch, protect: bool
) -> None:
    # Under --protect-inference the repository index needs the token: the request the
    # banner said to try was answered 401.
    from trioinfer import server

    async def serve_http(
        repository: Path, *, task_status: anyio.abc.TaskStatus[Any], **options: Any
    ) -> None:
        task_status.started(server.Listening(("http://h:1",), {"m": (1,)}, ()))

    monkeypatch.setattr(server, "serve_http", serve_http)
    flags = ["--admin-token", "s3cret", *(["--protect-inference"] if protect else [])]
    result = CliRunner().invoke(main, ["serve", "--no-grpc", *flags])
    assert result.exit_code == 0, result.output
    token = "-H 'Authorization: Bearer <admin token>' " if protect else ""
    assert f"try: curl -s -X POST {token}http://h:1/v2/repository/index\n" in result.output
    assert "s3cret" not in result.output
