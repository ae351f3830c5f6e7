"""The bodies of POST /v1/completions and /v1/chat/completions as pydantic models, and
`describe`, which turns a validation error into the one-line message and the `param` of an
OpenAI-style 400.

Types are strict as OpenAI's are (a bool is not an integer, "5" is not a number); a field
this server does not know is refused by name, and so is a parameter it knows but does not
implement, unless its value changes nothing: nothing is accepted and ignored. What needs
the model or the tokenizer (the model's name, prompt lengths, token ids' range) is left to
the server."""

from __future__ import annotations

import json
from typing import Annotated, Any, Callable, Literal, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_STOP_STRINGS = 4  # as OpenAI
# the engine's token limits, top-k and token ids are int32, its thresholds float32 (as
# `decoding.sampling`'s INT32_MAX and FLOAT32_MAX; this module imports no JAX)
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
TOKEN_LIMIT = f"an integer in 1..{INT32_MAX}"
THRESHOLD = f"a number in [0, {FLOAT32_MAX:.2g}]"

# a JSON number (an integer too, not a bool: the models are strict), finite
Number = Annotated[float, Field(allow_inf_nan=False)]
# where a message names its field: `describe` puts the field's path there
FIELD = "{field}"


def _invalid(message: str) -> PydanticCustomError:
    """An error whose message is `message`, with {field} where the field's path goes."""
    return PydanticCustomError("invalid", message)


def _refused(why: str = "is not supported by this server") -> PydanticCustomError:
    return _invalid(f"{FIELD} {why}")


def _refuse_if(refuse: Callable[[Any], bool], *fields: str,
               why: str = "is not supported by this server"):
    """The validator of parameters this server knows but does not implement: a value that
    changes nothing passes, one for which `refuse(value)` holds is refused by name."""

    def check(cls, value):
        if refuse(value):
            raise _refused(why)
        return value

    return field_validator(*fields)(check)


