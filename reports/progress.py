"""Progress bars for work that takes more than a few seconds (profiling, executor iterations,
sweeps): a rich bar on a terminal, nothing at all otherwise (tests, CI, logs, pipes).

    from reports.progress import track, task
    for step in track(range(steps), "executor iterations"):
        ...
    with task("profiling layers", total=len(layers)) as advance:
        for layer in layers:
            ...
            advance()

The bar is transient (erased when done) and goes to stdout, so a terminal user sees it while it
runs and the printed summary stays clean. rich is imported only when a bar is shown.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def interactive() -> bool:
    """True when stdout is a terminal (the only case where a bar is drawn)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


def _bar(enabled: bool | None):
    if not (interactive() if enabled is None else enabled):
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), transient=True)


def track(items: Iterable[T], description: str = "working", total: int | None = None, *,
          enabled: bool | None = None) -> Iterator[T]:
    """Yield ``items`` one by one, advancing a bar per item (``total`` defaults to len(items)).
    ``enabled`` None: draw only on a terminal."""
    bar = _bar(enabled)
    if bar is None:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar:
        tid = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(tid)


@contextmanager
def task(description: str, total: int | None = None, *, enabled: bool | None = None) -> Iterator[Callable[..., None]]:
    """Context manager yielding ``advance(n=1)``; draws a bar only on a terminal."""
    bar = _bar(enabled)
    if bar is None:
        yield lambda n=1: None
        return
    with bar:
        tid = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(tid, n)


@contextmanager
def after(description: str, delay_s: float = 2.0, *, enabled: bool | None = None) -> Iterator[Callable[[int, int], None]]:
    """Context manager yielding ``progress(done, total)`` for a pure search that reports its own
    progress (planners take it as an argument and know no clocks): a bar appears only once the
    work has run ``delay_s`` seconds, and only on a terminal."""
    import time

    start, state = time.monotonic(), {"bar": None, "tid": None}
    if not (interactive() if enabled is None else enabled):
        yield lambda done, total: None
        return

    def progress(done: int, total: int) -> None:
        if state["bar"] is None:
            if time.monotonic() - start < delay_s:
                return
            state["bar"] = _bar(True)
            state["bar"].start()
            state["tid"] = state["bar"].add_task(description, total=total)
        state["bar"].update(state["tid"], completed=done, total=total)

    try:
        yield progress
    finally:
        if state["bar"] is not None:
            state["bar"].stop()
