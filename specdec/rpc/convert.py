"""Protobuf <-> core type translation (the only place that builds ``specdec.v1`` messages from core types)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from specdec.completion import FINISH_LENGTH, FINISH_STOP
from specdec.engine import GenerationStats
from specdec.v1 import gateway_pb2, types_pb2
from specdec.wire_types import (
    DEFAULT_DRAFT_TOP_K,
    BatchInfo,
    DraftProposal,
    EncodedFeatures,
    SamplingParams,
    SparseDistribution,
    Verdict,
)

if TYPE_CHECKING:  # annotations only: the gateway, which uses this module, loads no model
    from specdec.lm import LoadedModel
    from specdec.target_features import TargetFeatures

FINISH_REASON_TO_PB = {
    FINISH_STOP: gateway_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
}
FINISH_REASON_FROM_PB = {v: k for k, v in FINISH_REASON_TO_PB.items()}


def sampling_from_pb(
    pb: types_pb2.SamplingParams, default_max_new_tokens: int = 128, draft_top_k: int = 0, validate: bool = True
) -> SamplingParams:
    """Build and validate core sampling params; ``FieldError`` names the bad field. ``validate=False``
    leaves the checks to the caller (the gateway checks its limits first)."""
    params = SamplingParams(
        max_new_tokens=pb.max_new_tokens or default_max_new_tokens,
        temperature=float(pb.temperature),
        top_p=float(pb.top_p) if pb.HasField("top_p") else 1.0,
        top_k=int(pb.top_k),
        seed=int(pb.seed) if pb.HasField("seed") else None,
        stop=tuple(pb.stop),
        stop_token_ids=tuple(int(t) for t in pb.stop_token_ids),
        ignore_eos=bool(pb.ignore_eos),
        draft_top_k=draft_top_k or DEFAULT_DRAFT_TOP_K,
    )
    if validate:
        params.validate()
    return params


def sampling_to_pb(params: SamplingParams) -> types_pb2.SamplingParams:
    pb = types_pb2.SamplingParams(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        stop_token_ids=list(params.stop_token_ids),
    )
    if params.top_p != 1.0:
        pb.top_p = params.top_p
    if params.seed is not None:
        pb.seed = params.seed
    return pb


def sparse_to_pb(dist: SparseDistribution) -> types_pb2.SparseDistribution:
    return types_pb2.SparseDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def sparse_from_pb(pb: types_pb2.SparseDistribution) -> SparseDistribution:
    """The distribution as sent: float32 on the wire is what the drafter sampled from. Whether it is
    a distribution at all is ``verification.check_draft_probs``'s to say (the verifier's)."""
    return SparseDistribution(np.array(pb.token_ids, dtype=np.int64), np.array(pb.probs, dtype=np.float32))


def proposal_fields(proposal: DraftProposal) -> dict:
    """Keyword fields shared by DraftProposal and VerifyBlock messages."""
    probs = [sparse_to_pb(d) for d in proposal.draft_probs] if proposal.draft_probs is not None else []
    return {"draft_token_ids": list(proposal.draft_tokens), "draft_probs": probs}


def proposal_from_pb(msg) -> DraftProposal:
    """From a message with ``draft_token_ids`` and ``draft_probs`` (DraftProposal or VerifyBlock),
    unchecked: the one hop that reads each q, the verifier, checks it (``verification.check_draft_probs``)."""
    tokens = [int(t) for t in msg.draft_token_ids]
    if not msg.draft_probs:
        return DraftProposal(tokens, None)
    return DraftProposal(tokens, [sparse_from_pb(d) for d in msg.draft_probs])


# At most what a TargetFeatures field adds to a ProposalRequest beside its data (tags, varints, length
# prefixes), the DraftRequest around the proposal included.
FEATURES_FIELD_OVERHEAD = 64


def features_to_pb(features: TargetFeatures | EncodedFeatures) -> types_pb2.TargetFeatures:
    encoded = features if isinstance(features, EncodedFeatures) else features.encode()
    return types_pb2.TargetFeatures(start_position=encoded.start, num_positions=encoded.count,
                                    hidden_size=encoded.width, bf16_data=encoded.data)


def attach_features(propose, features: EncodedFeatures | None, max_message_bytes: int) -> None:
    """Set ``propose.target_features`` (a ProposalRequest) to the newest of ``features`` that fit beside
    the rest of the proposal in a message of ``max_message_bytes`` (``gateway.feature_relay.FeatureRelay``
    says why the newest). A payload longer than its header says goes only if it fits: the drafter refuses it."""
    if features is None:
        return
    room = max_message_bytes - propose.ByteSize() - FEATURES_FIELD_OVERHEAD
    features = features.tail(room // max(features.row_bytes, 1))
    if len(features) and features.wire_bytes <= room:
        propose.target_features.CopyFrom(features_to_pb(features))


def encoded_features_from_pb(pb: types_pb2.TargetFeatures) -> EncodedFeatures | None:
    """The features in ``pb`` as sent, not decoded (None when it carries none): what a relay passes on."""
    if pb.num_positions == 0 and not pb.bf16_data:
        return None
    return EncodedFeatures(int(pb.start_position), int(pb.num_positions), int(pb.hidden_size), pb.bf16_data)


def verdict_fields(verdict: Verdict) -> dict:
    fields = {
        "num_drafts": verdict.num_drafts,
        "num_accepted": verdict.num_accepted,
        "token_ids": list(verdict.tokens),
        "committed_length": verdict.committed_length,
    }
    if verdict.batch is not None:
        fields.update(batch_size=verdict.batch.size, batch_tokens=verdict.batch.num_tokens,
                      queue_wait_us=int(verdict.batch.queue_wait_s * 1e6), pass_time_us=int(verdict.batch.pass_s * 1e6))
    if verdict.features is not None:
        fields["features"] = features_to_pb(verdict.features)
    return fields


def verdict_from_pb(pb) -> Verdict:
    batch = None
    if pb.batch_size:  # older verifiers leave it 0
        batch = BatchInfo(pb.batch_size, pb.batch_tokens, pb.queue_wait_us * 1e-6, pb.pass_time_us * 1e-6)
    return Verdict(
        num_drafts=pb.num_drafts,
        num_accepted=pb.num_accepted,
        tokens=[int(t) for t in pb.token_ids],
        committed_length=int(pb.committed_length),
        batch=batch,
        # Relayed as received (the gateway never reads them; the drafter validates them).
        features=encoded_features_from_pb(pb.features) if pb.HasField("features") else None,
    )


def stats_to_pb(stats: GenerationStats) -> gateway_pb2.GenerationStats:
    d = stats.to_dict()
    return gateway_pb2.GenerationStats(**{k: d[k] for k in gateway_pb2.GenerationStats.DESCRIPTOR.fields_by_name})


def stats_from_pb(pb: gateway_pb2.GenerationStats) -> dict:
    """The same dict the CLI's ``--json`` prints under ``stats`` (``GenerationStats.to_dict()``)."""
    out = {}
    for name, field in gateway_pb2.GenerationStats.DESCRIPTOR.fields_by_name.items():
        value = getattr(pb, name)
        if field.message_type is not None:  # repeated messages (round_costs): dicts, as to_dict has them
            out[name] = [{f.name: getattr(item, f.name) for f in field.message_type.fields} for item in value]
        else:
            out[name] = list(value) if field.is_repeated else value
    return out


def model_info_pb(lm: LoadedModel) -> types_pb2.ModelInfo:
    return types_pb2.ModelInfo(
        model=lm.name,
        tokenizer_fingerprint=lm.fingerprint,
        vocab_size=lm.vocab_size,
        max_positions=lm.max_positions,
        eos_token_ids=list(lm.eos_token_ids),
    )
