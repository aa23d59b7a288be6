"""The same-node shared-memory path under attack: co-tenants and a full node.

A co-tenant here is another Unix user of the node, in the group the
daemon's sockets are shared with (``socket_group``), running real code as
its own uid (children started with ``user=``/``group=``). Each attack is
bounded in seconds, and each test then checks that the daemon is up, that
the other clients' calls succeed, and that no foreign bytes were readable:

- a tmpfs under ``shm_dir`` that fills up (SIGBUS in the daemon's copy);
- regions that shrink, grow or are truncated after they are attached, and
  file descriptors that are not sealed memfds;
- another tenant's regions named, guessed or raced for, by file name, by
  region id and token, over gRPC and over the shm socket;
- the shm socket unlinked and replaced by a listener that collects tokens;
- the group setup (``socket_group``) under umask 022 really sharing the path.

Tests that need other users or a mount skip when not run as root.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvd.client import Client
from kvd.paths.auth import hash_token
from kvd.v1 import kvd_pb2 as pb
from kvd.wire.errors import KvdError
from kvd.wire.grpc import KVStoreStub
from tests.support import REPO, DaemonFactory, DaemonProcess

pytestmark = pytest.mark.fault

NS = "attack"
# Ids no account on a test machine uses: a group shared with the daemon's
# sockets, and two tenants in it.
GROUP_ID = 64123
TENANT_A = 64124
TENANT_B = 64125
CHILD_TIMEOUT_S = 30

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: other users, mounts")


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A daemon working directory other users can reach (pytest's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-attack-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tokens(workdir: Path) -> dict[str, str]:
    """A token file with one token per tenant; their tokens by tenant."""
    tokens = {"a": secrets.token_urlsafe(32), "b": secrets.token_urlsafe(32)}
    lines = []
    for name, token in tokens.items():
        lines += [
            "[[tokens]]",
            f'name = "tenant-{name}"',
            f'sha256 = "{hash_token(token)}"',
            f'namespaces = ["{NS}-{name}"]',
        ]
    (workdir / "tokens.toml").write_text("\n".join(lines) + "\n")
    return tokens


def _group_daemon(factory: DaemonFactory, workdir: Path, *args: str) -> DaemonProcess:
    return factory(
        "--socket-group", str(GROUP_ID), "--region-check-ms", "50", *args, workdir=workdir
    )


# The interpreter lives under /root (0700 here): a child starts as root, loads
# what the scripts use, then drops to the tenant's uid before running them.
_PRELUDE = """
import os, sys, fcntl, mmap, secrets, socket, struct, time, threading
import grpc, numpy, xxhash
import kvd.paths.bulk.server, kvd.client.bulk, kvd.client.clients, kvd.wire.grpc
import kvd.paths.shm.channel, kvd.client.shm
import kvd.v1.kvd_pb2
os.setgroups([{gid}])
os.setgid({gid})
os.setuid({uid})
assert os.getuid() == {uid} and os.getgid() == {gid}
"""


def _command(uid: int, script: str) -> list[str]:
    prelude = _PRELUDE.format(uid=uid, gid=GROUP_ID)
    return [sys.executable, "-c", prelude + textwrap.dedent(script)]


def run_as(uid: int, script: str, timeout_s: float = CHILD_TIMEOUT_S) -> str:
    """Run ``script`` as ``uid`` in the shared group; its stdout (it must exit 0)."""
    done = subprocess.run(
        _command(uid, script),
        cwd=REPO,
        env={**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def start_as(uid: int, script: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _command(uid, script),
        cwd=REPO,
        env={**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def still_serving(daemon: DaemonProcess, token: str | None = None, ns: str = NS) -> None:
    """The daemon is up and a fresh client's put and get succeed on every path it offers."""
    assert daemon.alive(), "\n".join(daemon.log[-30:])
    value = os.urandom(100_000)
    key = secrets.token_bytes(8)
    with Client(daemon.socket_target, token=token, timeout_s=5) as client:
        client.put(ns, key, value)
        assert client.get(ns, key) == value
    with Client(daemon.socket_target, token=token, shm=False, timeout_s=5) as client:
        assert client.get(ns, key) == value


