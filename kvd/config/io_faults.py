"""The ``io_faults`` spec: its grammar and parser, apart from the injector
(``kvd.io.faults``) and with the settings, so that checking the setting
loads no I/O backend.

Spec grammar (whitespace around tokens is ignored)::

    spec    = "" | rule { "," rule }
    rule    = op ":" fault { ":" param }
    op      = "read" | "write" | "fsync"
    fault   = "eio"        the op is not done; it fails with EIO
            | "enospc"     the op is not done; it fails with ENOSPC
            | "short"      read/write only: only the first half of the bytes
                           (rounded down to 4 KiB) move; the result says so
            | "misdirect"  read/write only: the op moves all its bytes at
                           offset + shift instead, and reports full success
    param   = "nth=" N          fire on the Nth op of this kind (1-based), once
            | "every=" N        fire on ops N, 2N, 3N, ... of this kind
            | "after_bytes=" S  read/write only: fire on every op that would
                                take the bytes moved by this kind past S
            | "shift=" S        misdirect only: bytes to move the op by
                                (a multiple of 4 KiB; default 64KiB)

Each rule has exactly one of nth / every / after_bytes. N is a positive
integer, S a size as ``kvd.config.sizes`` reads it (``512KiB``). Example::

    write:eio:nth=5,read:short:every=3,write:misdirect:nth=2,fsync:eio:nth=1

Every rule counts the ops of its kind on its own (an op is one entry of a
``submit_many`` batch, or one read/write/fsync call); when several rules
fire on the same op, the first one in the spec applies. ``after_bytes``
counts only bytes of ops that went through unharmed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.config.sizes import SizeError, parse_size

SPEC_CHARS_MAX = 4096
RULES_MAX = 64
BLOCK_BYTES = 4096  # O_DIRECT unit: shortened and shifted ops stay aligned
SHIFT_BYTES_DEFAULT = 64 * 1024  # one L2 record slot
N_MAX = 1 << 40

OPS = ("read", "write", "fsync")
_FAULTS = ("eio", "enospc", "short", "misdirect")
_TRIGGERS = ("nth", "every", "after_bytes")


class FaultSpecError(ValueError):
    """An ``io_faults`` spec that does not parse; the message says where."""


@dataclass(slots=True)
class Rule:
    op: str
    fault: str
    trigger: str
    value: int
    shift_bytes: int = SHIFT_BYTES_DEFAULT
    seen: int = 0  # ops of this kind so far
    moved_bytes: int = 0  # bytes of unharmed ops of this kind (after_bytes)
    fired: int = 0

    def fires(self, nbytes: int) -> bool:
        """Count one op of this rule's kind; whether the fault hits it."""
        self.seen += 1
        if self.trigger == "nth":
            return self.seen == self.value
        if self.trigger == "every":
            return self.seen % self.value == 0
        return self.moved_bytes + nbytes > self.value

    def __str__(self) -> str:
        text = f"{self.op}:{self.fault}:{self.trigger}={self.value}"
        return text + (f":shift={self.shift_bytes}" if self.fault == "misdirect" else "")


def _number(rule: str, name: str, text: str) -> int:
    try:
        value = parse_size(text) if name in ("after_bytes", "shift") else int(text, 10)
    except (ValueError, SizeError):
        raise FaultSpecError(f"io_faults rule {rule!r}: {name}={text!r} is not a number") from None
    if not 1 <= value <= N_MAX and not (name == "after_bytes" and value == 0):
        raise FaultSpecError(f"io_faults rule {rule!r}: {name} must be in 1..{N_MAX}")
    return value


def _parse_rule(text: str) -> Rule:
    parts = [part.strip() for part in text.split(":")]
    if len(parts) < 2:
        raise FaultSpecError(f"io_faults rule {text!r}: expected op:fault:trigger=N")
    op, fault, params = parts[0], parts[1], parts[2:]
    if op not in OPS:
        raise FaultSpecError(f"io_faults rule {text!r}: op must be one of {', '.join(OPS)}")
    if fault not in _FAULTS:
        raise FaultSpecError(f"io_faults rule {text!r}: fault must be one of {', '.join(_FAULTS)}")
    if op == "fsync" and fault in ("short", "misdirect"):
        raise FaultSpecError(f"io_faults rule {text!r}: fsync moves no bytes; use eio or enospc")
    values: dict[str, int] = {}
    for param in params:
        name, sep, value = param.partition("=")
        name = name.strip()
        if not sep or name not in (*_TRIGGERS, "shift"):
            raise FaultSpecError(
                f"io_faults rule {text!r}: {param!r} is not nth=N, every=N, after_bytes=SIZE "
                "or shift=SIZE"
            )
        if name in values:
            raise FaultSpecError(f"io_faults rule {text!r}: {name} given twice")
        values[name] = _number(text, name, value.strip())
    triggers = [name for name in _TRIGGERS if name in values]
    if len(triggers) != 1:
        raise FaultSpecError(
            f"io_faults rule {text!r}: needs exactly one of nth=, every=, after_bytes="
        )
    trigger = triggers[0]
    if trigger == "after_bytes" and op == "fsync":
        raise FaultSpecError(f"io_faults rule {text!r}: after_bytes counts read/write bytes")
    shift = values.get("shift", SHIFT_BYTES_DEFAULT)
    if "shift" in values and fault != "misdirect":
        raise FaultSpecError(f"io_faults rule {text!r}: shift= applies to misdirect only")
    if shift % BLOCK_BYTES:
        raise FaultSpecError(f"io_faults rule {text!r}: shift must be a multiple of 4 KiB")
    return Rule(op, fault, trigger, values[trigger], shift)


def parse(spec: str) -> list[Rule]:
    """The rules of a spec (empty for ""); FaultSpecError names the bad rule."""
    if len(spec) > SPEC_CHARS_MAX:
        raise FaultSpecError(f"io_faults is longer than {SPEC_CHARS_MAX} characters")
    if not spec.strip():
        return []
    texts = [text.strip() for text in spec.split(",")]
    if len(texts) > RULES_MAX:
        raise FaultSpecError(f"io_faults has more than {RULES_MAX} rules")
    if any(not text for text in texts):
        raise FaultSpecError("io_faults has an empty rule (two commas, or a trailing comma)")
    return [_parse_rule(text) for text in texts]
