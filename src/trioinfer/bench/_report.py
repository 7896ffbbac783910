"""The report: the results table, the progress display, and JSON, CSV and plot files.

rich and matplotlib (the ``bench`` extra) are imported only here and only when
used: without rich the table and the progress line are plain text; without
matplotlib ``--plot`` says what to install.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

from ._inputs import BenchError
from ._stats import Progress, Result

# Open loop: past this share of requests late or dropped, the table says so.
_BEHIND_SHARE: Final = 0.01
_COLUMNS: Final = (
    ("req/s", 9),
    ("p50 ms", 8),
    ("p90 ms", 8),
    ("p95 ms", 8),
    ("p99 ms", 8),
    ("max ms", 8),
    ("errors", 8),
    ("CPU us/req", 10),
    ("cores", 6),
    ("windows", 8),
)


def _table(results: Sequence[Result]) -> tuple[list[tuple[str, int]], list[list[str]]]:
    # The columns (name, width) and one row of cells per level.
    open_loop = results[0].load == "rate"
    first = ("rate/s", 8) if open_loop else ("concurrency", 11)
    columns = [first, *_COLUMNS]
    if open_loop:
        # The rate achieved and how late requests left, beside the rate asked.
        columns.insert(1, ("sent/s", 9))
        columns.insert(9, ("late", 7))
        columns.insert(10, ("dropped", 7))
        columns.insert(11, ("delay p99", 9))
    # Streaming: responses per second and the time to the first response beside the
    # requests; the latency columns are then the time to the last response.
    streaming = results[0].first_response_ms is not None
    if streaming:
        at = 3 if open_loop else 2
        columns[at:at] = [("resp/s", 9), ("first p50", 9), ("first p99", 9)]
    rows = []
    for r in results:
        lat = r.latency_ms
        cells = [
            f"{r.value:g}",
            f"{r.throughput:,.0f}",
            *(f"{lat[k]:.2f}" for k in ("p50", "p90", "p95", "p99", "max")),
            str(sum(r.errors.values())),
            f"{r.cpu_us_per_request:.1f}",
            f"{r.cores:.2f}",
            f"{r.windows}{'*' if r.stable is False else ''}",
        ]
        if open_loop:
            delay = (r.send_delay_ms or {}).get("p99", math.nan)
            cells.insert(1, f"{r.sent_per_s or 0.0:,.0f}")
            cells.insert(9, str(r.late))
            cells.insert(10, str(r.dropped))
            cells.insert(11, f"{delay:.2f}")
        if streaming:
            to_first = r.first_response_ms or {}
            at = 3 if open_loop else 2
            cells[at:at] = [
                f"{r.responses_per_s or 0.0:,.0f}",
                f"{to_first.get('p50', math.nan):.2f}",
                f"{to_first.get('p99', math.nan):.2f}",
            ]
        rows.append(cells)
    return columns, rows


def _notes(results: Sequence[Result]) -> list[str]:
    # What the table cannot say in a cell: errors by status, overload, instability.
    lines = []
    failed = Counter[str]()
    for r in results:
        failed.update(r.errors)
    if failed:
        lines.append(
            "errors by status: " + ", ".join(f"{k} x {v}" for k, v in sorted(failed.items()))
        )
    for r in results:
        behind = r.late + r.dropped
        if r.load == "rate" and behind > _BEHIND_SHARE * (r.completed + r.dropped):
            delay = (r.send_delay_ms or {}).get("p99", math.nan)
            lines.append(
                f"at {r.value:g}/s the server (or this tool) could not keep up: "
                f"{r.sent_per_s or 0.0:,.0f}/s sent, {r.late} requests waited for a free "
                f"connection, {r.dropped} were dropped, p99 send delay {delay:.2f} ms; "
                "their wait is latency"
            )
    if results and results[0].first_response_ms is not None:
        lines.append(
            "streaming: latency is to each request's last response; first p50/p99: ms to its first"
        )
    if any(r.stable is False for r in results):
        lines.append("* not stable within the bound after the last window")
    return lines


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, one row per level, and notes under it."""
    if not results:
        return ""
    columns, rows = _table(results)
    lines = ["  ".join(name.rjust(width) for name, width in columns)]
    for cells in rows:
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, columns, strict=True)))
    return "\n".join([*lines, *_notes(results)])