# ---- a full tmpfs ----------------------------------------------------------------------
@root_only
def test_a_full_tmpfs_under_shm_dir_does_not_kill_the_daemon(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """vLLM and NCCL fill /dev/shm: a get into a region whose pages the tmpfs
    can no longer back is an error or a hit for that client, never a SIGBUS
    that ends the daemon."""
    workdir = tmp_path / "full"
    shm = workdir / "shm"
    shm.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(shm)], check=True)
    try:
        daemon = daemon_factory("--max-value-bytes", "32MiB", workdir=workdir)
        value = os.urandom(6 << 20)
        with Client(daemon.socket_target, timeout_s=10) as client:
            assert client.put(NS, b"big", value) is False
            room = client.buffer(8 << 20)
            # What the other programs took:
            with open(shm / "filler", "wb") as filler, contextlib.suppress(OSError):
                while True:
                    filler.write(b"\0" * (1 << 20))
                    filler.flush()
            try:
                got = client.get_into(NS, b"big", room)
            except KvdError:
                got = None  # an error for this client is fine; the daemon must live
            if got is not None:
                assert got == len(value) and bytes(room[:got]) == value
            del room
        still_serving(daemon)
    finally:
        with contextlib.suppress(Exception):
            for started in list(DaemonProcess.started):
                if started.workdir == workdir:
                    started.stop()
        subprocess.run(["umount", "-l", str(shm)], check=False)


# ---- regions that change under the daemon --------------------------------------------
def _attach_by_name(stub: KVStoreStub, name: str, size: int) -> pb.AttachRegionResponse | None:
    """AttachRegion of a file by name; None when the daemon refuses it."""
    try:
        response: pb.AttachRegionResponse = stub.AttachRegion(
            pb.AttachRegionRequest(name=name, size=size)
        )
    except grpc.RpcError:
        return None
    return response


def test_a_region_truncated_while_copies_run_cannot_fault_the_daemon(
    daemon_factory: DaemonFactory,
) -> None:
    """A client shrinks its region file to nothing and back, as fast as it
    can, while 4 MiB gets land in it: the daemon never touches a page that
    is gone (the region's size cannot change once attached)."""
    daemon = daemon_factory()
    size = 8 << 20
    value = os.urandom(4 << 20)
    with Client(daemon.socket_target, shm=False) as plain:
        plain.put(NS, b"v", value)
    shm_dir = daemon.workdir / "shm"
    path = shm_dir / "shrinking"
    with grpc.insecure_channel(daemon.socket_target) as channel:
        stub = KVStoreStub(channel)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            fd = -1  # nobody may create files in the shm directory: nothing to attach by name
        if fd >= 0:
            os.ftruncate(fd, size)
            fcntl.flock(fd, fcntl.LOCK_SH)
            attached = _attach_by_name(stub, "shrinking", size)
            if attached is not None:
                stop = threading.Event()

                def shrink() -> None:
                    while not stop.is_set():
                        os.ftruncate(fd, 0)
                        os.ftruncate(fd, size)

                shrinker = threading.Thread(target=shrink)
                shrinker.start()
                try:
                    deadline = time.monotonic() + 3
                    request = pb.GetIntoRegionRequest(
                        region_id=attached.region_id,
                        token=attached.token,
                        namespace=NS,
                        items=[pb.RegionItem(key=b"v", offset=0, length=size)],
                    )
                    while time.monotonic() < deadline and daemon.alive():
                        with contextlib.suppress(grpc.RpcError):
                            stub.GetIntoRegion(request, timeout=5)
                finally:
                    stop.set()
                    shrinker.join()
            os.close(fd)
    still_serving(daemon)


