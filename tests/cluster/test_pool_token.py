"""Peers authenticate with the pool token: each member's auth_tokens_file
admits it to every namespace, and a member sending a wrong one is refused by
its peers, which costs it misses (and a log line), never errors."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvd.client import Client
from kvd.cluster.rendezvous import Placement
from tests.cluster.cluster import free_ports
from tests.sockets import metric
from tests.support import DaemonProcess, wait_until

pytestmark = pytest.mark.timeout(120)

ENGINE_TOKEN = "engine-token-team-a"
POOL_TOKEN = "pool-token-of-this-fleet"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_wrong_pool_token_is_refused_and_costs_misses(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "team-a"\nsha256 = "{sha(ENGINE_TOKEN)}"\nnamespaces = ["team-a/*"]\n'
        f'[[tokens]]\nname = "pool"\nsha256 = "{sha(POOL_TOKEN)}"\nnamespaces = ["*"]\n'
    )
    (tmp_path / "right").write_text(POOL_TOKEN + "\n")
    (tmp_path / "wrong").write_text("not-the-pool-token\n")
    ports = free_ports(2)
    members = "static:" + ",".join(f"127.0.0.1:{port}" for port in ports)
    daemons = []
    for port, token_file in zip(ports, ("right", "wrong"), strict=True):
        where = tmp_path / f"daemon-{token_file}"
        where.mkdir(parents=True)
        args = [
            "--listen", f"127.0.0.1:{port}", "--pool-members", members,
            "--auth-tokens-file", str(tokens), "--pool-token-file", str(tmp_path / token_file),
        ]  # fmt: skip
        daemons.append(DaemonProcess(where, args, ssd=""))
    good, bad = daemons
    a = Client(good.target, token=ENGINE_TOKEN, timeout_s=5)
    b = Client(bad.target, token=ENGINE_TOKEN, timeout_s=5)
    try:
        ns = "team-a/model"
        keys = [b"tok-%03d" % i for i in range(40)]
        for key in keys:
            a.put(ns, key, key * 50)
        owners = Placement([good.target, bad.target]).owners(ns, keys)
        on_good = [k for k, o in zip(keys, owners, strict=True) if o == good.target]
        on_bad = [k for k, o in zip(keys, owners, strict=True) if o == bad.target]
        assert on_good and on_bad
        # good's token is right: its puts reach bad, and it reads bad's keys.
        forwards = "kvd_cluster_forwards_total"
        assert wait_until(lambda: metric(good.metrics_port, forwards) == len(on_bad))
        assert all(b.get(ns, k) == k * 50 for k in on_bad)
        # bad's token is wrong: good refuses it, so good's keys are misses through bad.
        assert [b.get(ns, k) for k in on_good] == [None] * len(on_good)
        assert metric(bad.metrics_port, "kvd_cluster_peer_errors_total") >= 1
        assert any("UNAUTHENTICATED" in line for line in bad.log)
    finally:
        a.close()
        b.close()
        for daemon in daemons:
            daemon.discard()
