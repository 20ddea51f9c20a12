"""specdec up's process manager on real child processes: restart with backoff, the others untouched,
drain in order."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from specdec.supervisor import ChildSpec, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _supervise(specs, **kwargs) -> tuple[Supervisor, threading.Thread, list[str]]:
    lines: list[str] = []
    supervisor = Supervisor(specs, log=lines.append, grace_s=5, **kwargs)
    supervisor.start_all()
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    return supervisor, thread, lines


def test_a_killed_child_is_restarted_and_the_others_keep_running():
    specs = [ChildSpec(name, SLEEPER, "", drain_order=0) for name in ("gateway", "drafter", "verifier")]
    supervisor, thread, lines = _supervise(specs)
    try:
        before = supervisor.pids()
        os.kill(before["drafter"], signal.SIGKILL)
        assert _wait(lambda: supervisor.restarts()["drafter"] == 1 and supervisor.pids()["drafter"], 5), lines
        after = supervisor.pids()
        assert after["drafter"] != before["drafter"]
        assert after["gateway"] == before["gateway"] and after["verifier"] == before["verifier"]
        assert supervisor.restarts() == {"gateway": 0, "drafter": 1, "verifier": 0}
        assert any("drafter exited (code -9)" in line for line in lines), lines
    finally:
        supervisor.stop.set()
        thread.join()
        codes = supervisor.shutdown()
    assert set(codes.values()) == {-signal.SIGTERM}


def test_a_child_that_keeps_dying_backs_off():
    crasher = ChildSpec("drafter", [sys.executable, "-c", "raise SystemExit(3)"], "", drain_order=0)
    supervisor, thread, lines = _supervise([crasher], max_backoff_s=2.0)

    def delays() -> list[float]:
        return [float(line.split(" in ")[1].split(" s")[0]) for line in list(lines) if "exited (code 3)" in line]

    try:
        assert _wait(lambda: len(delays()) >= 4, 30), lines
        assert delays()[:4] == [1.0, 2.0, 2.0, 2.0]  # doubling, capped at max_backoff_s
        assert supervisor.restarts()["drafter"] >= 3
    finally:
        supervisor.stop.set()
        thread.join()
        supervisor.shutdown()


def test_shutdown_drains_in_order(tmp_path):
    """The gateway (order 0) gets SIGTERM and exits before the model services (order 1) are told."""
    log = tmp_path / "order.log"
    script = (
        "import signal, sys, time\n"
        f"def bye(*_):\n    open({str(log)!r}, 'a').write(sys.argv[1] + ' ' + repr(time.monotonic()) + '\\n')\n"
        "    time.sleep(0.3)\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open({str(tmp_path)!r} + '/armed-' + sys.argv[1], 'w').close()\n"
        "time.sleep(120)\n"
    )
    names = ("verifier", "gateway", "drafter")
    specs = [ChildSpec(name, [sys.executable, "-c", script, name], "", drain_order=order)
             for name, order in zip(names, (1, 0, 1))]
    supervisor, thread, lines = _supervise(specs)
    # Until each child has its handler (60 s: a hang guard): a SIGTERM before it would kill, not drain.
    assert _wait(lambda: all((tmp_path / f"armed-{name}").exists() for name in names), 60), lines
    supervisor.stop.set()
    thread.join()
    codes = supervisor.shutdown()
    assert codes == {"verifier": 0, "gateway": 0, "drafter": 0}
    stamps = dict(line.split() for line in log.read_text().splitlines())
    assert float(stamps["gateway"]) + 0.3 <= min(float(stamps["verifier"]), float(stamps["drafter"]))