# ---- another tenant's regions ----------------------------------------------------------
VICTIM = """
import fcntl, mmap, os, sys, time
from kvd.client import Client
secret = {secret!r}
shm_dir = {shm_dir!r}
with Client({target!r}, token={token!r}) as client:
    # The regions the client library makes, holding the secret...
    room = client.buffer(1 << 20)
    room[: len(secret)] = secret
    client.put({ns!r}, b"mine", room[: len(secret)])
    # ...and one by hand, as files in the shm directory were, kept there.
    try:
        fd = os.open(os.path.join(shm_dir, "kvd-victim"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 1 << 20)
        fcntl.flock(fd, fcntl.LOCK_SH)
        mapping = mmap.mmap(fd, 1 << 20)
        mapping[: len(secret)] = secret
        print("file", flush=True)
    except OSError as exc:
        print("no-file", exc.errno, flush=True)
    print("ready", flush=True)
    sys.stdin.readline()  # until the attacker is done
"""

ATTACKER = """
import os, secrets, socket, struct
import grpc
from kvd.client import Client
from kvd.wire.grpc import KVStoreStub
from kvd.wire.shm import REGION_REF
from kvd.paths.bulk.server import OP_HELLO, OP_REGION_GET, OP_REGION_PUT, encode_request, RESPONSE
from kvd.v1 import kvd_pb2 as pb
shm_dir, ns, token = {shm_dir!r}, {ns!r}, {token!r}
metadata = [("authorization", "Bearer " + token)] if token else None
found = []
with grpc.insecure_channel({target!r}) as channel:
    stub = KVStoreStub(channel)
    try:
        names = os.listdir(shm_dir)
    except OSError:
        names = []
    names = [n for n in names if n != "kvd.sock"] + ["kvd-victim"]
    for name in names:
        try:
            with open(os.path.join(shm_dir, name), "rb") as f:
                found.append(("opened", name))
        except OSError:
            pass
        try:
            got = stub.AttachRegion(pb.AttachRegionRequest(name=name, size=1 << 20),
                                    metadata=metadata, timeout=5)
        except grpc.RpcError:
            continue
        found.append(("attached", name))
        put = stub.PutFromRegion(pb.PutFromRegionRequest(
            region_id=got.region_id, token=got.token, namespace=ns,
            items=[pb.RegionItem(key=b"stolen-" + name.encode(), offset=0, length=64)]),
            metadata=metadata, timeout=5)
        if put.results and put.results[0].code == 0:
            with Client({target!r}, token=token or None, shm=False) as client:
                value = client.get(ns, b"stolen-" + name.encode())
            print("bytes", value.hex() if value else "", flush=True)
    # Guessing: small region ids with random tokens, over gRPC...
    for region_id in range(1, 33):
        request = pb.GetIntoRegionRequest(region_id=region_id, token=secrets.token_bytes(16),
            namespace=ns, items=[pb.RegionItem(key=b"x", offset=0, length=64)])
        try:
            stub.GetIntoRegion(request, metadata=metadata, timeout=5)
            found.append(("guessed", region_id))
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE), exc
print("found", found, flush=True)
"""


def _secret_seen(output: str, secret: bytes) -> bool:
    return secret.hex()[:32] in output


@root_only
def test_a_cotenant_cannot_attach_or_read_another_tenants_regions(
    daemon_factory: DaemonFactory, open_dir: Path
) -> None:
    """Tenant A names tenant B's region files (B's 0600 files, which A cannot
    open itself) and guesses region ids: the daemon opens nothing for A, and
    nothing of B's is ever readable by A."""
    shm = open_dir / "shm"
    shm.mkdir()
    os.chown(shm, 0, GROUP_ID)
    shm.chmod(0o770)  # the group setup the daemon was run with
    daemon = _group_daemon(daemon_factory, open_dir)
    secret = secrets.token_bytes(48)
    victim = start_as(
        TENANT_B,
        VICTIM.format(
            secret=secret, shm_dir=str(shm), target=daemon.socket_target, token=None, ns=NS
        ),
    )
    try:
        assert victim.stdout is not None and victim.stdin is not None
        lines = [victim.stdout.readline().strip() for _ in range(2)]
        assert lines[-1] == "ready", (lines, victim.stderr.read() if victim.stderr else "")
        out = run_as(
            TENANT_A,
            ATTACKER.format(shm_dir=str(shm), ns=NS, token="", target=daemon.socket_target),
        )
        assert not _secret_seen(out, secret), out
        assert "attached" not in out and "opened" not in out and "guessed" not in out, out
        victim.stdin.write("done\n")
        victim.stdin.flush()
        victim.wait(CHILD_TIMEOUT_S)
        assert victim.returncode == 0
    finally:
        victim.kill()
        victim.wait(CHILD_TIMEOUT_S)
        for stream in (victim.stdout, victim.stderr, victim.stdin):
            if stream is not None:
                stream.close()
    still_serving(daemon)


