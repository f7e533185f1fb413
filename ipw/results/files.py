"""How a run folder's files are written: atomically (a temporary file, fsynced, renamed), appended and fsynced,
and opened only where they are the folder's own (never through a link)."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ipw.errors import IpwError
from ipw.results.schema import escape_surrogates

if TYPE_CHECKING:  # imported where used: `import ipw` stays light (tests/commands/test_startup.py)
    import pandas as pd


def new_run_id(now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def write_error(path: Path, exc: OSError) -> IpwError:
    """An OS error writing a run folder's file (the disk is full, a quota, a file size limit, a read-only
    file system) as one line naming the file."""
    what = exc.strerror or type(exc).__name__
    return IpwError(f"{path}: cannot write it ({what}); free space or choose another --out, then "
                    f"ipw run --resume {path.parent}")


def atomic_write(path: Path, tmp: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)``, then rename it to ``path``: a crash never leaves a truncated file, and an OS error
    (disk full) leaves no temporary file and raises an IpwError naming ``path``."""
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None
    except BaseException:  # e.g. a damaged record found while the file was being written
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_parquet(frame: pd.DataFrame, path: Path) -> None:
    atomic_write(path, path.with_suffix(".parquet.tmp"), lambda tmp: frame.to_parquet(tmp, index=False))


def json_text(data: dict[str, Any]) -> str:
    from ipw.sanitize import scrub  # e.g. a ``reason`` that quotes an exception which quoted a header

    return escape_surrogates(scrub(json.dumps(data, indent=2, ensure_ascii=False, default=str)), in_json=True) + "\n"


def atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    text = json_text(data)
    atomic_write(path, path.with_suffix(".tmp"), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def rewrite_in_place(path: Path, text: str) -> bool:
    """Overwrite ``path`` in the blocks it already has (when the disk is too full for a temporary copy):
    only when ``text`` fits in them, so that no new block is needed. Whether it was written."""
    data = text.encode("utf-8")
    try:
        if len(data) > path.stat().st_blocks * 512:
            return False
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def own_file(path: Path) -> Path:
    """``path`` as a file of a run folder: a symbolic link (to a file outside it, say) is refused, so that
    no reader trusts and no writer appends to a file the folder does not hold."""
    if path.is_symlink():
        raise IpwError(f"{path}: a symbolic link; a run folder holds its own files (copy the target there)")
    return path


def append_synced(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` in one write and fsync it (an OS error: an IpwError naming the file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        with open(fd, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise write_error(path, exc) from None


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def complete_length(log: Path) -> int:
    """The bytes of a log up to its last newline (read back from the end, not the whole file)."""
    with open(log, "rb") as fh:
        pos = fh.seek(0, os.SEEK_END)
        while pos > 0:
            start = max(0, pos - (1 << 20))
            fh.seek(start)
            cut = fh.read(pos - start).rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            pos = start
    return 0


def cut_torn_tail(log: Path) -> None:
    """Cut a log after its last newline: the query in flight when the process died."""
    whole = complete_length(log)
    if whole != log.stat().st_size:
        os.truncate(log, whole)
