"""The directory lock of a `ShardStore`: an exclusive ``fcntl.flock`` on ``<path>/LOCK``."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from agentspec.exceptions import StoreLockedError

__all__ = ["DirLock", "StoreLockedError"]


class DirLock:
    """An exclusive ``fcntl.flock`` on ``<dir>/LOCK`` (mode 0600), held until `release`."""

    def __init__(self, path: Path, timeout: float) -> None:
        """Take the lock, waiting up to ``timeout`` seconds.

        Raises:
            StoreLockedError: another holder kept it for ``timeout`` seconds.
        """
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    holder = self._holder(fd)
                    os.close(fd)
                    raise StoreLockedError(
                        f"shard store {path.parent} is in use by another ShardStore"
                        f"{holder}; close it first or open with a lock_timeout to wait",
                        f"lock_timeout {timeout}",
                    ) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 0.1)
            except BaseException:
                os.close(fd)
                raise
        self._fd: int | None = fd
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    @staticmethod
    def _holder(fd: int) -> str:
        """`` (pid N)`` from the lock file, when readable."""
        try:
            text = os.pread(fd, 32, 0).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            return ""
        return f" (pid {text})" if text.isdigit() else ""

    def release(self) -> None:
        """Release the lock (releasing twice is allowed)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the flock
