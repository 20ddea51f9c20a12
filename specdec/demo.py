"""`make demo`: start drafter, verifier and gateway on the embedded default, stream one generation
through the gateway, print the stats, make one call to its OpenAI-compatible HTTP API, stop everything."""

from __future__ import annotations

import json
import sys
import urllib.request

from specdec.stack import LocalStack

PROMPT = "Write a short Python function that checks whether a number is prime, then explain it."
HTTP_PROMPT = "In one sentence: what does a speculative decoder's draft model do?"


def http_chat(base_url: str, content: str, max_tokens: int) -> dict:
    """One POST /v1/chat/completions (what ``curl`` or the ``openai`` client would send)."""
    body = json.dumps({"model": "embedded", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def main() -> int:
    from specdec.gguf.binding import available
    from specdec.models import embedded_model_dir

    if available():  # the verifier runs the shipped Q4_1 file as it is: nothing to convert
        print("== the embedded target (SmolLM2-135M-Instruct, Q4_1 GGUF) on llama.cpp's kernels", flush=True)
    else:
        print("== preparing the embedded target (SmolLM2-135M-Instruct; converted once, then cached)", flush=True)
        embedded_model_dir()
    print("== starting drafter, verifier and gateway (`specdec up` on free ports)", flush=True)
    stack = LocalStack()
    with stack as address:
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
        print(f"\n== the same gateway over its OpenAI-compatible HTTP API: POST {stack.http_url}/chat/completions",
              flush=True)
        answer = http_chat(stack.http_url, HTTP_PROMPT, max_tokens=48)
        print(answer["choices"][0]["message"]["content"])
        print(f"== finish_reason={answer['choices'][0]['finish_reason']} usage={answer['usage']} "
              f"acceptance_rate={answer['speculation_stats']['acceptance_rate']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
