"""The pool_members grammar and the checks a member list passes."""

from __future__ import annotations

import logging

import pytest

from kvd.cluster.membership import Membership, parse_member
from kvd.config.loading import load_config
from kvd.config.pool_members import parse_spec
from kvd.config.settings import ConfigError


def test_static_spec() -> None:
    spec = parse_spec("static:127.0.0.1:7070, 10.0.0.2:7070,[::1]:7070")
    assert spec is not None and spec.kind == "static"
    assert spec.members == ("127.0.0.1:7070", "10.0.0.2:7070", "[::1]:7070")


def test_etcd_spec() -> None:
    spec = parse_spec("etcd://10.0.0.1:2379,10.0.0.2:2379/kvd/l1/pool-a/")
    assert spec is not None and spec.kind == "etcd"
    assert spec.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379))
    assert spec.prefix == "/kvd/l1/pool-a"


def test_empty_spec_is_a_single_node() -> None:
    assert parse_spec("") is None
    assert load_config(env={}).pool_members == ""


@pytest.mark.parametrize(
    "text",
    ["static:", "static:host", "static:1.2.3.4:0", "etcd://1.2.3.4:2379", "etcd:///p",
     "zookeeper://x:1/p", "static:1.2.3.4:99999"],
)  # fmt: skip
def test_bad_specs_are_refused_by_the_config(text: str) -> None:
    with pytest.raises(ConfigError, match="pool_members"):
        load_config(overrides={"pool_members": text})


POOL = {"pool_members": "static:127.0.0.1:7070"}
ETCD = {"pool_members": "etcd://127.0.0.1:2379/kvd"}
TLS = {"tls_cert_file": "c.pem", "tls_key_file": "k.pem"}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({**POOL, **TLS}, "pool_tls_ca_file"),  # TLS listeners: the peers need the CA
        ({**POOL, "pool_tls_ca_file": "ca.pem"}, "pool_tls_ca_file"),  # and a certificate
        ({"pool_tls_ca_file": "ca.pem", **TLS}, "pool_tls_ca_file"),  # no pool
        ({**POOL, **TLS, "pool_tls_server_name": "kvd"}, "pool_tls_server_name"),
        ({**POOL, **TLS, "pool_tls_ca_file": "ca.pem", "pool_peer_transport": "nixl"},
         "pool_peer_transport"),  # values in clear
        ({**POOL, "bulk_tls": True}, "bulk_tls"),  # no certificate for the bulk port
        ({**ETCD, "pool_etcd_cert_file": "c.crt"}, "pool_etcd_cert_file"),  # no key
        ({**ETCD, "pool_etcd_cert_file": "c.crt", "pool_etcd_key_file": "c.key"},
         "pool_etcd_ca_file"),  # a client certificate, no TLS
        ({**POOL, "pool_etcd_ca_file": "ca.crt"}, "pool_etcd_ca_file"),  # not an etcd pool
    ],
)  # fmt: skip
def test_pool_tls_settings_that_cannot_work_are_refused(
    overrides: dict[str, str], key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(overrides=overrides)


def test_pool_tls_settings_that_work_are_taken() -> None:
    config = load_config(overrides={**POOL, **TLS, "pool_tls_ca_file": "ca.pem"})
    assert config.pool_tls_ca_file == "ca.pem"
    # Values over the bulk ports, with TLS where a member's takes it (bulk_tls).
    bulk = {**POOL, **TLS, "pool_tls_ca_file": "ca.pem", "pool_peer_transport": "bulk"}
    assert load_config(overrides={**bulk, "bulk_tls": True}).bulk_tls


def test_pool_with_auth_needs_a_pool_token() -> None:
    with pytest.raises(ConfigError, match="pool_token_file"):
        load_config(
            overrides={"pool_members": "static:127.0.0.1:7070", "auth_tokens_file": "t.toml"}
        )


def test_list_naming_this_daemon_twice_counts_it_once(caplog: pytest.LogCaptureFixture) -> None:
    membership = Membership("127.0.0.1:7070")
    with caplog.at_level(logging.WARNING, "kvd.cluster"):
        assert membership.update(["127.0.0.1:7070", "127.0.0.1:7071", "127.0.0.1:7070"], "t")
    assert membership.members == ("127.0.0.1:7070", "127.0.0.1:7071")
    assert "more than once" in caplog.text


def test_list_without_this_daemon_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    membership = Membership("127.0.0.1:7070")
    membership.update(["127.0.0.1:7070", "127.0.0.1:7071"], "t")
    with caplog.at_level(logging.ERROR, "kvd.cluster"):
        assert not membership.update(["127.0.0.1:7071", "127.0.0.1:7072"], "t")
        assert not membership.update(["127.0.0.1:7071", "127.0.0.1:7072"], "t")
    assert membership.members == ("127.0.0.1:7070", "127.0.0.1:7071")  # the previous list
    assert membership.refused == 2
    assert caplog.text.count("does not name this daemon") == 1  # one line per bad list


def test_garbage_member_values() -> None:
    assert parse_member(b"10.0.0.1:7070") == "10.0.0.1:7070"
    for garbage in (b"", b"\xff\xfe", b"not an address", b"host:port", b"1.2.3.4:70000"):
        assert parse_member(garbage) is None