# ---- the shm socket --------------------------------------------------------------------
SQUATTER = """
import os, socket, sys, time
path = {path!r}
try:
    os.unlink(path)
except OSError as exc:
    print("unlink-refused", exc.errno, flush=True)
    if not {force!r}:
        sys.exit(0)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    listener.bind(path)
except OSError as exc:
    print("bind-refused", exc.errno, flush=True)
    sys.exit(0)
os.chmod(path, 0o777)
listener.listen(16)
listener.settimeout(1.0)
print("listening", flush=True)
got = b""
deadline = time.monotonic() + {listen_s!r}
while time.monotonic() < deadline:
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        continue
    conn.settimeout(1.0)
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except OSError:
        pass
    conn.close()
print("got", got.hex(), flush=True)
"""


def _squat(path: str, force: bool, listen_s: float = 4.0) -> subprocess.Popen[str]:
    squatter = start_as(TENANT_A, SQUATTER.format(path=path, force=force, listen_s=listen_s))
    assert squatter.stdout is not None
    return squatter


def _finish(squatter: subprocess.Popen[str]) -> str:
    out, err = squatter.communicate(timeout=CHILD_TIMEOUT_S)
    assert squatter.returncode == 0, err
    return out


@root_only
def test_a_cotenant_cannot_replace_the_shm_socket_to_collect_tokens(
    daemon_factory: DaemonFactory, open_dir: Path
) -> None:
    """Tenant A unlinks the shm socket and listens in its place: it cannot
    (the directory is the daemon's alone), and B's token never reaches it."""
    shm = open_dir / "shm"
    shm.mkdir()
    os.chown(shm, 0, GROUP_ID)
    shm.chmod(0o770)
    tokens = _tokens(open_dir)
    daemon = _group_daemon(
        daemon_factory, open_dir, "--auth-tokens-file", str(open_dir / "tokens.toml")
    )
    path = str(shm / "kvd.sock")
    squatter = _squat(path, force=False)
    assert squatter.stdout is not None
    first = squatter.stdout.readline().strip()
    if first == "listening":
        client = Client(daemon.socket_target, token=tokens["b"], timeout_s=2)
        with client, contextlib.suppress(KvdError):
            client.put(NS + "-b", b"k", b"v" * 1000)
    out = first + _finish(squatter)
    assert tokens["b"].encode().hex() not in out, "the token reached the squatter"
    assert "unlink-refused" in out
    still_serving(daemon, tokens["b"], NS + "-b")


@root_only
def test_a_client_sends_no_token_to_a_socket_the_daemon_does_not_hold(
    daemon_factory: DaemonFactory, open_dir: Path
) -> None:
    """Should another user ever hold the shm socket's path (a directory made
    writable by hand), the client sees the listener is not the daemon (its
    peer credentials differ from what the daemon reported over gRPC) before
    it sends a token, and keeps working over gRPC."""
    tokens = _tokens(open_dir)
    daemon = _group_daemon(
        daemon_factory, open_dir, "--auth-tokens-file", str(open_dir / "tokens.toml")
    )
    shm = open_dir / "shm"
    os.unlink(shm / "kvd.sock")
    shm.chmod(0o777)  # the operator's mistake
    squatter = _squat(str(shm / "kvd.sock"), force=True)
    assert squatter.stdout is not None
    first = squatter.stdout.readline().strip()  # the path is already free
    assert first.startswith("unlink-refused")
    assert squatter.stdout.readline().strip() == "listening"
    with Client(daemon.socket_target, token=tokens["b"], timeout_s=2) as client:
        client.put(NS + "-b", b"k", b"v" * 1000)
        assert client.get(NS + "-b", b"k") == b"v" * 1000
        assert "shm-socket" not in client.paths
    out = _finish(squatter)
    assert tokens["b"].encode().hex() not in out, "the token reached the squatter"
    assert daemon.alive()


