"""The gateway's CPU time per streamed token, for one or more checkouts of specdec, side by side.

Each checkout (``--checkout LABEL=PATH``; default: this one) runs its own ``specdec up`` on the
embedded pair, in turn; N concurrent streams (default 16) each generate ``--tokens`` tokens
(ignore_eos, with a stop string that never completes, which makes every committed token go through
the stop check as OpenAI-style clients do), plain decoding and speculation (k = 4). The gateway
process's user + system CPU time (/proc/PID/stat) over the streams, divided by the tokens streamed,
is what the gateway itself costs per token; it does not depend on how fast the verifier is.

    .venv/bin/python scripts/gateway_cpu.py --checkout before=/tmp/before --checkout after=. --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.client import AsyncGatewayClient  # noqa: E402
from specdec.stack import free_port_block, service_pids, wait_serving  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List ten facts about the moon.", "def quicksort(xs):"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def streams(address: str, count: int, tokens: int, method: str) -> int:
    async with AsyncGatewayClient(address, timeout=900) as client:
        results = await asyncio.gather(*(
            client.generate(prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=tokens, ignore_eos=True,
                            stop=["<never-appears>"], method=method, num_draft_tokens=4 if method != "none" else 0)
            for i in range(count)))
    return sum(len(r.token_ids) for r in results)


def measure(path: Path, count: int, tokens: int, methods: list[str]) -> dict[str, float]:
    port = free_port_block()
    env = dict(os.environ, PYTHONPATH=str(path))
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--port", str(port)], cwd=path, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for offset in range(3):
            wait_serving(f"127.0.0.1:{port + offset}", proc)
        pid = service_pids(proc.pid).get("gateway")
        if pid is None:
            raise RuntimeError("no gateway process under specdec up")
        out = {}
        for method in methods:
            asyncio.run(streams(f"127.0.0.1:{port}", 2, 8, method))  # warm-up
            before, began = cpu_seconds(pid), time.perf_counter()
            streamed = asyncio.run(streams(f"127.0.0.1:{port}", count, tokens, method))
            out[method] = (cpu_seconds(pid) - before) / streamed * 1e3
            out[method + " wall tok/s"] = streamed / (time.perf_counter() - began)
        return out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", default=[], help="LABEL=PATH (repeatable)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the checkouts this many times")
    parser.add_argument("--methods", default="none,model")
    args = parser.parse_args()
    checkouts = [c.split("=", 1) for c in args.checkout] or [["this", str(ROOT)]]
    methods = args.methods.split(",")
    for round_ in range(args.rounds):
        for label, path in checkouts:
            result = measure(Path(path).resolve(), args.streams, args.tokens, methods)
            cells = ", ".join(f"{m}: {result[m]:.3f} ms CPU/token ({result[m + ' wall tok/s']:.1f} tok/s)" for m in methods)
            print(f"round {round_ + 1} {label}: {cells}", flush=True)


if __name__ == "__main__":
    main()
