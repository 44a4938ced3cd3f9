"""Limits shared by the services' request models (docs/contracts.md, "Request limits").

Every string, list, map and number a client sends has a bound, checked as the body is
validated, so an oversized value is a 400 naming the field and the limit before any work
starts. Numbers and booleans are strict (``true`` is not 1, 1 is not ``true``); an integer is
still a float. Free-form JSON (a tool's parameters schema, a document's metadata) is bounded by
``JsonBound``: values in all and characters per string, keys included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

from services.common.jsonsafe import JsonObject

# Unix seconds of 2100-01-01T00:00:00Z: a timestamp past it is a mistake (or a probe), not a date.
MAX_UNIX_S = 4_102_444_800.0

# An identifier: a model, collection, conversation, message, call or tool name.
NAME_CHARS = 256
# A message's text, a query, a document's text are bounded by the body limit first; this is
# the most any one string field may hold (a 16 MiB body limit holds 16 Mi one-byte characters).
TEXT_CHARS = 16 * 1024 * 1024

# OpenAI's bounds on ``metadata`` (Responses, Assistants): 16 pairs, 64-char keys, 512-char values.
METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512

Name = Annotated[str, Field(max_length=NAME_CHARS)]
MetadataKey = Annotated[str, Field(max_length=METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=METADATA_VALUE_CHARS)]


@dataclass(frozen=True)
class JsonBound:
    """A free-form JSON value of at most ``values`` values in all (every object member and array
    item, however deep, counts one) whose strings, object keys included, are at most ``chars``
    characters. Checked before the value is copied, in one iterative walk that stops at the
    first excess (the guard has already refused JSON nested deeper than 64 levels)."""

    values: int
    chars: int

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_before_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = handler(schema)
        out["x-max-values"] = self.values
        out["x-max-string-length"] = self.chars
        return out

    def check(self, value: Any) -> Any:
        count = 0
        stack = [value]
        while stack:
            node = stack.pop()
            if isinstance(node, str):
                if len(node) > self.chars:
                    raise ValueError(f"a string longer than {self.chars} characters")
                continue
            if not isinstance(node, dict | list):
                continue
            count += len(node)
            # counted before it is walked: a list of millions is refused without a copy
            if count > self.values:
                raise ValueError(f"more than {self.values} values in all (members and items, however nested)")
            if isinstance(node, dict):
                stack.extend(node.keys())
                stack.extend(node.values())
            else:
                stack.extend(node)
        return value


# A tool's definition or a JSON schema (response_format, text.format): OpenAI's own tool
# schemas run to hundreds of values; ten thousand leaves room for the largest real ones.
JSON_SCHEMA = JsonBound(values=10_000, chars=100_000)
# A message's content parts, a Responses input item: text as long as a message may be.
JSON_DATA = JsonBound(values=10_000, chars=TEXT_CHARS)
# A document's metadata, a search's filters, a job's hyperparameters: small structured values.
JSON_SMALL = JsonBound(values=1_000, chars=65_536)

Text = Annotated[str, Field(max_length=TEXT_CHARS)]
JsonSchema = Annotated[JsonObject, JSON_SCHEMA]
JsonData = Annotated[JsonObject, JSON_DATA]
JsonSmall = Annotated[JsonObject, JSON_SMALL]