@root_only
def test_the_group_setup_shares_the_shm_path_under_umask_022(
    daemon_factory: DaemonFactory, open_dir: Path
) -> None:
    """``socket_group`` names who may use the daemon: its members get the
    shared-memory path too, whatever the daemon's umask, and the shm
    directory is the daemon's alone (no one else may create or unlink there)."""
    old = os.umask(0o022)
    try:
        daemon = _group_daemon(daemon_factory, open_dir)
    finally:
        os.umask(old)
    shm = open_dir / "shm"
    info = shm.stat()
    assert info.st_uid == os.geteuid() and info.st_gid == GROUP_ID
    assert info.st_mode & 0o022 == 0 or info.st_mode & 0o1000, oct(info.st_mode)
    out = run_as(
        TENANT_B,
        f"""
        import os
        from kvd.client import Client
        with Client({daemon.socket_target!r}) as client:
            print(sorted(client.paths))
            value = os.urandom(1 << 20)
            room = client.buffer(1 << 20)
            room[:] = value
            client.put("{NS}", b"group", room)
            assert client.get("{NS}", b"group") == value
            try:
                os.unlink({str(shm / "kvd.sock")!r})
                print("unlinked")
            except OSError:
                print("kept")
        """,
    )
    assert "['shm', 'shm-socket']" in out and "kept" in out, out
    still_serving(daemon)


# ---- regions are bound to who attached them --------------------------------------------
BORROWER = """
import socket
from kvd.paths.bulk.server import OP_HELLO, OP_REGION_GET, REQUEST, RESPONSE, encode_request
from kvd.wire.shm import REGION_REF
path, token, region_id, region_token = {path!r}, {token!r}, {region_id!r}, {region_token!r}
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(5)
sock.connect(path)
hello = token.encode()
sock.sendall(encode_request(OP_HELLO, 0, length=len(hello)) + hello)
def answer():
    head = b""
    while len(head) < RESPONSE.size:
        head += sock.recv(RESPONSE.size - len(head))
    fields = RESPONSE.unpack(head)
    tail = b""
    while len(tail) < fields[6] + fields[7]:
        tail += sock.recv(fields[6] + fields[7] - len(tail))
    return fields[5], tail
assert answer()[0] == 0
frame = encode_request(OP_REGION_GET, 1, {ns!r}.encode(), b"secret", length=4096)
ref = REGION_REF.pack(region_id, 0, region_token)
sock.sendall(frame[: REQUEST.size] + ref + frame[REQUEST.size :])
print("code", answer()[0], flush=True)
"""


@root_only
def test_a_region_is_usable_only_by_the_credential_that_attached_it(
    daemon_factory: DaemonFactory, open_dir: Path
) -> None:
    """Even with a region's id and secret token in hand, another uid on the
    shm socket (with the same bearer token) and another token over gRPC get
    NOT_FOUND; the owner's calls work."""
    tokens = _tokens(open_dir)
    (open_dir / "tokens.toml").write_text(
        (open_dir / "tokens.toml").read_text().replace(f'["{NS}-a"]', f'["{NS}-a", "{NS}-b"]')
    )
    daemon = _group_daemon(
        daemon_factory, open_dir, "--auth-tokens-file", str(open_dir / "tokens.toml")
    )
    ns = NS + "-b"
    with Client(daemon.socket_target, token=tokens["b"]) as owner:
        room = owner.buffer(1 << 16)
        room[:6] = b"secret"
        owner.put(ns, b"secret", room[:6])
        shm = owner._shm  # the region's id and token, as if they had leaked
        assert shm is not None
        where = shm.locate(room)
        assert where is not None
        region = where[0]
        out = run_as(
            TENANT_A,
            BORROWER.format(
                path=str(open_dir / "shm" / "kvd.sock"),
                token=tokens["b"],
                region_id=region.region_id,
                region_token=region.token,
                ns=ns,
            ),
        )
        assert out.strip() == f"code {grpc.StatusCode.NOT_FOUND.value[0]}", out
        with grpc.insecure_channel(daemon.socket_target) as channel:
            stub = KVStoreStub(channel)
            request = pb.GetIntoRegionRequest(
                region_id=region.region_id,
                token=region.token,
                namespace=ns,
                items=[pb.RegionItem(key=b"secret", offset=4096, length=4096)],
            )
            with pytest.raises(grpc.RpcError) as other:  # token a reaches ns, not the region
                stub.GetIntoRegion(request, metadata=[("authorization", "Bearer " + tokens["a"])])
            assert other.value.code() == grpc.StatusCode.NOT_FOUND
            mine = stub.GetIntoRegion(
                request, metadata=[("authorization", "Bearer " + tokens["b"])]
            )
            assert mine.results[0].code == 0 and bytes(room[4096:4102]) == b"secret"
        del room
    still_serving(daemon, tokens["b"], ns)


