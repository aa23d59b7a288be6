"""The one registry from error class to status code (``kvd.wire.errors``):
each code has one class, a second class claiming a code fails at import
time, numbers and classes map back and forth, and the numbers are gRPC's."""

from __future__ import annotations

import gc
from pathlib import Path

import grpc
import pytest

from kvd.client.bulk import BulkUnavailable
from kvd.paths.shm.regions import AttachRefused
from kvd.wire import errors
from kvd.wire.errors import (
    BY_CODE_NAME,
    CODE_NAMES,
    CODE_NUMBERS,
    DeadlineExceeded,
    KvdError,
    NotFound,
    code_name,
    error_class,
    error_for,
    error_number,
)


def _subclasses(cls: type[KvdError]) -> list[type[KvdError]]:
    found: list[type[KvdError]] = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_every_error_class_has_a_code_and_no_two_share_one() -> None:
    owners: dict[str, type[KvdError]] = {}
    classes: list[type[KvdError]] = [KvdError, *_subclasses(KvdError)]
    for cls in classes:
        assert cls.code_name in CODE_NUMBERS, cls
        if "code_name" not in cls.__dict__:
            continue  # shares its parent's code, and its parent's registration
        assert cls.code_name not in owners, (cls, owners.get(cls.code_name))
        owners[cls.code_name] = cls
    assert owners == BY_CODE_NAME
    for shares in (AttachRefused, BulkUnavailable):  # a narrower class of a registered one
        assert shares not in BY_CODE_NAME.values()
        assert error_class(error_number(shares("x"))) in shares.__mro__


def test_a_second_class_for_a_code_is_a_type_error() -> None:
    before = dict(BY_CODE_NAME)
    with pytest.raises(TypeError, match="NotFound"):

        class AnotherNotFound(KvdError):
            code_name = "NOT_FOUND"

    with pytest.raises(TypeError, match="not a status code"):

        class Misspelled(KvdError):
            code_name = "NOT_FOUNDD"

    class Narrower(NotFound):  # no code of its own: NotFound's
        pass

    assert before == BY_CODE_NAME
    gc.collect()  # the refused classes were made before they were refused: let them go
    assert error_number(Narrower("x")) == CODE_NUMBERS["NOT_FOUND"]


def test_number_to_class_to_number() -> None:
    for name, cls in BY_CODE_NAME.items():
        number = CODE_NUMBERS[name]
        assert error_class(number) is cls
        assert error_number(cls("x")) == number
        raised = error_for(number, "why")
        assert type(raised) is cls and str(raised) == f"{name}: why"
    assert error_class(CODE_NUMBERS["INTERNAL"]) is KvdError  # a code no class has
    assert error_class(999) is KvdError and code_name(999) == "UNKNOWN"
    assert error_number(DeadlineExceeded("x")) == CODE_NUMBERS["DEADLINE_EXCEEDED"]


def test_the_numbers_are_grpc_status_codes() -> None:
    grpc_numbers = {code.name: int(code.value[0]) for code in grpc.StatusCode}
    assert grpc_numbers == CODE_NUMBERS
    assert {number: name for name, number in grpc_numbers.items()} == CODE_NAMES


def test_the_registry_needs_no_grpc() -> None:
    source = Path(errors.__file__).read_text()
    assert "import grpc" not in source and "from grpc" not in source
