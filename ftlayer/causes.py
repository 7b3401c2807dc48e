"""Why a tree failed: `Cause` (one failure's kind, step and error) and `Causes` (a cause
per failed root, as a small table and an index, the way FAIL carries them).

A cause travels with every fail, from the step or sink that decided it to the FT
layer, which keeps the causes of a record's failures with its retry count, so a dead
letter says what went wrong each time (ftlayer.core.retries). Kinds:

- `explicit`: a step raised FailException (the user's own decision);
- `error`: another exception in user code, under on_error="fail-record";
- `sink`: a write the sink's target refused;
- `timeout`: the tree did not complete within its timeout (the FT layer's own verdict);
- `source-expired`: the record was stored by reference and its source no longer has it
  (retention, compaction, a deleted topic): always final (ftlayer.core.fills).

`final` marks a failure certain to repeat (a schema error): the record is dead-lettered
at once instead of being retried. `final_if_repeated` marks one likely to repeat (a
programming error that failed every record of its batch alike): the record is retried
once, in a later batch and so another task attempt (a transient ImportError on one
executor passes), and dead-lettered if that retry fails the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ftlayer.errors import ConfigError, CorruptData

__all__ = ["MAX_ERROR_BYTES", "MAX_STEP_BYTES", "Cause", "Causes", "FailKind"]

MAX_STEP_BYTES: Final = 200
MAX_ERROR_BYTES: Final = 1000
"""Longer step names and error texts are cut (at a character boundary) when encoded."""
MAX_CAUSES: Final = 0xFFFF
"""Distinct causes one FAIL can carry (its index is u16)."""


class FailKind(enum.IntEnum):
    """The kind of a failure; the value is its u8 code on the wire."""

    EXPLICIT = 1
    ERROR = 2
    SINK = 3
    TIMEOUT = 4
    SOURCE_EXPIRED = 5

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def from_label(cls, label: str) -> FailKind:
        try:
            return cls[label.upper().replace("-", "_")]
        except KeyError:
            known = ", ".join(k.label for k in cls)
            raise ConfigError(f"unknown fail cause {label!r}; known: {known}") from None


@dataclass(frozen=True, slots=True)
class Cause:
    """One failure: its kind, the step (or sink) that failed it, and the error
    ("ExceptionType: message", or the sink's error). `final`: certain to repeat, so
    the record is dead-lettered now instead of retried. `final_if_repeated`: retried
    once, and final if the retry fails with the same exception type."""

    kind: FailKind = FailKind.EXPLICIT
    step: str = ""
    error: str = ""
    final: bool = False
    final_if_repeated: bool = False

    @property
    def error_type(self) -> str:
        """The exception type of an "ExceptionType: message" error ("" for none)."""
        head, sep, _ = self.error.partition(":")
        return head if sep else ""

    @classmethod
    def of_exception(
        cls, exc: BaseException, step: str, kind: FailKind | None = None, *, final: bool = False
    ) -> Cause:
        """The cause of `exc` raised in `step`: explicit for a FailException (judged by
        name, so this module needs no import of the errors), error otherwise."""
        if kind is None:
            explicit = any(c.__name__ == "FailException" for c in type(exc).__mro__)
            kind = FailKind.EXPLICIT if explicit else FailKind.ERROR
        return cls(kind, step, f"{type(exc).__qualname__}: {exc}", final)

    def describe(self) -> str:
        """One line: `kind[ (final)] in step: error`."""
        text = self.kind.label + (" (final)" if self.final else "")
        text += " (final if repeated)" if self.final_if_repeated else ""
        if self.step:
            text += f" in {self.step}"
        return f"{text}: {self.error}" if self.error else text

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.label, "step": self.step, "error": self.error}
        if self.final:
            out["final"] = True
        if self.final_if_repeated:
            out["final_if_repeated"] = True
        return out

    @classmethod
    def from_json(cls, data: Any) -> Cause:
        """Strict: CorruptData unless `data` is what to_json wrote."""
        if not isinstance(data, dict) or not {"kind", "step", "error"} <= set(data):
            raise CorruptData(f"a cause is an object with kind, step and error, got {data!r}")
        step, error, final = data["step"], data["error"], data.get("final", False)
        repeated = data.get("final_if_repeated", False)
        if not (isinstance(step, str) and isinstance(error, str)):
            raise CorruptData(f"bad cause {data!r}")
        if not (isinstance(final, bool) and isinstance(repeated, bool)):
            raise CorruptData(f"bad cause {data!r}")
        return cls(FailKind.from_label(str(data["kind"])), step, error, final, repeated)

    def clipped(self) -> Cause:
        """This cause with step and error cut to what the wire carries."""
        step, error = _clip(self.step, MAX_STEP_BYTES), _clip(self.error, MAX_ERROR_BYTES)
        if step == self.step and error == self.error:
            return self
        return Cause(self.kind, step, error, self.final, self.final_if_repeated)


UNSPECIFIED: Final = Cause()
"""The cause of a FAIL that names none: explicit, no step, no error."""


def _clip(text: str, limit: int) -> str:
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode("utf-8", errors="ignore") + "..."


@dataclass(frozen=True, slots=True)
class Causes:
    """A cause per failed root: `table[index[i]]` is the cause of root i."""

    table: tuple[Cause, ...]
    index: NDArray[np.uint16]

    def __post_init__(self) -> None:
        if len(self.table) > MAX_CAUSES:
            raise ConfigError(f"at most {MAX_CAUSES} distinct causes, got {len(self.table)}")
        if len(self.index) and int(self.index.max()) >= len(self.table):
            raise ConfigError(f"cause index {int(self.index.max())} beyond {len(self.table)}")

    @classmethod
    def one(cls, cause: Cause | None, n: int) -> Causes:
        return cls((cause or UNSPECIFIED,), np.zeros(n, dtype=np.uint16))

    @classmethod
    def concat(cls, parts: Sequence[Causes]) -> Causes:
        """The causes of several fails one after another, with one table."""
        if len(parts) == 1:
            return parts[0]
        codes: dict[Cause, int] = {}
        indexes = []
        for part in parts:
            remap = np.array([codes.setdefault(c, len(codes)) for c in part.table], dtype=np.uint16)
            indexes.append(remap[part.index] if len(part.index) else part.index)
        index = np.concatenate(indexes) if indexes else np.zeros(0, dtype=np.uint16)
        return cls(tuple(codes), index.astype(np.uint16, copy=False))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Cause:
        return self.table[int(self.index[i])]

    def take(self, rows: NDArray[Any]) -> Causes:
        return Causes(self.table, self.index[rows])

    def groups(self) -> list[tuple[Cause, NDArray[np.intp]]]:
        """(cause, the rows that have it) for every cause used."""
        if len(self.table) == 1:
            return [(self.table[0], np.arange(len(self.index), dtype=np.intp))] if len(self) else []
        return [
            (self.table[code], np.flatnonzero(self.index == code))
            for code in np.unique(self.index).tolist()
        ]

    def of_kind(self, kind: FailKind) -> NDArray[np.bool_]:
        """Per root: whether its cause is of `kind`."""
        codes = [code for code, cause in enumerate(self.table) if cause.kind is kind]
        if not codes:
            return np.zeros(len(self.index), dtype=np.bool_)
        return np.isin(self.index, np.array(codes, dtype=np.uint16))

    @property
    def unspecified(self) -> bool:
        """True if every root has the unspecified cause (FAIL can then omit them)."""
        return all(c == UNSPECIFIED for c in self.table)
