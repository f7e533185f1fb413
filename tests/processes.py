"""The processes a test started (managed servers and their engines), for checking that none is left behind."""

from __future__ import annotations

from typing import Callable

import psutil


def children(match: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """This process's descendants for which ``match`` holds (those that vanish meanwhile are left out)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if match(child):
                out.append(child)
        except (psutil.NoSuchProcess, IndexError):
            pass
    return out


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie awaiting its parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
