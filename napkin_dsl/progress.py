"""Progress on stderr for commands that take longer than about a second.

:class:`Progress` is one task's line on stderr, drawn with tqdm: a bar once the task reports
``(done, total)`` (the callback :func:`napkin_dsl.tune.tune` takes as ``progress=``), until
then the elapsed time, refreshed by a background thread so that a long NumPy run is never
silent. Nothing is drawn before :data:`DELAY_S` seconds, so quick commands print exactly what
they printed before; the line is erased when the task ends.

:func:`wanted` decides whether to draw at all: only when stderr is a terminal, never for
``--json`` (whose stdout a program reads, and whose stderr may be kept as a log), never when
``NAPKIN_PROGRESS=0``, and never without tqdm.

Deliberately not here: timing a task for a report (the backends time what they run), logging,
or progress inside the stages themselves; a stage that can say how far it is takes a
``progress(done, total)`` callback and knows nothing of terminals.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TextIO

__all__ = ["DELAY_S", "Progress", "wanted"]

# Below this, a task draws nothing: about the time a user starts to wonder whether it hangs.
DELAY_S = 1.0
# How often the elapsed time is redrawn while the task says nothing.
REFRESH_S = 0.5


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a convenience: without tqdm the commands run silently, as before
        return None
    return tqdm


def wanted(json_output: bool = False, stream: TextIO | None = None) -> bool:
    """Whether to draw progress on ``stream`` (stderr by default)."""
    stream = sys.stderr if stream is None else stream
    if json_output or os.environ.get("NAPKIN_PROGRESS", "1") == "0" or _tqdm() is None:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """One task's progress line; a context manager, and a ``(done, total)`` callback.

    >>> with Progress("tune attention", enabled=False) as progress:
    ...     progress(3, 10)   # drawn only when enabled, after DELAY_S
    """

    def __init__(self, description: str, enabled: bool, stream: TextIO | None = None, delay_s: float | None = None):
        self.description = description
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.delay_s = DELAY_S if delay_s is None else delay_s
        self._bar = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._done: tuple[int, int] | None = None

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()  # leave=False: the line is erased
                self._bar = None

    def __call__(self, done: int, total: int) -> None:
        """The task has done ``done`` of ``total`` steps."""
        if not self.enabled:
            return
        with self._lock:
            self._done = (int(done), int(total))
            if self._bar is not None:
                self._draw()

    def __enter__(self) -> Progress:  # noqa: PYI034 - typing.Self needs Python 3.11
        if self.enabled:
            self._started = time.monotonic()
            if self.delay_s <= 0:
                self._show()  # no delay: the line is there before the task starts
            self._thread = threading.Thread(target=self._heartbeat, name="napkin-progress", daemon=True)
            self._thread.start()
        return self

    def _heartbeat(self) -> None:
        if self._stop.wait(self.delay_s):
            return
        while True:
            self._show()
            if self._stop.wait(REFRESH_S):
                return

    def _show(self) -> None:
        with self._lock:
            if self._bar is None:
                self._bar = _tqdm()(desc=self.description, total=None, file=self.stream, leave=False,
                                    bar_format="{desc}: {elapsed}", dynamic_ncols=True)
                # tqdm counts from its own start (its own clock); the task began up to DELAY_S earlier.
                self._bar.start_t -= time.monotonic() - self._started
            self._draw()

    def _draw(self) -> None:
        """Redraw, under the lock: a bar when the task said how far it is, else the elapsed time."""
        bar = self._bar
        if self._done is not None:
            done, total = self._done
            bar.bar_format = None  # tqdm's own: description, percentage, bar, n/total, elapsed<remaining
            bar.total = total
            bar.n = done
        bar.refresh()
