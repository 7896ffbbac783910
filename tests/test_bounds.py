"""Durations and priority levels out of range are refused, with one message, everywhere."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from trioinfer import ConfigError, ModelConfig, SequenceConfig
from trioinfer.cli import main
from trioinfer.lowlevel import check_seconds
from trioinfer.server import Limits, ServerConfig
from trioinfer_batching import DynamicBatcher
from trioinfer_fallback import Breaker, Resilient
from trioinfer_scheduling import PriorityScheduler

RANGE = r"must be a number of seconds from 1e-06 \(a microsecond\) to 18446744073709 "

#: Each place that takes a duration, as a function of the duration.
DURATIONS: dict[str, Callable[[Any], object]] = {
    "queue_timeouts": lambda s: ModelConfig(name="m", queue_timeouts={"0": s}),
    "max_sequence_idle": lambda s: SequenceConfig(max_sequence_idle=s),
    "max_queue_delay": lambda s: DynamicBatcher(max_queue_delay=s),
    "max_wait": lambda s: PriorityScheduler(max_wait=s),
    "reset_timeout": lambda s: Breaker(reset_timeout=s),
    "max_reset_timeout": lambda s: Breaker(max_reset_timeout=s),
    "backoff": lambda s: Resilient(backoff=s),
    "max_backoff": lambda s: Resilient(max_backoff=s),
    "timeout": lambda s: Resilient(timeout=s),
    "hedge_after": lambda s: Resilient(hedge_after=s),
    "repository_poll_secs": lambda s: ServerConfig(repository_poll_s=s),
    "drain_period": lambda s: ServerConfig(drain_period=s),
    "head_timeout": lambda s: Limits(head_timeout=s),
    "body_timeout": lambda s: Limits(body_timeout=s),
    "send_timeout": lambda s: Limits(send_timeout=s),
}


@pytest.mark.parametrize("value", [1e300, 2.0**64, 1e-300, 1e-7, -1.0, math.nan])
@pytest.mark.parametrize("key", sorted(DURATIONS))
def test_a_duration_out_of_range_is_refused_naming_key_value_and_range(
    key: str, value: float
) -> None:
    # 1e300 overflowed Triton's uint64 max_queue_delay_microseconds in the model's
    # config (a 500 on /v2/models/m/config), 1e-300 polled the repository in a busy loop.
    with pytest.raises(ConfigError, match=rf"{key}.*{RANGE}.*got {re.escape(repr(value))}"):
        DURATIONS[key](value)


@pytest.mark.parametrize("key", sorted(DURATIONS))
def test_an_integer_too_large_for_a_float_is_refused_as_out_of_range(key: str) -> None:
    # float(10**400) raised OverflowError: a crash, not the ConfigError naming the range.
    with pytest.raises(ConfigError, match=rf"{key}.*{RANGE}.*got 1000"):
        DURATIONS[key](10**400)


@pytest.mark.parametrize("key", sorted(DURATIONS))
def test_the_bounds_themselves_are_accepted(key: str) -> None:
    DURATIONS[key](1e-6)
    DURATIONS[key](18446744073709)


@pytest.mark.parametrize(
    ("zero", "never", "accepted"),
    [
        (False, False, []),
        (True, False, [0]),
        (False, True, [math.inf]),
        (True, True, [0, math.inf]),
    ],
)
def test_check_seconds_takes_0_and_inf_only_where_asked(
    zero: bool, never: bool, accepted: list[float]
) -> None:
    for value in (0, math.inf):
        if value in accepted:
            assert check_seconds("x", value, zero=zero, never=never) == value
        else:
            with pytest.raises(ConfigError, match="x must be a number of seconds"):
                check_seconds("x", value, zero=zero, never=never)
    for value in (True, "5ms", None):
        with pytest.raises(ConfigError, match=f"got {value!r}"):
            check_seconds("x", value, zero=True, never=True)


@pytest.mark.parametrize("key", ["queue_timeouts", "queue_sizes"])
@pytest.mark.parametrize("level", [2**31 + 1, -(2**31) - 1, 10**30])
def test_a_priority_level_out_of_range_is_refused(key: str, level: int) -> None:
    # No request can carry such a level (the HTTP and gRPC priority is -2**31 to 2**31):
    # the entry was taken and never applied.
    with pytest.raises(
        ConfigError, match=rf"{key}: priority level {level} is out of range: levels go from"
    ):
        ModelConfig(name="m", **{key: {str(level): 1}})
    ModelConfig(name="m", **{key: {str(2**31): 1, str(-(2**31)): 1}})


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--repository-poll-secs", "1e-300"), "--repository-poll-secs"),
        (("--repository-poll-secs", "1e300"), "--repository-poll-secs"),
        (("--drain-period", "1e300"), "--drain-period"),
        (("--exit-timeout-secs", "1e300"), "--exit-timeout-secs"),
    ],
)
def test_serve_refuses_a_duration_out_of_range_as_a_usage_error(
    tmp_path: Path, args: tuple[str, ...], said: str
) -> None:
    missing = str(tmp_path / "no-repository")  # before the fix: it went on to read it
    result = CliRunner().invoke(main, ["serve", "--model-repository", missing, *args])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert said in output, output
    assert "must be a number of seconds from 1e-06" in output, output
    assert f"got {float(args[1])!r}" in output, output


def test_serve_refuses_a_config_files_duration_out_of_range(tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text("repository_poll_secs = 1e300\n")
    missing = str(tmp_path / "no-repository")
    args = ["serve", "--model-repository", missing, "--config", str(config)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "repository_poll_secs = 1e+300" in output, output
    assert "must be a number of seconds from 1e-06" in output, output
