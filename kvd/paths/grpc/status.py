"""The gRPC face of the error registry (``kvd.wire.errors``): a typed error's
number as a ``grpc.StatusCode``, for ``context.abort``. The numbers are the
registry's; grpcio only names them."""

from __future__ import annotations

import grpc

from kvd.wire.errors import KvdError, error_number

_STATUS_BY_NUMBER = {int(code.value[0]): code for code in grpc.StatusCode}


def status_code(error: KvdError) -> grpc.StatusCode:
    return _STATUS_BY_NUMBER[error_number(error)]
