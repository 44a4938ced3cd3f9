"""A response's output assembled from a chat answer's pieces (text deltas, tool-call deltas, the
finish reason and usage), and the typed stream events the ``openai`` SDK parses on the way:

    response.created, response.in_progress,
    response.output_item.added, response.content_part.added, response.output_text.delta...,
    response.output_text.annotation.added, response.output_text.done, response.content_part.done,
    response.output_item.added (function_call), response.function_call_arguments.delta...,
    response.function_call_arguments.done, response.output_item.done,
    response.completed | response.incomplete (max_output_tokens) | response.failed

each with its ``sequence_number``, framed as SSE ``event:``/``data:`` pairs. An answer that is not
streamed goes through the same assembly (its events dropped), so both give the same output.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel

from services.common.jsonsafe import JsonObject
from services.common.responses_wire import (
    FileCitation,
    FunctionCallItem,
    IncompleteDetails,
    McpCallItem,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    new_id,
)


def sse_event(payload: JsonObject) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _dump(model: BaseModel) -> JsonObject:
    data: JsonObject = model.model_dump(mode="json")
    return data


class ResponseAssembly:
    """Feeds a chat answer into ``response`` (an ``in_progress`` one); every method returns the
    SSE frames of the events it made."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.sequence = 0
        self._message: OutputMessage | None = None
        self._call: FunctionCallItem | None = None
        # a chat tool-call index -> its item (an upstream may interleave calls' deltas)
        self._calls: dict[int, FunctionCallItem] = {}

    def _event(self, type_: str, **fields: Any) -> str:
        payload = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(payload)

    def _snapshot(self) -> JsonObject:
        return _dump(self.response)

    @property
    def _index(self) -> int:
        return len(self.response.output) - 1

    def start(self) -> list[str]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    # --- text -------------------------------------------------------------------------------------

    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        frames = self._close_call()
        if self._message is None:
            part = OutputText(text="")
            self._message = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
            self.response.output.append(self._message)
            frames.append(
                self._event("response.output_item.added", output_index=self._index, item=_dump(self._message))
            )
            self._message.content.append(part)
            frames.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._message.id,
                    output_index=self._index,
                    content_index=0,
                    part=_dump(part),
                )
            )
        self._message.content[0].text += delta
        frames.append(
            self._event(
                "response.output_text.delta",
                item_id=self._message.id,
                output_index=self.response.output.index(self._message),
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return frames

    def _close_message(self, status: str, citations: list[FileCitation]) -> list[str]:
        message, frames = self._message, list[str]()
        if message is None:
            return frames
        self._message = None
        index, part = self.response.output.index(message), message.content[0]
        for k, citation in enumerate(citations):
            part.annotations.append(citation)
            frames.append(
                self._event(
                    "response.output_text.annotation.added",
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    annotation_index=k,
                    annotation=_dump(citation),
                )
            )
        frames.append(
            self._event(
                "response.output_text.done",
                item_id=message.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            )
        )
        frames.append(
            self._event(
                "response.content_part.done",
                item_id=message.id,
                output_index=index,
                content_index=0,
                part=_dump(part),
            )
        )
        message.status = "completed" if status == "completed" else "incomplete"
        frames.append(self._event("response.output_item.done", output_index=index, item=_dump(message)))
        return frames

    def close_text(self, finish_reason: str | None, citations: list[FileCitation]) -> list[str]:
        """End the text with its citations now (items that follow it come after)."""
        return self._close_message("incomplete" if finish_reason == "length" else "completed", citations)

    # --- calls ------------------------------------------------------------------------------------

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str | None) -> list[str]:
        """One chat ``tool_calls`` delta: the first of a call has its id and name."""
        item = self._calls.get(index)
        frames: list[str] = []
        if item is None:
            frames += self._close_message("completed", [])
            frames += self._close_call()
            item = FunctionCallItem(
                id=new_id("fc"),
                status="in_progress",
                call_id=call_id or new_id("call"),
                name=name or "",
                arguments="",
            )
            self._calls[index] = item
            self.response.output.append(item)
            frames.append(
                self._event("response.output_item.added", output_index=self._index, item=_dump(item))
            )
        elif name and not item.name:
            item.name = name
        self._call = item
        if arguments:
            item.arguments += arguments
            frames.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=self.response.output.index(item),
                    delta=arguments,
                )
            )
        return frames

    def _close_call(self) -> list[str]:
        item, self._call = self._call, None
        if item is None or item.status == "completed":
            return []
        item.status = "completed"
        index = self.response.output.index(item)
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item.id,
                output_index=index,
                arguments=item.arguments,
            ),
            self._event("response.output_item.done", output_index=index, item=_dump(item)),
        ]

    def mcp_call(self, item: McpCallItem) -> list[str]:
        """A finished call to an MCP server's tool, added and done at once."""
        frames = self._close_message("completed", []) + self._close_call()
        self.response.output.append(item)
        frames.append(self._event("response.output_item.added", output_index=self._index, item=_dump(item)))
        frames.append(self._event("response.output_item.done", output_index=self._index, item=_dump(item)))
        return frames

    # --- the end ----------------------------------------------------------------------------------

    def finish(
        self,
        finish_reason: str | None,
        usage: dict[str, Any] | None,
        citations: list[FileCitation] | None = None,
    ) -> list[str]:
        """Close what is open; ``finish_reason`` ``length`` makes the response ``incomplete``."""
        status: Literal["incomplete", "completed"] = (
            "incomplete" if finish_reason == "length" else "completed"
        )
        frames = self._close_message(status, citations or [])
        for item in self._calls.values():
            if item.status != "completed":
                self._call = item
                frames += self._close_call()
        self.response.status = status
        if status == "incomplete":
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        self.response.usage = ResponseUsage.of_chat(usage)
        frames.append(self._event(f"response.{status}", response=self._snapshot()))
        return frames

    def fail(self, message: str, code: str | None = None) -> list[str]:
        """Generation stopped after the stream began: ``response.failed`` with the error."""
        self._message, self._call = None, None
        self.response.status = "failed"
        self.response.error = ResponseError(code=code or "server_error", message=message)
        return [self._event("response.failed", response=self._snapshot())]
