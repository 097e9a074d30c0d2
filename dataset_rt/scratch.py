"""Scratch directories: a loader's own files, in RAM where the host has a tmpfs.

A directory is removed by a finalizer when its owner is collected or the process exits. A
process killed outright (SIGKILL, the OOM killer, a preempted node) runs no finalizer, and a
directory in ``/dev/shm`` would hold its plan in RAM until the host reboots. So each name
carries its creator's PID namespace and PID, and making a new directory first removes those
whose creator is gone. Directories of another PID namespace (a container sharing the host's
``/dev/shm``) are never touched: their PIDs mean nothing here.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

_SHM = "/dev/shm"
# <prefix><namespace>-<pid>-<mkdtemp's random part>
_OWNED = re.compile(r"^dataset_rt-[a-z]+-(?P<ns>[0-9a-z]+)-(?P<pid>[0-9]+)-[^/]+$")


def scratch_dir(prefix: str) -> str:
    """A new directory for a loader's own files, named ``<prefix><ns>-<pid>-<random>``.

    In /dev/shm where there is one, so that the files stay in RAM and worker processes share
    their pages; else in the system's temporary directory. Leftovers of dead processes in the
    same place are removed first.
    """
    base = _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else tempfile.gettempdir()
    namespace = pid_namespace()
    sweep(base, namespace)
    return tempfile.mkdtemp(prefix=f"{prefix}{namespace}-{os.getpid()}-", dir=base)


def pid_namespace() -> str:
    """The PID namespace of the running process (its inode), or ``"h"`` where /proc has none."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "h"


def sweep(base: str, namespace: str) -> None:
    """Remove the scratch directories in ``base`` whose creator (same namespace) is gone.

    A directory that cannot be removed (another user's) is left.
    """
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        found = _OWNED.match(entry.name)
        if found is None or found["ns"] != namespace or process_alive(int(found["pid"])):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether a process with this PID exists here (a zombie or another user's counts).

    A PID too large to be one is not.
    """
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True
