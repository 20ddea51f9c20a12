"""Soak `specdec up` under faults: N concurrent greedy streams for M minutes, kill -9 of the drafter
every K seconds and of the verifier once, then check every completed output against plain decoding.

    .venv/bin/python scripts/soak.py --minutes 20 --streams 4 --out soak-out

What it reports (summary.json, report.md in --out, and on stdout): requests completed and failed
(by status code, and which ones were in flight on the killed verifier), tokens, each kill with the
time until that service answered SERVING again and whether the next requests drafted with the model
again, and how many completed outputs equal plain decoding's (the same prompt through the same stack
with speculation method "none", run after the soak).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from specdec.bench.prompts import load_prompts
from specdec.client import GatewayClient
from specdec.stack import LocalStack, wait_serving

@dataclass
class Record:
    worker: int
    prompt: int
    start_s: float
    end_s: float
    code: str  # "OK" or the gRPC status name
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    draft_method: str = ""
    draft_tokens: int = 0
    detail: str = ""


@dataclass
class Kill:
    role: str
    at_s: float
    pid: int
    serving_again_s: float | None = None  # seconds from the kill until SERVING again


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--kill-drafter-every", type=float, default=120.0, help="seconds")
    parser.add_argument("--kill-verifier-at", type=float, default=None,
                        help="seconds into the run (default: just past the middle, between two drafter kills)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="mt_bench")
    parser.add_argument("--limit", type=int, default=24, help="distinct prompts, cycled")
    parser.add_argument("--timeout", type=float, default=180.0, help="per-request deadline (s)")
    parser.add_argument("--out", default="soak-out")
    parser.add_argument("up_args", nargs="*", help="extra `specdec up` flags (after --)")
    args = parser.parse_args()
    duration = args.minutes * 60
    verifier_at = args.kill_verifier_at if args.kill_verifier_at is not None else \
        (int(duration / 2 / args.kill_drafter_every) + 0.5) * args.kill_drafter_every
    prompts = [conv.turns[0] for conv in load_prompts(args.prompts, args.limit)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    kills: list[Kill] = []
    lock = threading.Lock()
    log_file = open(out / "up.log", "w")
    stack = LocalStack(list(args.up_args), output=log_file)
    with stack as address:
        port = int(address.rpartition(":")[2])
        role_address = {"gateway": address, "drafter": f"127.0.0.1:{port + 1}", "verifier": f"127.0.0.1:{port + 2}"}
        t0 = time.monotonic()
        stop = threading.Event()
        counter = iter(range(10**9))

        def worker(index: int) -> None:
            with GatewayClient(address, timeout=args.timeout) as client:
                while not stop.is_set():
                    with lock:
                        n = next(counter)
                    prompt = n % len(prompts)
                    start = time.monotonic() - t0
                    try:
                        result = client.generate(messages=[("user", prompts[prompt])],
                                                 max_new_tokens=args.max_new_tokens)
                        record = Record(index, prompt, start, time.monotonic() - t0, "OK", len(result.token_ids),
                                        result.token_ids, result.stats.get("draft_method", ""),
                                        int(result.stats.get("draft_tokens", 0)))
                    except grpc.RpcError as exc:
                        record = Record(index, prompt, start, time.monotonic() - t0, exc.code().name,
                                        detail=exc.details() or "")
                        time.sleep(0.5)  # a stack without a verifier answers at once: do not spin
                    with lock:
                        records.append(record)

        def killer() -> None:
            plan = [(t, "drafter") for t in range(int(args.kill_drafter_every), int(duration), int(args.kill_drafter_every))]
            plan.append((verifier_at, "verifier"))
            for at, role in sorted(plan):
                if stop.wait(max(0.0, at - (time.monotonic() - t0))):
                    return
                pid = stack.service_pids().get(role)
                if pid is None:
                    continue
                os.kill(pid, signal.SIGKILL)
                kill = Kill(role, time.monotonic() - t0, pid)
                kills.append(kill)
                time.sleep(1.0)  # past the old process: its port must close first
                try:
                    wait_serving(role_address[role], timeout=120, stop=stop)
                    kill.serving_again_s = time.monotonic() - t0 - kill.at_s
                except RuntimeError:
                    pass
                print(f"[soak] {kill.at_s:7.1f}s kill -9 {role} (pid {pid}); serving again after "
                      f"{kill.serving_again_s}", flush=True)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.streams)]
        threads.append(threading.Thread(target=killer, daemon=True))
        for thread in threads:
            thread.start()
        try:
            from tqdm.auto import tqdm

            with tqdm(total=int(duration), unit="s", desc="soak") as bar:
                while time.monotonic() - t0 < duration:
                    time.sleep(5)
                    bar.update(min(5, int(duration) - bar.n))
                    bar.set_postfix(done=sum(r.code == "OK" for r in records), failed=sum(r.code != "OK" for r in records))
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=args.timeout + 10)
        # Plain decoding of every prompt that completed, through the same stack.
        used = sorted({r.prompt for r in records if r.code == "OK"})
        references: dict[int, list[int]] = {}
        with GatewayClient(address, timeout=args.timeout) as client:
            for prompt in used:
                references[prompt] = client.generate(messages=[("user", prompts[prompt])],
                                                      max_new_tokens=args.max_new_tokens, method="none").token_ids
    log_file.close()
    summary = summarize(records, kills, references, duration, args)
    (out / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if summary["mismatched_outputs"] == 0 and summary["failed_outside_verifier_kill"] == 0 else 1


def _by_minute(records: list[Record]) -> dict[int, list[Record]]:
    minutes: dict[int, list[Record]] = {}
    for r in records:
        minutes.setdefault(int(r.start_s // 60), []).append(r)
    return dict(sorted(minutes.items()))


def summarize(records: list[Record], kills: list[Kill], references: dict[int, list[int]], duration: float,
              args) -> dict:
    ok = [r for r in records if r.code == "OK"]
    failed = [r for r in records if r.code != "OK"]
    verifier_kills = [k for k in kills if k.role == "verifier"]

    def around_verifier_kill(r: Record) -> bool:
        # In flight at the kill, or sent while the verifier was down (until SERVING again).
        return any(r.start_s <= k.at_s + (k.serving_again_s or 120) and r.end_s >= k.at_s for k in verifier_kills)

    mismatched = [r for r in ok if r.token_ids != references.get(r.prompt)]
    drafter_kills = []
    for k in kills:
        if k.role != "drafter" or k.serving_again_s is None:
            continue
        back = k.at_s + k.serving_again_s
        after = [r for r in ok if r.start_s >= back + 2][: args.streams * 2]
        drafter_kills.append({"at_s": round(k.at_s, 1), "serving_again_s": round(k.serving_again_s, 1),
                              # The gateway chose the model drafter again (the adaptive policy may
                              # still verify no drafts where plain decoding pays better).
                              "next_requests_with_model_drafter": sum(r.draft_method == "model" for r in after),
                              "next_requests_drafted": sum(r.draft_tokens > 0 for r in after),
                              "next_requests": len(after),
                              "in_flight_completed": sum(r.start_s <= k.at_s <= r.end_s for r in ok),
                              "in_flight_failed": sum(r.start_s <= k.at_s <= r.end_s for r in failed)})
    return {
        "minutes": duration / 60, "streams": args.streams, "max_new_tokens": args.max_new_tokens,
        "requests_completed": len(ok),
        "requests_failed": len(failed),
        "failed_by_code": dict(Counter(r.code for r in failed)),
        "failed_around_verifier_kill": sum(around_verifier_kill(r) for r in failed),
        "failed_outside_verifier_kill": sum(not around_verifier_kill(r) for r in failed),
        "failure_details": sorted({f"{r.code}: {r.detail}" for r in failed})[:10],
        "tokens": sum(r.tokens for r in ok),
        "completed_with_drafts": sum(r.draft_tokens > 0 for r in ok),
        "completed_by_draft_method": dict(Counter(r.draft_method for r in ok)),
        "latency_s_by_minute": {m: round(sum(r.end_s - r.start_s for r in rows) / len(rows), 1)
                                for m, rows in _by_minute(ok).items()},
        "outputs_checked": len(ok),
        "mismatched_outputs": len(mismatched),
        "drafter_kills": drafter_kills,
        "verifier_kills": [{"at_s": round(k.at_s, 1), "serving_again_s": k.serving_again_s and round(k.serving_again_s, 1)}
                           for k in verifier_kills],
    }


if __name__ == "__main__":
    sys.exit(main())
