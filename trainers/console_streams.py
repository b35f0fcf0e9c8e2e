"""Standard output and error that a reader may stop reading: `indextts-inspect run/latest.pth | head -3`.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError: a traceback in the
user's terminal and status 1, or a tool stopped half-way (render_samples between two WAV files). Every tool's
main() therefore runs inside `quiet_broken_pipes()`: once a stream's reader has gone, what is written to it is
dropped, the tool finishes its work and exits with its own status (0 when that work succeeded). A reader that
stopped early is not the tool's failure, so it does not exit 141 the way `yes | head` does, and a script under
`set -o pipefail` is not failed by a `| head`. The trainer needs none of this: argparse drops an OSError of
--help, and its log lines go through logging, whose handlers drop OSError.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterable, Iterator, TextIO


class _ReaderMayLeave:
    """A text stream that drops writes after its reader has gone, instead of raising BrokenPipeError."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._reader_left()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        self.reader_gone = True
        # What the stream still buffers is flushed again at exit: into /dev/null, not into the dead pipe
        # (which would print "Exception ignored ... BrokenPipeError" as the interpreter shuts down).
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...: the wrapped stream's
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_broken_pipes() -> Iterator[None]:
    """Inside: sys.stdout and sys.stderr drop what they are given once their reader has gone.

    Also a decorator (`@quiet_broken_pipes()` on a command's main); nesting is harmless."""
    saved = sys.stdout, sys.stderr
    sys.stdout = _ReaderMayLeave(saved[0])  # type: ignore[assignment]
    sys.stderr = _ReaderMayLeave(saved[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        for wrapper in (sys.stdout, sys.stderr):
            wrapper.flush()  # while BrokenPipeError is still caught
        sys.stdout, sys.stderr = saved
