"""The lean runtime: a plain-torch forward for Llama-family causal LMs (Llama, SmolLM2, Mistral,
Qwen2), on the same Hugging Face weights as transformers' model, which stays the fallback.

- ``weights``: the tensors, q/k/v and gate/up fused (transformers' parameters become views of them)
- ``matmul``: product backends (torch/MKL, oneDNN-packed, numpy/OpenBLAS zero-copy), the table
  measured at load that picks one per row count, and the thread regime each needs
- ``kv``: ``LeanKV``, a session's keys/values in one preallocated buffer, O(1) rollback
- ``layer``: the one decoder layer body every pass runs, one RoPE, and the table of which pass runs when
- ``attention``: the attention kernels and one attention function per cache layout
- ``forward``: ``LeanModel.forward`` over one or several sessions' new tokens in one pass
- ``numpy_pass``: a single session's pass on CPU with its activations in numpy (per-op cost), the
  products still through the table's backend; several sessions, or a GPU, take the torch forward
- ``static``: the slot pool and bucketed static-shape passes (CUDA graphs on a GPU)
"""

from specdec.lean.forward import LeanModel
from specdec.lean.kv import LeanKV
from specdec.lean.weights import LeanWeights, unsupported_reason

__all__ = ["LeanKV", "LeanModel", "LeanWeights", "unsupported_reason"]
