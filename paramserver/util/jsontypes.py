"""The one type for open JSON documents: what a JSON file or a user's free-form
metrics hold before (or instead of) a typed record. Shaped data gets a dataclass or
a Struct; this is for the few places where the keys are truly open.
"""

from __future__ import annotations

from typing import TypeAlias

JSONScalar: TypeAlias = "str | int | float | bool | None"
JSON: TypeAlias = "JSONScalar | list[JSON] | dict[str, JSON]"
JSONObject: TypeAlias = "dict[str, JSON]"

__all__ = ["JSON", "JSONObject", "JSONScalar"]
