"""Wire models of the agent service."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if isinstance(p, dict))
        return self.content or ""


class PipelineRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str | None = Field(None, description="The question or search query (alias: message).")
    message: str | None = None
    collection: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    conversation_id: str | None = None
    remember: bool = Field(False, description="Keep the exchange in a (new) conversation.")
    history: list[Message] | None = None
    top_k: int | None = Field(None, ge=1, le=100)
    stream: bool = False

    def question(self) -> str:
        return self.query if self.query is not None else (self.message or "")


class ChatCompletionRequest(BaseModel):
    """OpenAI's request, with ``collection`` (and ``conversation_id``) as extra fields."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Message] = Field(min_length=1)
    collection: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    conversation_id: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None


class WsChatFrame(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["chat", "stop"] = "chat"
    pipeline: str | None = None
    agent: str | None = None
    collection: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    conversation_id: str | None = None
    message: str | None = None
