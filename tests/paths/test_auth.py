"""Bearer-token auth: the token table, and a daemon that enforces it on every
RPC, the region calls and the bulk port, while health and reflection stay open."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvd.client import Client, PermissionDenied, Unauthenticated
from kvd.client.bulk import BulkClient
from kvd.config.loading import load_config
from kvd.config.settings import ConfigError
from kvd.paths.auth import (
    Authenticator,
    Principal,
    TokenTable,
    bearer_token,
    hash_token,
    new_token,
)
from kvd.paths.grpc.auth import request_scope
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.grpc import KVStoreStub
from tests.paths.support import TOKEN_A, TOKEN_ADMIN, TOKEN_LATER, token_file
from tests.sockets import scrape
from tests.support import DaemonProcess, wait_until

NS_A = "team-a/llama"
NS_B = "team-b/llama"


# ---- the table ------------------------------------------------------------------------
def test_patterns_match_exact_names_and_prefixes() -> None:
    p = Principal("a", admin=False, patterns=("team-a/*", "shared"))
    assert p.allows("team-a/x") and p.allows("team-a/") and p.allows("shared")
    assert not p.allows("team-b/x") and not p.allows("shared2") and not p.allows("team-a")
    assert Principal("root", admin=True).allows("anything")


def test_table_identifies_tokens_by_digest(tmp_path: Path) -> None:
    table = TokenTable.load(str(token_file(tmp_path / "t.toml")))
    a = table.identify(TOKEN_A)
    admin = table.identify(TOKEN_ADMIN)
    assert a is not None and a.name == "team-a" and not a.admin
    assert admin is not None and admin.admin
    assert table.identify("wrong") is None
    assert TOKEN_A not in (tmp_path / "t.toml").read_text()  # only digests are stored


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("admin = []\n", "unknown key"),
        ('admin_sha256 = ["abc"]\n', "64 hex digits"),
        ('[[tokens]]\nsha256 = "' + "0" * 64 + '"\n', "namespaces"),
        ('[[tokens]]\nsha256 = "' + "0" * 64 + '"\nnamespaces = ["a"]\nrole = "x"\n', "unknown"),
        ('admin_sha256 = ["' + "1" * 64 + '", "' + "1" * 64 + '"]\n', "twice"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_tables_are_refused_with_a_reason(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        TokenTable.load(str(path))
    assert caught.value.key == "auth_tokens_file"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        Authenticator(str(tmp_path / "absent.toml"))


def test_authenticator_checks_tokens_and_namespaces(tmp_path: Path) -> None:
    auth = Authenticator(str(token_file(tmp_path / "t.toml")))
    with pytest.raises(Unauthenticated):
        auth.check(None, NS_A)
    with pytest.raises(Unauthenticated):
        auth.check("x" * 5000, NS_A)
    with pytest.raises(PermissionDenied):
        auth.check(TOKEN_A, NS_B)
    with pytest.raises(PermissionDenied):
        auth.check(TOKEN_A, NS_A, admin=True)
    auth.check(TOKEN_A, NS_A)
    auth.check(TOKEN_A, None)  # calls without a namespace: any known token
    auth.check(TOKEN_ADMIN, NS_B, admin=True)
    assert auth.is_admin(TOKEN_ADMIN) and not auth.is_admin(TOKEN_A) and not auth.is_admin(None)


def test_a_failed_reload_keeps_the_old_table(tmp_path: Path) -> None:
    path = token_file(tmp_path / "t.toml")
    auth = Authenticator(str(path))
    path.write_text("broken [")
    with pytest.raises(ConfigError):
        auth.reload()
    auth.check(TOKEN_A, NS_A)


def test_bearer_metadata_and_request_scopes() -> None:
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("authorization", "bearer abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("x-other", "Bearer abc")]) is None and bearer_token(None) is None
    assert request_scope(pb.GetRequest(namespace="n")) == ("n", False)
    assert request_scope(pb.DeleteRequest(namespace="n", all_keys=True)) == ("n", True)
    assert request_scope(pb.StatsRequest()) == (None, True)
    assert request_scope(pb.StatsRequest(namespace="n")) == ("n", False)
    assert request_scope(pb.AttachRegionRequest(name="r")) == (None, False)


def test_new_tokens_are_long_and_distinct() -> None:
    tokens = {new_token() for _ in range(8)}
    assert len(tokens) == 8 and all(len(t) >= 40 for t in tokens)


def test_non_loopback_listen_needs_auth(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="without auth"):
        load_config(None, {}, {"listen": "0.0.0.0:7070"})
    config = load_config(
        None,
        {},
        {
            "listen": "0.0.0.0:7070",
            "bulk_listen": "0.0.0.0:7071",
            "auth_tokens_file": str(tmp_path / "t.toml"),
        },
    )
    assert config.listen == "0.0.0.0:7070" and config.bulk_listen == "0.0.0.0:7071"


# ---- a daemon with auth -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokens_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return token_file(tmp_path_factory.mktemp("auth") / "tokens.toml")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, tokens_path: Path) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(tmp_path_factory.mktemp("kvd"), ["--auth-tokens-file", str(tokens_path)])
    yield daemon
    daemon.discard()


@pytest.fixture(scope="module")
def stub(secured: DaemonProcess) -> Iterator[KVStoreStub]:
    with grpc.insecure_channel(secured.target) as channel:
        yield KVStoreStub(channel)


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def put_stream(ns: str) -> Iterator[pb.PutRequest]:
    yield pb.PutRequest(header=pb.PutHeader(namespace=ns, key=b"k", size=1))
    yield pb.PutRequest(data=b"x")


def calls(stub: KVStoreStub, ns: str) -> dict[str, Callable[[Any], Any]]:
    """Every KVStore RPC, called on ``ns`` with the given metadata."""
    region = {"region_id": 1, "token": b"t" * 16, "namespace": ns}
    return {
        "Put": lambda md: stub.Put(put_stream(ns), metadata=md, timeout=5),
        "Get": lambda md: list(stub.Get(pb.GetRequest(namespace=ns, key=b"k"), metadata=md)),
        "BatchPut": lambda md: stub.BatchPut(
            pb.BatchPutRequest(namespace=ns, items=[pb.PutItem(key=b"k", value=b"x")]),
            metadata=md,
        ),
        "BatchGet": lambda md: stub.BatchGet(
            pb.BatchGetRequest(namespace=ns, keys=[b"k"]), metadata=md
        ),
        "Exists": lambda md: stub.Exists(pb.ExistsRequest(namespace=ns, keys=[b"k"]), metadata=md),
        "Lookup": lambda md: stub.Lookup(pb.LookupRequest(namespace=ns, keys=[b"k"]), metadata=md),
        "Release": lambda md: stub.Release(
            pb.ReleaseRequest(namespace=ns, lease_id=1), metadata=md
        ),
        "Delete": lambda md: stub.Delete(pb.DeleteRequest(namespace=ns, keys=[b"k"]), metadata=md),
        "Stats": lambda md: stub.Stats(pb.StatsRequest(namespace=ns), metadata=md),
        "AttachRegion": lambda md: stub.AttachRegion(
            pb.AttachRegionRequest(name="nope", size=65536), metadata=md
        ),
        "DetachRegion": lambda md: stub.DetachRegion(
            pb.DetachRegionRequest(region_id=1, token=b"t" * 16), metadata=md
        ),
        "PutFromRegion": lambda md: stub.PutFromRegion(
            pb.PutFromRegionRequest(**region), metadata=md
        ),
        "GetIntoRegion": lambda md: stub.GetIntoRegion(
            pb.GetIntoRegionRequest(**region), metadata=md
        ),
        "DescribePaths": lambda md: stub.DescribePaths(pb.DescribePathsRequest(), metadata=md),
    }


def code_of(call: Callable[[Any], Any], metadata: Any) -> grpc.StatusCode:
    try:
        call(metadata)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_every_rpc_needs_a_token(stub: KVStoreStub) -> None:
    every = calls(stub, NS_A)
    assert set(every) == set(pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name)
    for name, call in every.items():
        assert code_of(call, None) == grpc.StatusCode.UNAUTHENTICATED, name
        assert code_of(call, bearer("not-a-token")) == grpc.StatusCode.UNAUTHENTICATED, name


NAMESPACED_RPCS = ["Get", "Lookup", "Exists", "Delete", "Stats", "Put", "BatchPut", "BatchGet",
                   "Release", "PutFromRegion", "GetIntoRegion"]  # fmt: skip


@pytest.mark.parametrize("rpc", NAMESPACED_RPCS)
def test_a_token_reaches_only_its_namespaces(stub: KVStoreStub, rpc: str) -> None:
    assert code_of(calls(stub, NS_B)[rpc], bearer(TOKEN_A)) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(calls(stub, NS_A)[rpc], bearer(TOKEN_A)) != grpc.StatusCode.PERMISSION_DENIED
    assert code_of(calls(stub, NS_B)[rpc], bearer(TOKEN_ADMIN)) != grpc.StatusCode.PERMISSION_DENIED


def test_admin_calls_need_the_admin_token(stub: KVStoreStub) -> None:
    delete_all = pb.DeleteRequest(namespace=NS_A, all_keys=True)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Delete(delete_all, metadata=bearer(TOKEN_A))
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as caught:
        stub.Stats(pb.StatsRequest(), metadata=bearer(TOKEN_A))
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stub.Delete(delete_all, metadata=bearer(TOKEN_ADMIN))
    whole = stub.Stats(pb.StatsRequest(), metadata=bearer(TOKEN_ADMIN))
    assert "pool_bytes" in whole.values
    # A tenant's own Stats shows its namespace, not the daemon-wide numbers.
    own = stub.Stats(pb.StatsRequest(namespace=NS_A), metadata=bearer(TOKEN_A))
    assert not own.values and all(ns.name == NS_A for ns in own.namespaces)


def test_health_and_reflection_stay_open(secured: DaemonProcess) -> None:
    with grpc.insecure_channel(secured.target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(reflect.ServerReflectionInfo(iter([ask])))
    names = {s.name for s in replies[0].list_services_response.service}
    assert "kvd.v1.KVStore" in names


def test_bulk_port_needs_a_token(secured: DaemonProcess) -> None:
    for token in (None, "not-a-token"):
        bulk = BulkClient("127.0.0.1", secured.bulk_port, token=token, connections=1)
        with bulk, pytest.raises(Unauthenticated):
            bulk.put(NS_A, b"k", memoryview(b"x" * 100))
    with BulkClient("127.0.0.1", secured.bulk_port, token=TOKEN_A, connections=1) as bulk:
        with pytest.raises(PermissionDenied):
            bulk.put(NS_B, b"k", memoryview(b"x" * 100))
        with pytest.raises(PermissionDenied):
            bulk.get(NS_B, b"k")
        # The refusals answered a code; the connection still serves its own namespace.
        bulk.put(NS_A, b"bulk-key", memoryview(b"y" * 100))
        assert bulk.get(NS_A, b"bulk-key") == b"y" * 100


def test_client_with_a_token_uses_every_path(secured: DaemonProcess) -> None:
    big = os.urandom(256 << 10)  # over the bulk threshold
    with Client(secured.target, token=TOKEN_A) as client:
        client.put(NS_A, b"small", b"abc")
        client.put(NS_A, b"big", big)
        assert client.get(NS_A, b"small") == b"abc"
        assert client.get(NS_A, b"big") == big
        with pytest.raises(PermissionDenied):
            client.put(NS_B, b"small", b"abc")
    with Client(secured.socket_target, token=TOKEN_A) as client:  # the shm path
        client.put(NS_A, b"via-shm", big)
        assert client.get(NS_A, b"via-shm") == big
    with Client(secured.target) as client, pytest.raises(Unauthenticated):
        client.get(NS_A, b"small")


def test_refusals_are_counted_and_logged_by_reason(secured: DaemonProcess) -> None:
    text = scrape(secured.metrics_port)
    assert 'kvd_rejected_requests_total{reason="unauthenticated"}' in text
    assert 'kvd_rejected_requests_total{reason="permission_denied"}' in text
    refused = [line for line in secured.log if "request refused" in line]
    assert refused and all("level=warning" in line and "reason=" in line for line in refused)
    # Dozens of refusals above, at most one line per reason per second.
    assert len(refused) < 20


def test_sighup_reloads_the_token_table(secured: DaemonProcess, tokens_path: Path) -> None:
    extra = f'[[tokens]]\nsha256 = "{hash_token(TOKEN_LATER)}"\nnamespaces = ["{NS_B}"]\n'
    token_file(tokens_path, extra=extra)
    with Client(secured.target, token=TOKEN_LATER) as client:
        with pytest.raises(Unauthenticated):
            client.exists(NS_B, [b"never-stored"])
        secured.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: any("kvd reloaded" in line for line in secured.log))
        assert client.exists(NS_B, [b"never-stored"]) == [False]
    # A broken table keeps the one in force.
    tokens_path.write_text("broken [")
    secured.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: any("reload failed" in line for line in secured.log))
    with Client(secured.target, token=TOKEN_LATER) as client:
        assert client.exists(NS_B, [b"never-stored"]) == [False]
