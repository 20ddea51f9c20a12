"""The ceiling of suffix drafting on a host: requests resent verbatim (an agent retrying a call, a
client regenerating), greedy, so the second answer is the first one again. Plain decoding and
suffix drafting take turns per problem against a running gateway; each pair has a fresh cache scope.

    python scripts/suffix_resend.py --gateway localhost:50051 --problems 6 --max-new-tokens 192
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
import uuid
from importlib.resources import files

from specdec.client import GatewayClient


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="localhost:50051")
    parser.add_argument("--problems", type=int, default=6, help="HumanEval problems, each sent twice per method")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    args = parser.parse_args()
    path = files("specdec") / "data" / "humaneval" / "HumanEval.jsonl.gz"
    with gzip.open(str(path), "rt", encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][: args.problems]
    totals = {(m, which): [0, 0.0] for m in ("none", "suffix") for which in ("first", "resent")}
    with GatewayClient(args.gateway, timeout=600) as client:
        for i, prompt in enumerate(prompts):
            for method in (("none", "suffix") if i % 2 == 0 else ("suffix", "none")):
                scope = uuid.uuid4().hex
                for which in ("first", "resent"):
                    start = time.perf_counter()
                    result = client.generate(prompt=prompt, max_new_tokens=args.max_new_tokens, method=method,
                                             cache_scope=scope)
                    total = totals[(method, which)]
                    total[0] += len(result.token_ids)
                    total[1] += time.perf_counter() - start
    for which in ("first", "resent"):
        rates = {m: totals[(m, which)][0] / totals[(m, which)][1] for m in ("none", "suffix")}
        print(f"{which:7s} plain {rates['none']:7.2f} tok/s  suffix {rates['suffix']:7.2f} tok/s  "
              f"suffix / plain {rates['suffix'] / rates['none']:.3f}")


if __name__ == "__main__":
    main()
