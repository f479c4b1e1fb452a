"""The Python 3.11 standard-library names the code uses, on Python 3.10 too: `StrEnum`
(enum, 3.11), `NotRequired` and a `TypedDict` that understands it (typing, 3.11; from
typing_extensions on 3.10). On 3.11 and later these are the standard library's own."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
    from typing import NotRequired, TypedDict
else:  # Python 3.10
    from enum import Enum

    from typing_extensions import NotRequired, TypedDict

    class StrEnum(str, Enum):
        """enum.StrEnum as Python 3.11 has it: members are strings, and str() and format()
        give the value (not `Class.member`); auto() gives the lower-cased name."""

        def __str__(self) -> str:
            return str.__str__(self)

        @staticmethod
        def _generate_next_value_(name: str, start: int, count: int, last_values: list) -> str:
            return name.lower()


__all__ = ["NotRequired", "StrEnum", "TypedDict"]
