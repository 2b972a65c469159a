from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "template_kwargs")
    class TemplateKwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    template_kwargs: _containers.ScalarMap[str, str]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., template_kwargs: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "max_new_tokens", "sampling", "stop_token_ids", "stop", "tree_budget", "logprobs", "ignore_eos", "min_tokens", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: Chat
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    tree_budget: int
    logprobs: int
    ignore_eos: bool
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., tree_budget: _Optional[int] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("round", "token_ids", "text", "logprobs")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    round: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, round: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("rounds", "mean_acceptance", "time_to_first_token_s", "tokens_per_s", "elapsed_s", "acceptance_lengths", "round_stats")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ROUND_STATS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    mean_acceptance: float
    time_to_first_token_s: float
    tokens_per_s: float
    elapsed_s: float
    acceptance_lengths: _containers.RepeatedScalarFieldContainer[int]
    round_stats: _containers.RepeatedCompositeFieldContainer[RoundStats]
    def __init__(self, rounds: _Optional[int] = ..., mean_acceptance: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., acceptance_lengths: _Optional[_Iterable[int]] = ..., round_stats: _Optional[_Iterable[_Union[RoundStats, _Mapping]]] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("tokens", "tree_nodes", "draft_ms", "build_ms", "verify_ms", "network_ms")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    BUILD_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    tree_nodes: int
    draft_ms: float
    build_ms: float
    verify_ms: float
    network_ms: float
    def __init__(self, tokens: _Optional[int] = ..., tree_nodes: _Optional[int] = ..., draft_ms: _Optional[float] = ..., build_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., network_ms: _Optional[float] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "stats")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    stats: Stats
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: TokenDelta
    final: GenerateFinal
    def __init__(self, delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class GenerateOnceResponse(_message.Message):
    __slots__ = ("token_ids", "text", "final", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    final: GenerateFinal
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PackedInts(_message.Message):
    __slots__ = ("data", "width")
    DATA_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    width: int
    def __init__(self, data: _Optional[bytes] = ..., width: _Optional[int] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("prompt_token_ids", "sampling", "traceparent", "feature_layer_ids", "logprobs", "more", "bias_token_ids", "bias_values", "bias_until", "output_start")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    BIAS_UNTIL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    traceparent: str
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    more: bool
    bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_values: _containers.RepeatedScalarFieldContainer[float]
    bias_until: _containers.RepeatedScalarFieldContainer[int]
    output_start: int
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., traceparent: _Optional[str] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., more: _Optional[bool] = ..., bias_token_ids: _Optional[_Iterable[int]] = ..., bias_values: _Optional[_Iterable[float]] = ..., bias_until: _Optional[_Iterable[int]] = ..., output_start: _Optional[int] = ...) -> None: ...

class Extend(_message.Message):
    __slots__ = ("prompt_token_ids", "more", "traceparent")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    more: bool
    traceparent: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., more: _Optional[bool] = ..., traceparent: _Optional[str] = ...) -> None: ...

class Trees(_message.Message):
    __slots__ = ("fields", "traceparents")
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENTS_FIELD_NUMBER: _ClassVar[int]
    fields: PackedInts
    traceparents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, fields: _Optional[_Union[PackedInts, _Mapping]] = ..., traceparents: _Optional[_Iterable[str]] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionEntry(_message.Message):
    __slots__ = ("session_id", "open", "close", "extend")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    open: Open
    close: Close
    extend: Extend
    def __init__(self, session_id: _Optional[int] = ..., open: _Optional[_Union[Open, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., extend: _Optional[_Union[Extend, _Mapping]] = ...) -> None: ...

class LinkRequest(_message.Message):
    __slots__ = ("step", "entries", "trees", "tree_tokens", "tree_next_token", "tree_next_sibling", "feature_ring", "ring_released", "ring_refused", "unix_socket")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    TREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TREE_NEXT_SIBLING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_RING_FIELD_NUMBER: _ClassVar[int]
    RING_RELEASED_FIELD_NUMBER: _ClassVar[int]
    RING_REFUSED_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    step: int
    entries: _containers.RepeatedCompositeFieldContainer[SessionEntry]
    trees: Trees
    tree_tokens: PackedInts
    tree_next_token: PackedInts
    tree_next_sibling: PackedInts
    feature_ring: bool
    ring_released: int
    ring_refused: bool
    unix_socket: bool
    def __init__(self, step: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[SessionEntry, _Mapping]]] = ..., trees: _Optional[_Union[Trees, _Mapping]] = ..., tree_tokens: _Optional[_Union[PackedInts, _Mapping]] = ..., tree_next_token: _Optional[_Union[PackedInts, _Mapping]] = ..., tree_next_sibling: _Optional[_Union[PackedInts, _Mapping]] = ..., feature_ring: _Optional[bool] = ..., ring_released: _Optional[int] = ..., ring_refused: _Optional[bool] = ..., unix_socket: _Optional[bool] = ...) -> None: ...

class UnixSocket(_message.Message):
    __slots__ = ("path", "nonce")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    nonce: bytes
    def __init__(self, path: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class FeatureRing(_message.Message):
    __slots__ = ("path", "capacity", "nonce")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    capacity: int
    nonce: bytes
    def __init__(self, path: _Optional[str] = ..., capacity: _Optional[int] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("logprobs", "top_counts", "top_token_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Prefilled(_message.Message):
    __slots__ = ("token", "max_seq_len", "feature_rows", "logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    max_seq_len: int
    feature_rows: int
    logprobs: Logprobs
    def __init__(self, token: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., feature_rows: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ...) -> None: ...

class Extended(_message.Message):
    __slots__ = ("feature_rows",)
    FEATURE_ROWS_FIELD_NUMBER: _ClassVar[int]
    feature_rows: int
    def __init__(self, feature_rows: _Optional[int] = ...) -> None: ...

class VerifiedResults(_message.Message):
    __slots__ = ("fields", "accepted_tokens", "logprobs")
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    fields: PackedInts
    accepted_tokens: PackedInts
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, fields: _Optional[_Union[PackedInts, _Mapping]] = ..., accepted_tokens: _Optional[_Union[PackedInts, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResult(_message.Message):
    __slots__ = ("session_id", "prefilled", "error", "extended")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXTENDED_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    prefilled: Prefilled
    error: Error
    extended: Extended
    def __init__(self, session_id: _Optional[int] = ..., prefilled: _Optional[_Union[Prefilled, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., extended: _Optional[_Union[Extended, _Mapping]] = ...) -> None: ...

class LinkResponse(_message.Message):
    __slots__ = ("step", "results", "verified", "features", "step_seconds", "notice", "held_seconds", "ring", "features_at", "unix_socket")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_AT_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    step: int
    results: _containers.RepeatedCompositeFieldContainer[SessionResult]
    verified: VerifiedResults
    features: Tensor
    step_seconds: float
    notice: bool
    held_seconds: float
    ring: FeatureRing
    features_at: int
    unix_socket: UnixSocket
    def __init__(self, step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SessionResult, _Mapping]]] = ..., verified: _Optional[_Union[VerifiedResults, _Mapping]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., step_seconds: _Optional[float] = ..., notice: _Optional[bool] = ..., held_seconds: _Optional[float] = ..., ring: _Optional[_Union[FeatureRing, _Mapping]] = ..., features_at: _Optional[int] = ..., unix_socket: _Optional[_Union[UnixSocket, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("architecture", "vocab_size", "hidden_size", "num_layers", "dtype", "config_fingerprint", "feature_layer_ids", "max_seq_len", "max_sessions", "max_tree_nodes", "free_sessions", "feature_projection", "busy_s", "device_id", "verify_costs", "sampling", "deterministic", "feature_wire", "draining", "token_bias", "penalties", "columns")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    FREE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_PROJECTION_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WIRE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BIAS_FIELD_NUMBER: _ClassVar[int]
    PENALTIES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    dtype: str
    config_fingerprint: str
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    max_seq_len: int
    max_sessions: int
    max_tree_nodes: int
    free_sessions: int
    feature_projection: str
    busy_s: float
    device_id: str
    verify_costs: _containers.RepeatedCompositeFieldContainer[VerifyCost]
    sampling: str
    deterministic: bool
    feature_wire: str
    draining: bool
    token_bias: bool
    penalties: bool
    columns: bool
    def __init__(self, architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., config_fingerprint: _Optional[str] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ..., max_seq_len: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., free_sessions: _Optional[int] = ..., feature_projection: _Optional[str] = ..., busy_s: _Optional[float] = ..., device_id: _Optional[str] = ..., verify_costs: _Optional[_Iterable[_Union[VerifyCost, _Mapping]]] = ..., sampling: _Optional[str] = ..., deterministic: _Optional[bool] = ..., feature_wire: _Optional[str] = ..., draining: _Optional[bool] = ..., token_bias: _Optional[bool] = ..., penalties: _Optional[bool] = ..., columns: _Optional[bool] = ...) -> None: ...

class VerifyCost(_message.Message):
    __slots__ = ("batch", "tokens", "seconds")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    tokens: int
    seconds: float
    def __init__(self, batch: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
