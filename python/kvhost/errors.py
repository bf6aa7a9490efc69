"""kvhost's errors: one exception class per gRPC status code.

Every C ABI call returns the gRPC / absl canonical code (the daemon's own
code passes through unchanged) and a message naming the bad value. This
module turns them into exceptions: :class:`KvhostError` carries ``.code`` (a
:class:`StatusCode`, an ``IntEnum``, so ``e.code == 5``,
``e.code.name == "NOT_FOUND"``) and ``.message``; its subclasses
(:class:`NotFound`, :class:`InvalidArgument`, ...) let a caller catch one
kind. :class:`LibraryError` is apart: the native library could not be used
at all.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type, Union


class StatusCode(enum.IntEnum):
    """gRPC / absl canonical status codes (KVHOST_OK ... in kvhost_c.h)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class KvhostError(Exception):
    """A kvhost call failed: ``.code`` (StatusCode, or the int when it is not
    one of them) and ``.message`` (the daemon's or the library's words)."""

    #: The code this class stands for; None for the base class.
    CODE: Optional[StatusCode] = None

    def __init__(self, code: Union[int, StatusCode], message: str) -> None:
        try:
            self.code: Union[StatusCode, int] = StatusCode(code)
        except ValueError:
            self.code = int(code)
        self.message = message
        super().__init__(f"{self.code_name}: {message}")

    @property
    def code_name(self) -> str:
        """The code's name ("NOT_FOUND"); "UNKNOWN_CODE" for one outside the set."""
        return self.code.name if isinstance(self.code, StatusCode) else "UNKNOWN_CODE"

    # Pickles across processes with code and message.
    def __reduce__(self) -> Tuple[Any, Tuple[int, str]]:
        return (type(self), (int(self.code), self.message))


class Cancelled(KvhostError):
    CODE = StatusCode.CANCELLED


class Unknown(KvhostError):
    CODE = StatusCode.UNKNOWN


class InvalidArgument(KvhostError):
    CODE = StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvhostError):
    CODE = StatusCode.DEADLINE_EXCEEDED


class NotFound(KvhostError):
    CODE = StatusCode.NOT_FOUND


class AlreadyExists(KvhostError):
    CODE = StatusCode.ALREADY_EXISTS


class PermissionDenied(KvhostError):
    CODE = StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvhostError):
    CODE = StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KvhostError):
    CODE = StatusCode.FAILED_PRECONDITION


class Aborted(KvhostError):
    CODE = StatusCode.ABORTED


class OutOfRange(KvhostError):
    CODE = StatusCode.OUT_OF_RANGE


class Unimplemented(KvhostError):
    CODE = StatusCode.UNIMPLEMENTED


class Internal(KvhostError):
    CODE = StatusCode.INTERNAL


class Unavailable(KvhostError):
    CODE = StatusCode.UNAVAILABLE


class DataLoss(KvhostError):
    CODE = StatusCode.DATA_LOSS


class Unauthenticated(KvhostError):
    CODE = StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[int, Type[KvhostError]] = {
    int(cls.CODE): cls for cls in KvhostError.__subclasses__() if cls.CODE is not None
}


def error_for(code: int, message: str) -> KvhostError:
    """The exception for a nonzero code: its subclass, else KvhostError."""
    return _BY_CODE.get(int(code), KvhostError)(code, message)


def raise_for(code: int, message: str) -> None:
    """Raises error_for(code, message) unless code is OK."""
    if code != 0:
        raise error_for(code, message)


class LibraryError(OSError):
    """libkvhost_c.so could not be loaded or is the wrong ABI version.

    ``.tried`` lists every place looked at, each with why it did not do.
    """

    def __init__(self, message: str, tried: Sequence[str]) -> None:
        super().__init__(message)
        self.tried: List[str] = list(tried)