# ---- descriptors that are not regions --------------------------------------------------
FAKE_REGIONS = """
import array, fcntl, os, socket
from kvd.paths.bulk.server import RESPONSE, encode_request
from kvd.wire.shm import OP_REGION_ATTACH
path = {path!r}
def attach(fds, size=1 << 20):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    frame = encode_request(OP_REGION_ATTACH, 0, length=size)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([frame], rights)
    head = b""
    try:
        while len(head) < RESPONSE.size:
            got = sock.recv(RESPONSE.size - len(head))
            if not got:
                return "closed"
            head += got
    finally:
        sock.close()
    return RESPONSE.unpack(head)[5]
def memfd(size=1 << 20, seals=0, flags=os.MFD_ALLOW_SEALING):
    fd = os.memfd_create("fake", flags)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    lock = os.open(f"/proc/self/fd/{{fd}}", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_SH)
    return fd
sealed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
r, w = os.pipe()
left, right = socket.socketpair()
cases = {{
    "none": [],
    "pipe": [r],
    "socket": [left.fileno()],
    "dev-zero": [os.open("/dev/zero", os.O_RDWR)],
    "directory": [os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)],
    "root-file-read-only": [os.open({readable!r}, os.O_RDONLY)],
    "unsealed": [memfd()],
    "shrinkable": [memfd(seals=fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)],
    "write-sealed": [memfd(seals=sealed | fcntl.F_SEAL_WRITE)],
    "wrong-size": [memfd(size=4096, seals=sealed)],
    "two": [memfd(seals=sealed), memfd(seals=sealed)],
}}
for name, fds in cases.items():
    print(name, attach(fds), flush=True)
for _ in range(200):  # a flood of refused attaches
    attach([memfd()])
print("flooded done", flush=True)
"""


@root_only
def test_descriptors_that_are_not_sealed_memfds_are_refused(
    daemon_factory: DaemonFactory, open_dir: Path
) -> None:
    """A co-tenant passes pipes, sockets, devices, a directory, a root-owned
    file it may only read, unsealed, shrinkable, write-sealed and mis-sized
    memfds, two at once, and floods refused attaches: each is refused, the
    read-only file stays unwritten, and the daemon keeps serving."""
    daemon = _group_daemon(daemon_factory, open_dir)
    readable = open_dir / "readable"
    readable.write_bytes(b"root's" + bytes(1 << 20))
    readable.chmod(0o644)
    out = run_as(
        TENANT_A,
        FAKE_REGIONS.format(path=str(open_dir / "shm" / "kvd.sock"), readable=str(readable)),
    )
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines.pop("flooded") == "done"
    for name, code in lines.items():
        assert code != "0", (name, out)
    assert readable.read_bytes().startswith(b"root's")
    with grpc.insecure_channel(daemon.socket_target) as channel:
        paths = KVStoreStub(channel).DescribePaths(pb.DescribePathsRequest())
        assert paths.regions_attached == 0
    still_serving(daemon)
