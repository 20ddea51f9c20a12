from specdec.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftAheadMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_AHEAD_MODE_UNSPECIFIED: _ClassVar[DraftAheadMode]
    DRAFT_AHEAD_MODE_ON: _ClassVar[DraftAheadMode]
    DRAFT_AHEAD_MODE_OFF: _ClassVar[DraftAheadMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
DRAFT_AHEAD_MODE_UNSPECIFIED: DraftAheadMode
DRAFT_AHEAD_MODE_ON: DraftAheadMode
DRAFT_AHEAD_MODE_OFF: DraftAheadMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SpeculationParams(_message.Message):
    __slots__ = ("method", "num_draft_tokens", "draft_ahead", "cache_scope", "auto_methods")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    AUTO_METHODS_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_draft_tokens: int
    draft_ahead: DraftAheadMode
    cache_scope: str
    auto_methods: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, method: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., draft_ahead: _Optional[_Union[DraftAheadMode, str]] = ..., cache_scope: _Optional[str] = ..., auto_methods: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "messages", "prompt_token_ids", "sampling", "speculation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    speculation: SpeculationParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("draft_method", "rounds", "draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "per_position_acceptance", "ttft_s", "tokens_per_s", "k_history", "total_s", "draft_s", "verify_s", "ahead_blocks", "ahead_hits", "mean_batch_size", "verify_queue_wait_s", "shadow_probes", "shadow_accepted", "verify_service_s", "verify_pass_s", "round_costs", "feature_bytes", "feature_bytes_per_round", "drafter_closes", "plain_runs", "plain_run_rounds")
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PER_POSITION_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    K_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    AHEAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SHADOW_PROBES_FIELD_NUMBER: _ClassVar[int]
    SHADOW_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SERVICE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PASS_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_COSTS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CLOSES_FIELD_NUMBER: _ClassVar[int]
    PLAIN_RUNS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_RUN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    draft_method: str
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    per_position_acceptance: _containers.RepeatedScalarFieldContainer[float]
    ttft_s: float
    tokens_per_s: float
    k_history: _containers.RepeatedScalarFieldContainer[int]
    total_s: float
    draft_s: float
    verify_s: float
    ahead_blocks: int
    ahead_hits: int
    mean_batch_size: float
    verify_queue_wait_s: float
    shadow_probes: int
    shadow_accepted: int
    verify_service_s: float
    verify_pass_s: float
    round_costs: _containers.RepeatedCompositeFieldContainer[RoundCost]
    feature_bytes: int
    feature_bytes_per_round: float
    drafter_closes: int
    plain_runs: int
    plain_run_rounds: int
    def __init__(self, draft_method: _Optional[str] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., per_position_acceptance: _Optional[_Iterable[float]] = ..., ttft_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., k_history: _Optional[_Iterable[int]] = ..., total_s: _Optional[float] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., ahead_blocks: _Optional[int] = ..., ahead_hits: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., verify_queue_wait_s: _Optional[float] = ..., shadow_probes: _Optional[int] = ..., shadow_accepted: _Optional[int] = ..., verify_service_s: _Optional[float] = ..., verify_pass_s: _Optional[float] = ..., round_costs: _Optional[_Iterable[_Union[RoundCost, _Mapping]]] = ..., feature_bytes: _Optional[int] = ..., feature_bytes_per_round: _Optional[float] = ..., drafter_closes: _Optional[int] = ..., plain_runs: _Optional[int] = ..., plain_run_rounds: _Optional[int] = ...) -> None: ...

class RoundCost(_message.Message):
    __slots__ = ("num_drafts", "rounds", "verify_s", "steady_rounds", "steady_draft_s")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    STEADY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STEADY_DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    num_drafts: int
    rounds: int
    verify_s: float
    steady_rounds: int
    steady_draft_s: float
    def __init__(self, num_drafts: _Optional[int] = ..., rounds: _Optional[int] = ..., verify_s: _Optional[float] = ..., steady_rounds: _Optional[int] = ..., steady_draft_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "stats", "request_id", "prompt_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    stats: GenerationStats
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
