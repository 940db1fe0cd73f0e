"""Reading ``snapshot-file`` pushes of `agentspec._push.intake.ShardIntake` from shared memory.

The path must resolve strictly under the intake's ``shm_dir``; the file is
then opened one component at a time with O_NOFOLLOW (a component swapped for
a symlink after the check fails instead of leading elsewhere) and
O_NONBLOCK (a FIFO cannot block the handler), and only a regular file of at
most ``max_body_bytes`` is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentspec._push._intake_base import _IntakeBase, _RefusedError
from agentspec._push.wire import ErrorType

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class _SnapshotFiles(_IntakeBase):
    """Reads snapshot files from the shared-memory directory (refusals raise)."""

    def _read_shm_file(self, raw: str, shm: Path) -> bytearray:
        """The bytes of a snapshot file strictly under ``shm`` (refusals raise).

        Symlinks are resolved first and the result must lie under ``shm``
        (403 otherwise).  The file is then opened relative to ``shm`` one
        component at a time with O_NOFOLLOW, so a path changed into a symlink
        after the check fails instead of leading elsewhere; O_NONBLOCK keeps
        a FIFO from blocking the handler.  Only a regular file (checked on the
        opened descriptor) of at most ``max_body_bytes`` is read (400, 413).
        """
        try:
            os.fsencode(raw)
            resolved = Path(raw).resolve()
        except (OSError, RuntimeError, ValueError):  # not encodable, a symlink loop
            raise _RefusedError(
                self._error(400, "cannot resolve the snapshot file path", ErrorType.INVALID_REQUEST)
            ) from None
        if not resolved.is_relative_to(shm) or resolved == shm:
            raise _RefusedError(
                self._error(
                    403, f"path is outside the allowed directory {shm}", ErrorType.FORBIDDEN
                )
            )
        parts = resolved.relative_to(shm).parts
        try:
            fd = _open_beneath(shm, parts)
        except OSError as e:
            raise _RefusedError(
                self._error(
                    400,
                    f"cannot open snapshot file: {e.strerror or 'error'}",
                    ErrorType.INVALID_REQUEST,
                )
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _RefusedError(
                    self._error(
                        400, "snapshot file is not a regular file", ErrorType.INVALID_REQUEST
                    )
                )
            size = st.st_size
            if size > self.max_body_bytes:
                raise _RefusedError(
                    self._error(
                        413,
                        f"snapshot file of {size} bytes exceeds the limit of {self.max_body_bytes}",
                        ErrorType.PAYLOAD_TOO_LARGE,
                    )
                )
            data = bytearray(size)
            try:
                got = _read_into(fd, data)
            except OSError as e:
                raise _RefusedError(
                    self._error(
                        400,
                        f"cannot read snapshot file: {e.strerror or 'error'}",
                        ErrorType.INVALID_REQUEST,
                    )
                ) from None
            if got != size:
                raise _RefusedError(
                    self._error(
                        400, "snapshot file changed while being read", ErrorType.INVALID_REQUEST
                    )
                )
            return data
        finally:
            os.close(fd)


def _open_beneath(base: Path, parts: tuple[str, ...]) -> int:
    """Open ``base/parts...`` for reading without following any symlink below ``base``.

    Directories are opened with O_DIRECTORY | O_NOFOLLOW one at a time, the
    file with O_NOFOLLOW | O_NONBLOCK (a FIFO opens at once instead of
    waiting for a writer; reading a regular file is unaffected).
    """
    dirfd = os.open(base, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dirfd)
            os.close(dirfd)
            dirfd = nxt
        return os.open(
            parts[-1],
            os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_NOCTTY | _O_CLOEXEC,
            dir_fd=dirfd,
        )
    finally:
        os.close(dirfd)


def _read_into(fd: int, buf: bytearray) -> int:
    """Fill ``buf`` from ``fd``; the number of bytes read (short at end of file)."""
    view = memoryview(buf)
    got = 0
    try:
        while got < len(buf):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
    finally:
        view.release()
    return got
