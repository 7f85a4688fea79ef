"""Files that `policy init` and `policy unwrap` read and write, handled so that none can turn on them.

Reads take regular files only, bounded (a FIFO or a device never hangs or floods them). Writes never
follow a symbolic link (a link planted where a policy or a backup goes would redirect it, secrets
included): they go to a new file beside the target and replace it in one rename. A backup never
overwrites another backup whose content differs: `FILE.bak`, then `FILE.bak.1`, `FILE.bak.2`, ...
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from commitgate.server.model.errors import UserFacingError

MAX_READ_BYTES = 16 * 1024 * 1024  # far above any client config or policy
MAX_BACKUPS = 1000
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class FileRefused(UserFacingError):
    """A file init will not read or write as it stands: which, and what to do."""


def read_regular(path: Path, limit: int = MAX_READ_BYTES) -> bytes:
    """The bytes of the regular file at `path`; a FIFO, device or directory is refused, never waited on."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC)
    with contextlib.closing(os.fdopen(fd, "rb")) as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileRefused(f"{path}: not a regular file; give the path of the file itself")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(f"{path}: larger than {limit // (1024 * 1024)} MiB; that is no config or policy")
    return data


def refuse_link(path: Path) -> None:
    """Refuse to write at `path` when a symbolic link (or anything but a regular file) is there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise FileRefused(
            f"{path} is a symbolic link (to {os.readlink(path)}); init never writes through links:"
            " remove the link, or name the file it points to"
        )
    if not stat.S_ISREG(mode):
        raise FileRefused(f"{path} is not a regular file; move it away or name another file")


def permissions(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def replace_file(path: Path, data: bytes, mode: int) -> None:
    """Write `data` at `path` with permissions `mode` (less the umask for a new file), never through
    a link: a new file beside it, renamed over it (a crash leaves the old file or the new one)."""
    refuse_link(path)
    existed = path.exists()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as file:
            if existed:
                os.fchmod(file.fileno(), mode)  # as the file was (the umask applies to new ones only)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def backup_slot(path: Path, data: bytes) -> tuple[Path, bool]:
    """Where a backup of `data` (the file's content before a rewrite) goes: `FILE.bak`, else the first
    `FILE.bak.N` that is free or already holds exactly `data` (then True); a link there is refused."""
    for n in range(MAX_BACKUPS):
        candidate = path.with_name(f"{path.name}.bak" + (f".{n}" if n else ""))
        try:
            kind = os.lstat(candidate).st_mode
        except FileNotFoundError:
            return candidate, False
        if stat.S_ISLNK(kind):
            raise FileRefused(
                f"{candidate} is a symbolic link (to {os.readlink(candidate)}); a backup is never written"
                " through a link: remove it and run again"
            )
        if stat.S_ISREG(kind) and read_regular(candidate) == data:
            return candidate, True
    raise FileRefused(f"{path} has {MAX_BACKUPS} backups already; move some away and run again")


def backup(path: Path, data: bytes, mode: int) -> tuple[Path, bool]:
    """Keep `data` in the backup slot of `path`; returns it and whether it was written now."""
    candidate, there = backup_slot(path, data)
    if not there:
        fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    return candidate, not there
