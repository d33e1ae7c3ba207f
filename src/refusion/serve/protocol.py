"""The OpenAI-compatible request bodies the server accepts, validated strictly (pydantic), and its errors.

Every body rejects unknown fields and wrong types (no coercion: ``"max_tokens": "10"`` is refused); an
error names the field (:class:`RequestError`, answered as OpenAI's ``{"error": {"message", "type",
"param", "code"}}``). OpenAI fields that would change the output and that the server does not implement
(``logprobs``, ``echo``, penalties, ``logit_bias``, ``n`` above 1, ``top_p`` below 1, ...) are refused by
name, never ignored. Decoder options go in the extension field ``refusion`` (a mapping of the served
decoder's options, as in a config file: ``{"slot_size": 4, "selector": {"slot_threshold": 0.8}}``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError
from pydantic import model_validator

from refusion.core.config import format_validation_error

#: default limit of a request body (bytes)
MAX_BODY_BYTES = 1 << 20
#: default per-request timeout (seconds, arrival to last token)
REQUEST_TIMEOUT_S = 600.0
#: the most stop strings a request may give (OpenAI's limit)
MAX_STOP = 4
#: the largest seed (a torch generator's seed is a 64-bit integer)
MAX_SEED = 2**63 - 1


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, the offending ``param`` (a field path) and a message
    that names it."""

    def __init__(self, status: int, param: str | None, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.message, self.kind = status, param, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def validation_error(err: ValidationError) -> RequestError:
    """A pydantic error -> a 400 naming every offending field (the first one as ``param``)."""
    errors = err.errors()
    message = format_validation_error(err)
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else message.split(":")[0]
    return RequestError(400, param, message if len(message) <= 2000 else message[:2000] + " ...")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: StrictBool = False


#: OpenAI fields the server does not implement -> the value that means "not used"
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None,), "echo": (None, False), "best_of": (None, 1),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"})}


class SamplingFields(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1, description="tokens to generate at most (default: the "
                                         "served config's gen_length)")
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0, le=100, description="sampling temperature "
                                                        "(default: the served config's)")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED, description="seed of the request's sampling generator")
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    top_p: StrictFloat | StrictInt = 1.0
    user: StrictStr | None = None
    refusion: dict[str, Any] | None = Field(None, description="the served decoder's options for this request")
    # refused when used (see UNSUPPORTED)
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None

    @model_validator(mode="after")
    def _supported(self) -> "SamplingFields":
        for name, unused in UNSUPPORTED.items():
            value = getattr(self, name)
            if not any(value == u and type(value) is type(u) for u in unused):
                raise ValueError(f"{name}: not supported by this server (got {value!r}); leave it out")
        if self.n != 1:
            raise ValueError(f"n: this server returns one choice per request (got {self.n}); send n requests")
        if self.top_p != 1:
            raise ValueError(f"top_p: nucleus sampling is not supported (got {self.top_p}); use temperature, "
                             "or leave top_p out")
        stops = self.stop_strings
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings (got {len(stops)})")
        if any(not s for s in stops):
            raise ValueError("stop: a stop string is empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr]

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError(f"prompt: one prompt per request (got a list of {len(self.prompt)}); send "
                                 "one request each")
            self.prompt = self.prompt[0]
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatRequest":
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_completion_tokens: contradicts max_tokens; give one of them")
            self.max_tokens = self.max_completion_tokens
        return self


def parse(model: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body against ``model``; -> the request, or raises a :class:`RequestError`."""
    if not isinstance(data, dict):
        raise RequestError(400, "body", f"body: expected a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