class _Object(BaseModel):
    """A JSON object of known fields with strict types, where null means absent (as
    OpenAI's clients send a parameter they leave out)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        if len(data) > len(cls.model_fields):
            # a key is unknown for sure: name the first now rather than build one error
            # per unknown key (a body of a million keys would hold the event loop)
            key = next(k for k in data if k not in cls.model_fields)
            raise PydanticCustomError("unrecognized", "unrecognized request argument",
                                      {"key": key})
        return data


class StreamOptions(_Object):
    include_usage: bool = False


class ResponseFormat(_Object):
    type: str
    json_schema: dict[str, Any] | None = None  # so that "json_schema" is refused by its type


class TextPart(_Object):
    type: Literal["text"] = Field(description='"text" (only text parts are supported)')
    text: str


def _text_or_parts(value) -> str | None:
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


class Message(_Object):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Annotated[str, Tag("text")],
                   Annotated[list[TextPart], Tag("parts"), Field(fail_fast=True)]] = Field(
        discriminator=Discriminator(
            _text_or_parts, custom_error_type="invalid",
            custom_error_message=f"{FIELD} must be a string or a list of text parts"))

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class GenerationRequest(_Object):
    """The fields both endpoints share."""

    model: str = Field(description="a string naming a model of GET /v1/models")
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description=TOKEN_LIMIT)
    temperature: Number = Field(1.0, ge=0, le=2, description="a number in [0, 2]")
    top_p: Number = Field(1.0, gt=0, le=1, description="a number in (0, 1]")
    top_k: int = Field(0, ge=-1, le=INT32_MAX,
                       description=f"{TOKEN_LIMIT}, or 0 or -1 for no top-k")
    # typical acceptance's thresholds (a server run with --acceptance typical; default: the
    # server's), as offline decoding takes them
    typical_epsilon: Number | None = Field(None, ge=0, le=FLOAT32_MAX, description=THRESHOLD)
    typical_delta: Number | None = Field(None, ge=0, le=FLOAT32_MAX, description=THRESHOLD)
    n: int = 1
    seed: int | None = Field(None, ge=-2**63, lt=2**63, description="a 64-bit integer")
    # lists stop at their first bad item (fail_fast): one error to report, not a million
    stop: list[str] = Field([], fail_fast=True, description="a string or a list of strings")
    stop_token_ids: list[int] = Field([], fail_fast=True, description="a list of integers")
    stream: bool = False
    stream_options: StreamOptions = StreamOptions()
    return_token_ids: bool = False
    user: str | None = None  # metadata: changes nothing about the answer
    # recognized, implemented only where they change nothing
    presence_penalty: Number = Field(0, ge=-2, le=2, description="a number in [-2, 2]")
    frequency_penalty: Number = Field(0, ge=-2, le=2, description="a number in [-2, 2]")
    logit_bias: dict[str, Any] = Field({}, description="an object mapping token ids to "
                                                       "numbers in [-100, 100]")
    # llama.cpp's: false prefills the whole prompt, even where a slot's cache holds its
    # beginning (the engine's prefix cache)
    cache_prompt: bool = True

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise _invalid(f"{FIELD} must be 1 (this server returns one choice), got {n}")
        return n

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, value):
        """Each an integer id the engine's int32 rows hold (the server checks the vocabulary)."""
        if isinstance(value, list):
            for j, t in enumerate(value):
                if type(t) is not int or not 0 <= t <= INT32_MAX:
                    raise _invalid(f"{FIELD}[{j}] must be an integer in 0..{INT32_MAX}, got "
                                   f"{json.dumps(t)[:40]}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop):
        if len(stop) > MAX_STOP_STRINGS or not all(stop):
            raise _invalid(f"{FIELD} takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    _no_penalty = _refuse_if(lambda v: v != 0, "presence_penalty", "frequency_penalty",
                             why="is not supported by this server (only 0)")
    _no_bias = _refuse_if(bool, "logit_bias")

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> dict:
        """The engine's per-request values: temperature 0 is greedy, top_k 0 or -1 is no
        top-k (0 for the engine), top_p 1 is no top-p."""
        return dict(max_tokens=self.max_new_tokens(), temperature=float(self.temperature),
                    top_p=float(self.top_p), top_k=max(0, self.top_k), seed=self.seed,
                    epsilon=None if self.typical_epsilon is None else float(self.typical_epsilon),
                    delta=None if self.typical_delta is None else float(self.typical_delta),
                    stop=list(self.stop), stop_ids=tuple(self.stop_token_ids),
                    stream=self.stream, include_usage=self.stream_options.include_usage,
                    return_token_ids=self.return_token_ids, cache_prompt=self.cache_prompt,
                    echo=False)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str = ""

    @field_validator("prompt", mode="plain")
    @classmethod
    def _one_prompt(cls, value):
        """A text or token ids; a batch of one is that one. Its length and its ids' range
        are checked by the server."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise _invalid(f"{FIELD} is empty")
            return value
        numbers = isinstance(value, list) and value and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) for t in value)
        if numbers:
            for j, t in enumerate(value):
                if not isinstance(t, int):
                    raise _invalid(f"{FIELD}[{j}] must be an integer token id, got "
                                   f"{json.dumps(t)[:40]}")
            return value
        if isinstance(value, list) and len(value) > 1 and all(
                isinstance(p, (str, list)) for p in value):
            raise _invalid(f"{FIELD}: one prompt per request (a batch is not supported)")
        raise _invalid(f"{FIELD} must be a string or a list of token ids")

    _one_of_one = _refuse_if(lambda v: v != 1, "best_of")
    _no_logprobs = _refuse_if(lambda v: v != 0, "logprobs")
    _no_suffix = _refuse_if(bool, "suffix", why="is not supported by this server (no insertion)")

    def sampling(self) -> dict:
        return super().sampling() | {"echo": self.echo}


class ChatCompletionRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1, fail_fast=True,
                                    description="a non-empty list of messages")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                              description=TOKEN_LIMIT)
    # metadata: changes nothing about the answer
    metadata: dict[str, str] | None = None  # OpenAI's: up to 16 keys
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # recognized, implemented only where they change nothing
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] = []
    functions: list[Any] = []
    tool_choice: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = Field(None, fail_fast=True)
    audio: Any = None
    prediction: Any = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _few_keys(cls, value):
        if isinstance(value, dict) and len(value) > 16:  # before one error per bad value
            raise _invalid(f"{FIELD} takes at most 16 keys")
        return value

    _no_logprobs = _refuse_if(bool, "logprobs")
    _no_top_logprobs = _refuse_if(lambda v: v != 0, "top_logprobs")
    _no_tools = _refuse_if(bool, "tools", "functions",
                           why="are not supported by this server (no function calling)")
    _no_calls = _refuse_if(lambda v: v != "none", "tool_choice", "function_call",
                           why="is not supported by this server (no function calling)")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, fmt):
        if fmt.type != "text":
            raise _refused(f"type {json.dumps(fmt.type)[:40]} is not supported by this "
                           f'server (only "text")')
        return fmt

    _text_out = _refuse_if(lambda v: v != ["text"], "modalities",
                           why='is not supported by this server (only ["text"])')
    # null is absent: any value is one this server cannot honour
    _nothing = _refuse_if(lambda v: True, "audio", "prediction")

    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def conversation(self) -> list[tuple[str, str]]:
        """(role, text) per message; "developer" is the system role of newer models."""
        return [("system" if m.role == "developer" else m.role, m.text)
                for m in self.messages]


# ----------------------------------------------------------------------------- errors

# what a value must be, by pydantic's error type, where the field does not say
_MUST = {"int_type": "an integer", "bool_type": "a boolean", "string_type": "a string",
         "float_type": "a number", "finite_number": "a finite number", "list_type": "a list",
         "dict_type": "an object", "model_type": "an object", "literal_error": "{expected}",
         "greater_than_equal": ">= {ge}", "greater_than": "> {gt}",
         "less_than_equal": "<= {le}", "less_than": "< {lt}"}


def _model_in(annotation) -> type[BaseModel] | None:
    """The model a field holds (itself, or in a list or an optional), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _where(model: type[BaseModel], loc: tuple) -> tuple[str, str, str | None]:
    """(path, param, description): the path of `loc` as messages[0].content, the field it
    is in (a list's item or an object's key reports its field), and the field's own
    description when `loc` is the field itself."""
    path, param, field, cls, tag = "", "", None, model, False
    for item in loc:
        if isinstance(item, int):
            path, field = f"{path}[{item}]", None
        elif tag:  # the branch a discriminated union took: not a part of the path
            tag = False
        elif cls is not None and item in cls.model_fields:
            path = f"{path}.{item}" if path else item
            param, field = path, cls.model_fields[item]
            cls, tag = _model_in(field.annotation), field.discriminator is not None
        else:  # a key of an object, or a name the model does not have
            path, field, cls = f"{path}.{item}" if path else str(item), None, None
    return path, param or path, field.description if field is not None else None


def describe(exc: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """(message, param) of the first error of validating a `model` body: the message is
    one line naming the field, and the bad value where there is one."""
    message, param = _describe(exc.errors(include_url=False)[0], model)
    one_line = lambda text: text.replace("\r", "\\r").replace("\n", "\\n")  # noqa: E731
    return one_line(message), None if param is None else one_line(param)


def _describe(err: dict, model: type[BaseModel]) -> tuple[str, str | None]:
    kind, loc = err["type"], tuple(err["loc"])
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({err['ctx']['error']})", None
    if not loc and kind != "unrecognized":
        return "the request body must be a JSON object", None
    path, param, description = _where(model, loc)
    if kind == "unrecognized":
        key = str(err["ctx"]["key"])
        path = f"{path}.{key}" if path else key
    if kind in ("unrecognized", "extra_forbidden"):
        return f"unrecognized request argument: {path[:60]}", path[:60]
    if kind == "missing":
        return f"{path} is required", param
    if kind == "invalid":
        return err["msg"].replace(FIELD, path, 1), param
    got = json.dumps(err.get("input"), default=str)[:60]
    must = description or _MUST.get(kind, "").format(**err.get("ctx", {}))
    if must:
        return f"{path} must be {must}, got {got}", param
    msg = err["msg"]
    return f"{path}: {msg[:1].lower()}{msg[1:]}, got {got}", param
