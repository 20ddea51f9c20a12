"""A pass ends with tokens (issue #26): the verifier and the model drafter leave a pass's logits where
the model ran and read back only what a decision needs.

Every pass's logits are marked where the model hands them out (``logits_to``, the one place that
would copy them to the host) as a tensor that counts each read to the host (``.cpu()``, ``.tolist()``,
``.numpy()``, ``float()``, ...) of it or of anything computed from it. On a GPU those reads are the
device-to-host transfers; here they are counted the same way. Greedy verification of k drafts reads
the k + 1 argmax tokens; sampled verification the k values p_i(x_i) and one row; a draft step one
token, or its K-entry support. Reading the whole [k + 1, V] block, as a host-side decision must, is
what the counter is shown to catch. The tokens themselves are the exactness suites' business (they
run on this same path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec.lm
import specdec.ragged
from specdec.drafters import ModelDrafter
from specdec.ragged import ForwardRow, batched_forward
from specdec.sampling import sample_sparse, truncate_top_k
from specdec.wire_types import DraftProposal, SamplingParams
from specdec.verification import TargetSession
from specdec.kv import KVSession
from tests.tiny_models import TEST_DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")

HOST_READS = {"cpu", "tolist", "numpy", "item", "__float__", "__int__", "__bool__", "__index__", "__array__"}
PROMPT = [5, 17, 42, 8, 99, 23, 4]
K = 4


class Resident(torch.Tensor):
    """A tensor that stands for one left on an accelerator: each read to the host is logged (name,
    elements), and everything computed from it is Resident too."""

    reads: list[tuple[str, int]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a).startswith("cpu") for a in [*args[1:], *(kwargs or {}).values()])
        if not (name in HOST_READS or to_host):
            return super().__torch_function__(func, types, args, kwargs or {})
        cls.reads.append((name, args[0].numel()))
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out  # now on the host


@pytest.fixture
def reads(monkeypatch):
    """The host reads of every pass's logits (and of what is computed from them) from here on."""
    original = specdec.lm.logits_to

    def marked(logits, on_device):
        # What the model hands out is still where it ran (the passes copy nothing: see below).
        assert logits.device.type == TEST_DEVICE.split(":")[0]
        return original(logits.as_subclass(Resident), on_device)

    monkeypatch.setattr(specdec.lm, "logits_to", marked)
    monkeypatch.setattr(specdec.ragged, "logits_to", marked)
    Resident.reads = []
    yield Resident.reads
    Resident.reads = []


def read_elements(log: list[tuple[str, int]]) -> int:
    return sum(n for _, n in log)


def test_the_counter_sees_a_host_side_decision(tiny_target, reads):
    """Control: logits handed to the host (as every pass did before) are a read of the whole block."""
    kv = KVSession(tiny_target)
    batched_forward(tiny_target, [ForwardRow(kv, PROMPT + [1, 2, 3, 4], K + 1)], on_device=False)
    assert read_elements(reads) >= (K + 1) * tiny_target.logits_width


def test_greedy_verification_reads_back_only_the_tokens(tiny_target, reads):
    session = TargetSession(tiny_target, PROMPT, SamplingParams(temperature=0.0))
    session.prefill()
    assert read_elements(reads) == 1  # the first token
    reads.clear()
    verdict = session.verify(DraftProposal([7, 7, 7, 7]))
    assert reads == [("tolist", K + 1)]
    assert 1 <= len(verdict.tokens) <= K + 1


def sampled_proposal(width: int, seed: int) -> DraftProposal:
    """K drafts, each drawn from the exact q it reports (a top-64 support of a random distribution)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, probs = [], []
    for _ in range(K):
        q = truncate_top_k(torch.softmax(torch.randn(width, generator=gen) * 3, -1), 64)
        probs.append(q)
        tokens.append(sample_sparse(q, float(torch.rand(1, generator=gen))))
    return DraftProposal(tokens, probs)


@pytest.mark.parametrize("seed", range(3))
def test_sampled_verification_reads_the_draft_probabilities_and_one_row(tiny_target, reads, seed):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed)
    session = TargetSession(tiny_target, PROMPT, params)
    session.prefill()
    reads.clear()
    proposal = sampled_proposal(tiny_target.vocab_size, seed)
    verdict = session.verify(proposal)
    width = tiny_target.logits_width
    # p_i(x_i) of all k drafts in one read, then one row for the recovered or bonus token, plus the
    # residual's total (a scalar) when a draft was rejected.
    assert ("tolist", K) in reads
    assert sum(1 for _, n in reads if n >= width) == 1
    assert read_elements(reads) <= K + width + 4
    assert len(verdict.tokens) == verdict.num_accepted + 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_step_reads_one_token_or_its_support(tiny_draft, reads, temperature):
    params = SamplingParams(temperature=temperature, seed=3, draft_top_k=16)
    session = ModelDrafter(tiny_draft).start(PROMPT, params)
    session.prefill()
    assert reads == []  # the prompt's logits go unread
    proposal = session.propose(3)
    assert len(proposal) == 3
    if temperature == 0.0:
        assert reads == [("__int__", 1)] * 3
    else:  # per step: the top-K values and ids of the processed distribution
        assert read_elements(reads) == 3 * 2 * params.draft_top_k
        assert all(len(q.token_ids) <= params.draft_top_k and isinstance(q.token_ids, np.ndarray) for q in proposal.draft_probs)


@pytest.mark.parametrize("static", [False, True])
def test_the_lean_passes_copy_no_logits_to_the_host(tiny_target, monkeypatch, static):
    """Upstream of ``logits_to``: the lean runtime's passes (one session, several, the static-shape
    ones) hand out their logits without a host copy of them (``.cpu()`` or ``.to("cpu")`` of a
    logits-sized tensor), which on a GPU would be the full [rows, V] transfer this issue removes."""
    from specdec.lean import LeanModel

    lean = LeanModel.from_hf(tiny_target.model, backend="torch")  # whatever runtime the suite runs on
    if static:
        lean.use_static_kv(4, 64, graphs=False)
    width = lean.logits_width
    copies = []
    for name in ("cpu", "to"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            to_host = _name == "cpu" or any(str(a).startswith("cpu") for a in [*args, *kwargs.values()])
            if to_host and self.numel() >= width:
                copies.append((_name, tuple(self.shape)))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    one, other = lean.new_kv(), lean.new_kv()
    lean.forward([one], [PROMPT], [1])
    lean.forward([other], [PROMPT[:4]], [1])
    logits = lean.forward([one, other], [[3, 4, 5], [6, 7]], [3, 2])
    assert logits.shape == (5, width) and logits.device == lean.device
    assert copies == []
