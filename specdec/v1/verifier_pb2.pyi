from specdec.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("start", "block")
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    start: VerifyStart
    block: VerifyBlock
    def __init__(self, start: _Optional[_Union[VerifyStart, _Mapping]] = ..., block: _Optional[_Union[VerifyBlock, _Mapping]] = ...) -> None: ...

class VerifyStart(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "want_features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    want_features: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., want_features: _Optional[bool] = ...) -> None: ...

class VerifyBlock(_message.Message):
    __slots__ = ("round", "draft_token_ids", "draft_probs", "plain_steps")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    round: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: _containers.RepeatedCompositeFieldContainer[_types_pb2.SparseDistribution]
    plain_steps: int
    def __init__(self, round: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Iterable[_Union[_types_pb2.SparseDistribution, _Mapping]]] = ..., plain_steps: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("round", "num_drafts", "num_accepted", "token_ids", "committed_length", "service_time_us", "batch_size", "batch_tokens", "queue_wait_us", "pass_time_us", "features", "plain_steps_left")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SERVICE_TIME_US_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    PASS_TIME_US_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_LEFT_FIELD_NUMBER: _ClassVar[int]
    round: int
    num_drafts: int
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    committed_length: int
    service_time_us: int
    batch_size: int
    batch_tokens: int
    queue_wait_us: int
    pass_time_us: int
    features: _types_pb2.TargetFeatures
    plain_steps_left: int
    def __init__(self, round: _Optional[int] = ..., num_drafts: _Optional[int] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., committed_length: _Optional[int] = ..., service_time_us: _Optional[int] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., queue_wait_us: _Optional[int] = ..., pass_time_us: _Optional[int] = ..., features: _Optional[_Union[_types_pb2.TargetFeatures, _Mapping]] = ..., plain_steps_left: _Optional[int] = ...) -> None: ...

class GetVerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVerifierInfoResponse(_message.Message):
    __slots__ = ("model", "load", "forward_cost_s", "feature_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_S_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: _types_pb2.ModelInfo
    load: _types_pb2.LoadReport
    forward_cost_s: _containers.RepeatedScalarFieldContainer[float]
    feature_size: int
    def __init__(self, model: _Optional[_Union[_types_pb2.ModelInfo, _Mapping]] = ..., load: _Optional[_Union[_types_pb2.LoadReport, _Mapping]] = ..., forward_cost_s: _Optional[_Iterable[float]] = ..., feature_size: _Optional[int] = ...) -> None: ...

class CancelVerifyRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelVerifyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
