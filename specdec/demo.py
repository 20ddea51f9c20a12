"""`make demo`: start drafter, verifier and gateway on the embedded default, stream one generation
through the gateway, print the stats, stop everything."""

from __future__ import annotations

import json
import sys

from specdec.stack import LocalStack

PROMPT = "Write a short Python function that checks whether a number is prime, then explain it."


def main() -> int:
    from specdec.models import embedded_model_dir

    print("== preparing the embedded target (SmolLM2-135M-Instruct; converted once, then cached)", flush=True)
    embedded_model_dir()
    print("== starting drafter, verifier and gateway (`specdec up` on free ports)", flush=True)
    with LocalStack() as address:
        print(f"== streaming a chat generation through the gateway at {address}\n", flush=True)
        from specdec.client import ChunkEvent, GatewayClient

        with GatewayClient(address, timeout=600) as client:
            for event in client.stream(messages=[("user", PROMPT)], max_new_tokens=160):
                if isinstance(event, ChunkEvent):
                    print(event.text, end="", flush=True)
                else:
                    print(f"\n\n== finish_reason={event.finish_reason} prompt_tokens={event.prompt_tokens} "
                          f"completion_tokens={event.completion_tokens}")
                    print(json.dumps(event.stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
