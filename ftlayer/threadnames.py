"""Threads named for the operating system too: `top -H`, `ps -L`, py-spy and /proc show
which of an FT-layer process's threads spends the CPU (on Linux, the thread's
/proc/self/task/<tid>/comm, which keeps 15 characters; elsewhere only Python knows the
name).

`named_thread(target, "deleter")` is a daemon thread called `ftlayer-deleter` in Python
and `ftl-deleter` for the system.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

__all__ = ["OS_PREFIX", "named_thread", "set_os_thread_name"]

OS_PREFIX: Final = "ftl-"
_OS_NAME_MAX: Final = 15


def set_os_thread_name(name: str) -> None:
    """Name the calling thread `ftl-<name>` for the system (cut to 15 characters);
    nothing where the system has no such name."""
    with contextlib.suppress(OSError):
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        comm.write_text(f"{OS_PREFIX}{name}"[:_OS_NAME_MAX])


def named_thread(
    target: Callable[..., Any],
    name: str,
    args: tuple[Any, ...] = (),
    *,
    detail: str = "",
) -> threading.Thread:
    """A daemon thread running target(*args), named `ftlayer-<name>[-<detail>]` in
    Python and `ftl-<name>` for the system (threads of one role share that name)."""

    def run() -> None:
        set_os_thread_name(name)
        target(*args)

    python_name = f"ftlayer-{name}-{detail}" if detail else f"ftlayer-{name}"
    return threading.Thread(target=run, name=python_name, daemon=True)
