"""How a loaded model runs: weights' dtype, runtime, static KV slots, CUDA graphs, batch invariance.

The command-line flags (``specdec serve | up | generate``) become environment variables, so the
services ``specdec up`` starts inherit them, and the loader (``specdec.models``) reads them:

- ``--static-kv auto|on|off`` (``$SPECDEC_STATIC_KV``): sessions take slots of one preallocated KV
  pool and passes that fit a bucket run static-shape (``specdec.lean.static``). ``auto``: where
  CUDA graphs are on. ``on`` on a CPU runs the same static passes eagerly (what the tests check).
- ``--cuda-graphs auto|on|off`` (``$SPECDEC_CUDA_GRAPHS``): replay each bucket's pass as a captured
  CUDA graph. ``auto``: on for a lean-runtime model on a CUDA device.
- ``--kv-slots N`` / ``--kv-slot-tokens N``: the pool's sessions and positions per session;
  sessions past them run eagerly on caches of their own.
- ``--batch-invariant`` (``$SPECDEC_BATCH_INVARIANT=1``): each session's rows run in a pass of
  their own, so its tokens never depend on which sessions shared its passes (in half precision a
  product's rounding depends on its row count); greedy output is then reproducible run to run.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

DTYPE_ENV = "SPECDEC_DTYPE"  # float32 | bfloat16 | float16 | auto
RUNTIME_ENV = "SPECDEC_RUNTIME"  # auto | torch | gguf | lean | hf
STATIC_KV_ENV = "SPECDEC_STATIC_KV"  # auto | on | off
CUDA_GRAPHS_ENV = "SPECDEC_CUDA_GRAPHS"  # auto | on | off
KV_SLOTS_ENV = "SPECDEC_KV_SLOTS"
KV_SLOT_TOKENS_ENV = "SPECDEC_KV_SLOT_TOKENS"
BATCH_INVARIANT_ENV = "SPECDEC_BATCH_INVARIANT"  # 1: on
SWITCHES = ("auto", "on", "off")
DEFAULT_KV_SLOTS = 16
DEFAULT_KV_SLOT_TOKENS = 2048


@dataclass(frozen=True)
class PassOptions:
    static_kv: str = "auto"
    cuda_graphs: str = "auto"
    kv_slots: int = DEFAULT_KV_SLOTS
    kv_slot_tokens: int = DEFAULT_KV_SLOT_TOKENS
    batch_invariant: bool = False

    @classmethod
    def from_env(cls) -> PassOptions:
        from specdec.lm import ModelLoadError  # here, not at the top: the CLI imports this module before torch

        def switch(name: str) -> str:
            value = os.environ.get(name, "auto") or "auto"
            if value not in SWITCHES:
                raise ModelLoadError(f"${name}={value!r}: choose from {', '.join(SWITCHES)}")
            return value

        def count(name: str, default: int) -> int:
            try:
                value = int(os.environ.get(name) or default)
            except ValueError:
                raise ModelLoadError(f"${name} must be a whole number") from None
            if value < 1:
                raise ModelLoadError(f"${name} must be at least 1")
            return value

        return cls(static_kv=switch(STATIC_KV_ENV), cuda_graphs=switch(CUDA_GRAPHS_ENV),
                   kv_slots=count(KV_SLOTS_ENV, DEFAULT_KV_SLOTS),
                   kv_slot_tokens=count(KV_SLOT_TOKENS_ENV, DEFAULT_KV_SLOT_TOKENS),
                   batch_invariant=os.environ.get(BATCH_INVARIANT_ENV, "") in ("1", "true", "on"))

    def resolve(self, device_type: str) -> tuple[bool, bool]:
        """(static KV, CUDA graphs) for a lean-runtime model on ``device_type``; a ``ModelLoadError``
        where an explicit ``on`` cannot be honoured."""
        from specdec.lm import ModelLoadError

        if self.cuda_graphs == "on" and device_type != "cuda":
            raise ModelLoadError("--cuda-graphs on needs the model on a CUDA device")
        if self.cuda_graphs == "on" and self.static_kv == "off":
            raise ModelLoadError("--cuda-graphs on needs the static KV pool (not --static-kv off)")
        graphs = device_type == "cuda" and self.cuda_graphs != "off" and self.static_kv != "off"
        return self.static_kv == "on" or graphs, graphs


def configure(lean, name: str) -> None:
    """Apply ``$SPECDEC_*`` pass options to a ``LeanModel`` just built."""
    options = PassOptions.from_env()
    static, graphs = options.resolve(lean.device.type)
    lean.batch_invariant = options.batch_invariant
    if static:
        lean.use_static_kv(options.kv_slots, options.kv_slot_tokens, graphs)
        log.info("%s: static KV pool (%d slots x %d positions)%s", name, options.kv_slots,
                 lean.static.pool.slot_tokens, ", CUDA graphs" if graphs else "")


def note_without_lean(name: str) -> None:
    """A model transformers' forward runs has none of these options: say so where one was asked for."""
    options = PassOptions.from_env()
    if "on" in (options.static_kv, options.cuda_graphs) or options.batch_invariant:
        log.warning("%s: transformers' forward runs it: --static-kv, --cuda-graphs and --batch-invariant "
                    "apply to the lean runtime only", name)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                   help="model weights' dtype (default $SPECDEC_DTYPE, else auto: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--runtime", choices=["auto", "torch", "gguf", "lean", "hf"], default=None,
                   help="model forward: gguf (a GGUF file on llama.cpp's CPU kernels), lean (specdec's own, "
                        "Llama-family; fp32, or half precision on GPUs), hf (transformers'), torch (lean where "
                        "supported, else hf) or auto (gguf for a .gguf file and the embedded default on a CPU, "
                        "else as torch); default $SPECDEC_RUNTIME, else auto")
    p.add_argument("--static-kv", choices=SWITCHES, default=None,
                   help="preallocated KV slots and static-shape passes (default $SPECDEC_STATIC_KV, else auto: "
                        "where CUDA graphs are on)")
    p.add_argument("--cuda-graphs", choices=SWITCHES, default=None,
                   help="replay passes as captured CUDA graphs (default $SPECDEC_CUDA_GRAPHS, else auto: on "
                        "for a lean-runtime model on a GPU)")
    p.add_argument("--kv-slots", type=int, default=None,
                   help=f"sessions the static KV pool holds (default {DEFAULT_KV_SLOTS}; more run eagerly)")
    p.add_argument("--kv-slot-tokens", type=int, default=None,
                   help=f"positions per KV slot (default {DEFAULT_KV_SLOT_TOKENS}; a longer session moves out)")
    p.add_argument("--batch-invariant", action="store_true", default=None,
                   help="each session's rows in a pass of their own: its tokens never depend on its pass-mates")


def apply_model_flags(args) -> None:
    """The flags ``add_model_flags`` defined become environment variables (child processes inherit them)."""
    for flag, env in (("dtype", DTYPE_ENV), ("runtime", RUNTIME_ENV), ("static_kv", STATIC_KV_ENV),
                      ("cuda_graphs", CUDA_GRAPHS_ENV), ("kv_slots", KV_SLOTS_ENV),
                      ("kv_slot_tokens", KV_SLOT_TOKENS_ENV)):
        value = getattr(args, flag, None)
        if value is not None:
            os.environ[env] = str(value)
    if getattr(args, "batch_invariant", None):
        os.environ[BATCH_INVARIANT_ENV] = "1"
