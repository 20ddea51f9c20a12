from specdec.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("start", "propose")
    START_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    start: DraftStart
    propose: ProposalRequest
    def __init__(self, start: _Optional[_Union[DraftStart, _Mapping]] = ..., propose: _Optional[_Union[ProposalRequest, _Mapping]] = ...) -> None: ...

class DraftStart(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "draft_top_k", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOP_K_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    draft_top_k: int
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., draft_top_k: _Optional[int] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class ProposalRequest(_message.Message):
    __slots__ = ("round", "committed_token_ids", "num_draft_tokens", "ahead_tokens", "ahead_used", "target_features")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_USED_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    round: int
    committed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    ahead_tokens: int
    ahead_used: int
    target_features: _types_pb2.TargetFeatures
    def __init__(self, round: _Optional[int] = ..., committed_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., ahead_tokens: _Optional[int] = ..., ahead_used: _Optional[int] = ..., target_features: _Optional[_Union[_types_pb2.TargetFeatures, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("started", "proposal", "ahead")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    started: DraftStarted
    proposal: DraftProposal
    ahead: DraftAhead
    def __init__(self, started: _Optional[_Union[DraftStarted, _Mapping]] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ..., ahead: _Optional[_Union[DraftAhead, _Mapping]] = ...) -> None: ...

class DraftAhead(_message.Message):
    __slots__ = ("round", "assumed_token_ids", "proposal")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    round: int
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposal: DraftProposal
    def __init__(self, round: _Optional[int] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ...) -> None: ...

class DraftStarted(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("round", "draft_token_ids", "draft_probs", "service_time_us", "batch_size", "queue_wait_us", "acceptance_estimates")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    round: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_types_pb2.SparseDistribution]
    service_time_us: int
    batch_size: int
    queue_wait_us: int
    acceptance_estimates: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, round: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_types_pb2.SparseDistribution, _Mapping]]] = ..., service_time_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., queue_wait_us: _Optional[int] = ..., acceptance_estimates: _Optional[_Iterable[float]] = ...) -> None: ...

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDrafterInfoResponse(_message.Message):
    __slots__ = ("method", "model", "load", "supports_draft_ahead", "feature_size")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    method: str
    model: _types_pb2.ModelInfo
    load: _types_pb2.LoadReport
    supports_draft_ahead: bool
    feature_size: int
    def __init__(self, method: _Optional[str] = ..., model: _Optional[_Union[_types_pb2.ModelInfo, _Mapping]] = ..., load: _Optional[_Union[_types_pb2.LoadReport, _Mapping]] = ..., supports_draft_ahead: _Optional[bool] = ..., feature_size: _Optional[int] = ...) -> None: ...

class CancelDraftRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelDraftResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
