"""Decode speed of two running gateways, paired request by request.

The same request goes to gateway A and gateway B one after the other (the order alternating), and
each pair gives one ratio of decode rates (tokens after the first, over the time after it). On a
machine whose speed drifts by tens of per cent from minute to minute, paired ratios resolve a
difference of a few per cent where two separate bench runs cannot.

    specdec up &                                     # A: the default
    specdec up --no-plain-runs --port 50061 --drafter-port 50062 --verifier-port 50063 \\
        --http-port 8010 --metrics-port 9200 &       # B: what A is set against
    python scripts/paired_gateways.py localhost:50051 localhost:50061 --pairs 24
"""

from __future__ import annotations

import argparse
import statistics

from tqdm import tqdm

from specdec.client import GatewayClient

PROMPTS = [
    "def fibonacci(n):",
    "Write a short story about a robot who learns to paint.",
    "import numpy as np\n\ndef softmax(x):",
    "Explain how a hash table works.",
    "The history of the Roman empire",
    "def parse_csv(path):",
    "List five tips for learning Python.",
    "class Stack:\n    def __init__(self):",
]


def decode_rate(client: GatewayClient, prompt: str, args) -> float:
    result = client.generate(prompt=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True, method=args.method)
    stats = result.stats
    return (len(result.token_ids) - 1) / (stats["total_s"] - stats["ttft_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gateway_a")
    parser.add_argument("gateway_b")
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--method", default="none", help="speculation.method of every request (default: none)")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"A": [], "B": []}
    with GatewayClient(args.gateway_a, timeout=300) as a, GatewayClient(args.gateway_b, timeout=300) as b:
        for i in tqdm(range(args.pairs), desc="pairs"):
            prompt = PROMPTS[i % len(PROMPTS)]
            order = [("A", a), ("B", b)] if i % 2 == 0 else [("B", b), ("A", a)]
            for name, client in order:
                rates[name].append(decode_rate(client, prompt, args))
    ratios = [x / y for x, y in zip(rates["A"], rates["B"])]
    print(f"decode tok/s: A {statistics.mean(rates['A']):.2f}, B {statistics.mean(rates['B']):.2f}; "
          f"A/B paired: mean {statistics.mean(ratios):.3f}, median {statistics.median(ratios):.3f}, "
          f"stdev {statistics.stdev(ratios):.3f} ({args.pairs} pairs, method {args.method})")


if __name__ == "__main__":
    main()
