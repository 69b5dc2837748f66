"""The sim's interprocess events: an event's record and completion generations in a small
shared-memory file that every process holding the event maps (CUDA's ``cudaIpcEventHandle``
for a device whose streams are host threads)."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable


class _IpcMarks:
    """An interprocess event's state, in a small shared-memory file every process that
    holds the event maps: the generation of its latest record (any process) and of the
    latest one whose work completed. Its work is done when the two are equal; the file
    is removed when the exporting event dies (processes that mapped it keep it)."""

    _next = 0

    def __init__(self, path: str, create: bool) -> None:
        import mmap

        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            raise RuntimeError(f"sim: no interprocess event behind the handle {path!r}: the "
                               f"event that exported it was destroyed (keep it alive in the "
                               f"exporting process while others wait for it)") from None
        try:
            if create:
                os.ftruncate(fd, 16)
            self.map = mmap.mmap(fd, 16)
        finally:
            os.close(fd)
        self.path = path
        self.words = (ctypes.c_int64 * 2).from_buffer(self.map)
        if create:
            import weakref

            weakref.finalize(self, _unlink, path)

    @classmethod
    def new(cls) -> _IpcMarks:
        import tempfile

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        cls._next += 1
        return cls(os.path.join(folder, f"torchport-sim-event-{os.getpid()}-{cls._next}-"
                                        f"{os.urandom(4).hex()}"), create=True)

    def record(self) -> int:
        """A new generation for a record; the caller marks it :meth:`done` once reached."""
        gen = self.words[0] + 1
        self.words[0] = gen
        return gen

    def done(self, gen: int) -> None:
        if self.words[1] < gen:
            self.words[1] = gen

    def pending(self) -> int:
        """The generation to wait for (0: nothing outstanding)."""
        gen = self.words[0]
        return 0 if self.words[1] >= gen else gen

    def wait(self, gen: int, stop: Callable[[], bool] = bool) -> None:
        """Block until generation ``gen`` completed (in whichever process recorded it)."""
        pause = 1e-5
        while self.words[1] < gen and not stop():
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
