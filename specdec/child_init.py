"""Start a supervised child: ``python -m specdec.child_init --parent PID [--cpus 0,1] -- COMMAND ...``.

Sets up this process, then execs COMMAND in it (same pid, so the supervisor's ``Popen`` is COMMAND's):

- the parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``): when the supervisor dies,
  even by SIGKILL, the child gets SIGTERM and drains instead of living on, re-parented, holding its
  port. It survives the exec. Set here rather than in a ``preexec_fn``, which is unsafe in a process
  with threads (the supervisor's pump and readiness threads);
- with ``--cpus``, the CPU affinity, which every thread COMMAND starts inherits.

The kernel sends the signal when the *thread* that started the child ends, so a supervisor starts
its children from a thread that lives as long as it does.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHANED_EXIT = 70  # the supervisor died before the parent-death signal was armed


def child_command(command: list[str], parent: int, cpus: frozenset[int] | None = None) -> list[str]:
    """``command`` run through this module: dies with ``parent``, on ``cpus`` when given."""
    pinning = ["--cpus", ",".join(str(cpu) for cpu in sorted(cpus))] if cpus else []
    return [sys.executable, "-m", "specdec.child_init", "--parent", str(parent), *pinning, "--", *command]


def die_with_parent(parent: int) -> None:
    """SIGTERM this process when ``parent`` ends (Linux; elsewhere nothing). Exits at once if it has
    already ended: the signal is only sent for a death after it is armed."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent:  # re-parented between the fork and the prctl
        raise SystemExit(ORPHANED_EXIT)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise SystemExit("usage: python -m specdec.child_init --parent PID [--cpus 0,1,...] -- COMMAND ...")
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    settings = dict(zip(options[::2], options[1::2]))
    if len(options) % 2 or set(settings) - {"--parent", "--cpus"} or "--parent" not in settings:
        raise SystemExit(f"child_init: bad options {options!r}")
    if "--cpus" in settings:
        os.sched_setaffinity(0, {int(cpu) for cpu in settings["--cpus"].split(",")})
    die_with_parent(int(settings["--parent"]))
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        raise SystemExit(f"child_init: cannot run {command[0]!r}: {exc}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
