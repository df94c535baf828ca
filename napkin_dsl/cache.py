"""napkin's on-disk cache: where it lives, and how files get there safely.

NVRTC's output by source (``backends/nvrtc.py``), compiled kernels by what their source is
made from (``backends/compiled.py``) and the parse tables of the grammar (``syntax.py``) are
cached under :func:`cache_root`. Every file is written to a temporary file in the same
directory and renamed into place, so concurrent processes never read half a file; a file
that cannot be read is treated as a miss and rebuilt.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """napkin's cache directory: $NAPKIN_CACHE_DIR, else the platform's user cache directory."""
    if override := os.environ.get("NAPKIN_CACHE_DIR"):
        return Path(override).expanduser()
    try:
        import platformdirs
    except ImportError:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "napkin"
    return Path(platformdirs.user_cache_dir("napkin", appauthor=False))


def write_atomically(path: str | os.PathLike, data: bytes, *, create_parents: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (atomic on POSIX).

    The file gets the permissions a plain ``open()`` would give it (0o666 less the umask).
    A missing directory is an error for user files; caches pass ``create_parents=True``.
    """
    from .errors import NapkinError

    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if create_parents:
        directory.mkdir(parents=True, exist_ok=True)
    elif not directory.is_dir():
        raise NapkinError(f"cannot write {path}: no directory {directory}")
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        umask = os.umask(0)  # mkstemp makes the file private; read the umask to undo that
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
