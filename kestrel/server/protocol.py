"""Request bodies of the HTTP API (OpenAI's names, plus vLLM/SGLang's sampling extensions).

Types are strict (no "1" for 1, no true for 1) so a wrong type is a 400 naming the field rather than a guess.
Value ranges are checked once, by `SamplingParams`, so the server and the offline API agree on what is valid.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from kestrel.engine.sampling_params import SamplingParams


def _unicode(text: str) -> str:
    # JSON can escape a lone surrogate ("\\ud800"); it is no character, so the tokenizer cannot encode it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text must be valid Unicode; got a lone surrogate at index {exc.start}") from None
    return text


Str = Annotated[str, Strict(), AfterValidator(_unicode)]
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]  # Python's json reads Infinity and NaN
Bool = Annotated[bool, Strict()]
TokenIds = Annotated[list[Int], Field(min_length=1)]

# The chat template knows low / high / max; OpenAI's other levels become the nearest of those.
NEAREST_EFFORT = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max"}
MAX_N = 128  # OpenAI's limit on choices per request
SEED_RANGE = (-(2**63), 2**64 - 1 - MAX_N)  # what torch.Generator.manual_seed accepts, leaving room for seed + i


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDef(_Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: Str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Body):
    name: Str
    arguments: Str | dict[str, Any]


class ToolCall(_Body):
    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Body):
    type: Literal["text"]
    text: Str


class ImageURL(_Body):
    url: Annotated[str, Strict(), Field(min_length=1)]  # data:, http(s): or file: (see kestrel/server/media.py)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class MediaPart(_Body):
    """A part of another modality: accepted by the schema only so that the refusal can say what was sent."""

    type: Literal["input_audio", "file"]


Part = Annotated[TextPart | ImagePart | MediaPart, Field(discriminator="type")]


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[Part] | None = None
    name: Str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Str | None = None
    reasoning_content: Str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict `render_chat` reads (text parts joined; `developer` is a system message)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            # Image parts stay parts: the template writes its image marker there (the URL is the server's business).
            out["content"] = [
                {"type": "image_url"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                for p in self.content
            ]
        elif isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        if self.role == "developer":
            out["role"] = "system"
        return out


class StreamOptions(_Body):
    include_usage: Bool = False


class JsonSchemaFormat(_Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # absent: any JSON object
    strict: Bool | None = None


class ResponseFormat(_Body):
    """OpenAI's structured output: `json_object` (any JSON object) or `json_schema` (JSON matching a schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a `json_schema` object")
        return self


class SamplingFields(_Body):
    """What chat and completions share: the model, sampling knobs, stopping, streaming."""

    model: Str | None = None
    n: Int = 1
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Int] | None = None
    max_tokens: Int | None = None
    min_tokens: Int = 0
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    logit_bias: dict[str, Float] | None = None
    best_of: Int | None = None
    response_format: ResponseFormat | None = None
    bootstrap_host: Str | list[Str] | None = None  # SGLang's PD fields, injected by its router (one per prompt)
    bootstrap_port: Int | list[Int | None] | None = None
    bootstrap_room: Int | list[Int] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (`SamplingParams` validation) for out-of-range values."""
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be absent: ranking candidates is not supported")
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            logit_bias=self._logit_bias(),
            **{k: v for k, v in given.items() if v is not None},
        )

    def _logit_bias(self) -> dict[int, float]:
        # JSON object keys are strings; OpenAI's are token ids written in decimal.
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            bias[int(key)] = value
        return bias


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    reasoning_effort: (
        Annotated[Literal["minimal", "low", "medium", "high", "max"], AfterValidator(NEAREST_EFFORT.__getitem__)] | None
    ) = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    suffix: Str | None = None
    prompt: Str | TokenIds | Annotated[list[Str], Field(min_length=1)] | Annotated[list[TokenIds], Field(min_length=1)]
    logprobs: Int | None = None
    echo: Bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:  # else every member of the union reports its own complaint
            raise ValueError("prompt must not be empty")
        return value


class GenerateSampling(_Body):
    """SGLang's `sampling_params` of `/generate`; unknown keys are refused so a typo is not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Int | None = None
    min_new_tokens: Int = 0
    n: Int = 1
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Int = -1
    min_p: Float = 0.0
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    sampling_seed: Int | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True

    def to_params(
        self, default_max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        seed = self.sampling_seed
        if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ValueError(f"sampling_seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed}")
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            max_tokens=default_max_tokens if self.max_new_tokens is None else self.max_new_tokens,
            min_tokens=self.min_new_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


Rid = Annotated[str, Strict(), Field(min_length=1, max_length=256)]


class GenerateRequest(_Body):
    """SGLang's token-level `/generate` (RL rollouts): exactly one of `text` / `input_ids`, each one prompt or a
    batch (a list of texts, a list of id lists); a batch answers with a list of results."""

    text: Str | Annotated[list[Str], Field(min_length=1)] | None = None
    input_ids: list[Int] | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    return_logprob: Bool = False
    top_logprobs_num: Int = 0
    logprob_start_len: Int = -1  # -1: no input-token logprobs
    # Rollout capture (needs --enable-return-routed-experts / --enable-return-indexer-topk): base64 int32 rows of
    # every token that went through the model, SGLang's encoding; routed_experts_start_len drops the first rows.
    return_routed_experts: Bool = False
    return_indexer_topk: Bool = False
    routed_experts_start_len: Annotated[int, Strict(), Field(ge=0)] = 0
    lora_path: Str | list[Str | None] | None = None  # a loaded adapter's name (SGLang's field), per prompt in a batch
    rid: Rid | list[Rid] | None = None
    stream: Bool = False
    bootstrap_host: Str | list[Str] | None = None  # SGLang's PD fields, injected by its router (one per prompt)
    bootstrap_port: Int | list[Int | None] | None = None
    bootstrap_room: Int | list[Int] | None = None


class LoadLoRARequest(_Body):
    """SGLang's body (`pinned` and `lora_id` are accepted; Kestrel never evicts an adapter), plus the upsert fields:
    `replace` swaps the version behind a loaded name between two steps, `lora_version` tags it, `checksum` (sha256
    of adapter_model.safetensors) is verified against the bytes loaded."""

    lora_name: Annotated[str, Strict(), Field(min_length=1, max_length=256)]
    lora_path: Str
    pinned: Bool = False
    lora_id: Str | None = None
    replace: Bool = False
    lora_version: Annotated[str, Strict(), Field(min_length=1, max_length=256)] | None = None
    checksum: Annotated[str, Strict(), Field(pattern=r"^(sha256:)?[0-9a-fA-F]{64}$")] | None = None


class UnloadLoRARequest(_Body):
    lora_name: Str


class AbortRequest(_Body):
    rid: Str


Version = Annotated[str, Strict(), Field(min_length=1, max_length=256)]


class UpdateWeightsFromDiskRequest(_Body):
    """SGLang's `UpdateWeightFromDiskReqInput`; its other fields (is_async, keep_pause, token_step, ...) are
    accepted and change nothing here (an update never changes the pause state)."""

    model_path: Annotated[str, Strict(), Field(min_length=1)]
    load_format: Str | None = None
    weight_version: Version | None = None
    flush_cache: Bool = True
    abort_all_requests: Bool = False


class PauseGenerationRequest(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(_Body):
    pass


class UpdateWeightVersionRequest(_Body):
    new_version: Version
    abort_all_requests: Bool = True