def print_table(results: Sequence[Result]) -> None:
    """Print the results on stdout: a rich table on a terminal when rich is installed.

    Anywhere else (a pipe, a file, no rich, a terminal too narrow for every
    digit) it prints `format_table`'s plain text, which scripts can parse.
    """
    if not results:
        return
    if not sys.stdout.isatty():
        print(format_table(results))
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(results))
        return
    columns, rows = _table(results)
    console = Console()
    if console.width < sum(width + 2 for _, width in columns):
        # Too narrow: rich would elide digits; plain lines wrap but keep every one.
        print(format_table(results))
        return
    table = Table(box=None, header_style="bold")
    for name, _ in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for cells in rows:
        table.add_row(*cells)
    console.print(table)
    for line in _notes(results):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _describe(p: Progress) -> tuple[str, str]:
    # The level, and where it is: "[2/4] concurrency 16", "window 3/10  19,780 req/s ...".
    phase = "warm-up" if p.window == 0 else f"window {p.window}/{p.windows}"
    rate = "-" if math.isnan(p.throughput) else f"{p.throughput:,.0f}"
    status = f"{phase}  {rate} req/s"
    if not math.isnan(p.p99_ms):
        status += f"  last p99 {p.p99_ms:.2f} ms"
    return f"[{p.index + 1}/{p.levels}] {p.level}", status


@contextmanager
def open_progress() -> Iterator[Callable[[Progress], None] | None]:
    """Show the run's progress on stderr while the block runs, if stderr is a terminal.

    With rich installed (the ``bench`` extra) it is a progress bar
    through the current warm-up or window, with its throughput so far; without,
    one status line. Either is redrawn only when the benchmark reports (4 times a
    second) and erased at the end. Yields ``None`` when stderr is not a terminal:
    then nothing is drawn and the benchmark does not wake up to report.
    """
    if not sys.stderr.isatty():
        yield None
        return
    try:
        import rich.progress
        from rich.console import Console
    except ImportError:

        def show_line(p: Progress) -> None:
            level, status = _describe(p)
            sys.stderr.write(f"\r\x1b[K{level}: {status}")
            sys.stderr.flush()

        try:
            yield show_line
        finally:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        return
    bar = rich.progress.Progress(
        rich.progress.TextColumn("{task.description}"),
        rich.progress.BarColumn(),
        rich.progress.TextColumn("{task.fields[status]}"),
        console=Console(stderr=True),
        auto_refresh=False,  # no refresh thread: redrawn when the benchmark reports
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    task = bar.add_task("", total=1.0, status="")

    def show_bar(p: Progress) -> None:
        level, status = _describe(p)
        bar.update(task, description=level, completed=p.fraction, status=status)
        bar.refresh()

    with bar:
        yield show_bar


def write_json(path: Path, results: Sequence[Result], about: Mapping[str, Any]) -> None:
    """Write the run's settings and one object per level as JSON."""
    doc = {**about, "results": [r.row() for r in results]}
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")


def write_csv(path: Path, results: Sequence[Result]) -> None:
    """Write one CSV row per level, with a header."""
    rows = [r.row() for r in results]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["load"])
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path: Path, results: Sequence[Result], title: str) -> None:
    """Plot latency percentiles against throughput across the levels (needs matplotlib).

    Raises:
        BenchError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib, which the 'bench' extra installs") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r.throughput for r in results]
    for key in ("p50", "p90", "p95", "p99"):
        ax.plot(x, [r.latency_ms[key] for r in results], marker="o", label=key)
    for r in results:
        tag = f"c={r.value:g}" if r.load == "concurrency" else f"{r.value:g}/s"
        ax.annotate(
            tag,
            (r.throughput, r.latency_ms["p99"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(visible=True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
