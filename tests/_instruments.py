"""Trio instruments the tests share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio
import trio.abc
import trio.lowlevel


class Steps(trio.abc.Instrument):
    """Counts the times *task* resumes: its yields to the event loop, as they end."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += task is self.task


@contextmanager
def counting_steps() -> Iterator[Steps]:
    """Count the current task's steps during the block; the instrument goes however it ends."""
    steps = Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        yield steps
    finally:
        trio.lowlevel.remove_instrument(steps)
