"""specdec: exact speculative decoding with the drafter and the verifier as separate services.

The core library (this package) holds everything that is not wire protocol: acceptance math,
model loading, KV-cached sessions, draft methods, stopping, the speculative loop and the CLI.
The generated protobuf modules live in ``specdec.v1``; only the services import them.
"""

__version__ = "0.1.0"
