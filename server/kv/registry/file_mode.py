"""The registry file's permissions: it lists every tenant's sessions, so only its owner reads it.

:func:`private_file` runs before SQLite opens the file: folders it has to make are made 0700,
the file is made 0600 (created empty, which SQLite takes for an empty database), and an older
file that was readable by others (0644 under umask 022) is tightened, with its ``-wal`` and
``-shm``. SQLite creates those two with the database file's mode, so they stay 0600 too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

FILE_MODE = 0o600
DIR_MODE = 0o700
SIDE_FILES = ("-wal", "-shm", "-journal")
"""The files SQLite keeps beside a database (write-ahead log, its index, rollback journal)."""


def private_dir(folder: Path) -> None:
    """Make ``folder`` and any missing parent, each 0700 (existing folders are left as they
    are: they may be shared on purpose)."""
    missing: list[Path] = []
    at = Path(folder)
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            made.mkdir(mode=DIR_MODE)
            os.chmod(made, DIR_MODE)  # whatever the umask


def private_file(path: Path) -> None:
    """Create ``path`` (and its folder) readable by its owner only, or tighten it and its
    SQLite side files when others may read them."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
    os.close(fd)
    for p in (path, *(Path(f"{path}{s}") for s in SIDE_FILES)):
        try:
            mode = stat.S_IMODE(p.stat().st_mode)
            if mode & 0o077:
                os.chmod(p, mode & ~0o077)
        except FileNotFoundError:
            continue
        except OSError as exc:  # not its owner: say so, open it anyway
            log.warning("session registry: cannot make %s private (%s)", p, exc)
