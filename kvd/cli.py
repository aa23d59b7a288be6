"""The ``kvd`` command: ``serve`` runs the daemon, the others talk to one.

``kvd serve`` takes one flag per setting of the table in ``kvd.config.settings``
(``--dram-bytes 4GiB``, ``--ssd-path P`` repeated, ...), plus ``--config
FILE``. ``put``/``get``/``lookup``/``stats`` are for people poking at a
running daemon; programs use ``kvd.client``.

Exit status: 0 done; 1 a miss (``get``) or the daemon failed; 2 bad usage or
configuration; 3 the daemon could not be reached or refused the call.
"""

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvd import __version__
from kvd.config.loading import config_from_environment
from kvd.config.settings import SETTINGS, ConfigError, Setting
from kvd.wire.limits import KEY_BYTES_MAX

if TYPE_CHECKING:
    from kvd.client import Client

EXIT_OK = 0
EXIT_MISS = 1
EXIT_USAGE = 2
EXIT_DAEMON = 3

DEFAULT_TARGET = "127.0.0.1:7070"
DEFAULT_TIMEOUT_S = 5.0
TIMEOUT_S_MAX = 3600.0
# `kvd put` reads the whole value into memory first; beyond 1 GiB use the
# client library, which streams.
PUT_VALUE_MAX_BYTES = 1 << 30

# Subcommands that live in their own module and appear once it exists:
# name -> (module whose main(args: list[str]) -> int runs it, help).
_PLUGIN_COMMANDS = {
    "bench": ("kvd.tools.bench", "measure kvd against the hardware and peers"),
    "fsck": ("kvd.tools.fsck", "verify the L2 data files"),
    "demo": ("kvd.tools.demo", "TTFT with a real model: recompute vs restore from L1 and L2"),
}


class UsageError(Exception):
    """Bad command-line input the parser could not catch."""


def parse_key(text: str) -> bytes:
    """A key as given on the command line: UTF-8 text, or ``hex:`` then hex digits."""
    if text.startswith("hex:"):
        try:
            key = bytes.fromhex(text[4:])
        except ValueError:
            raise UsageError(f"bad hex key {text!r}") from None
    else:
        key = text.encode()
    if not 1 <= len(key) <= KEY_BYTES_MAX:
        raise UsageError(f"a key is 1..{KEY_BYTES_MAX} bytes, {text!r} is {len(key)}")
    return key


def _metavar(setting: Setting) -> str:
    if setting.choices is not None:
        return "{" + "|".join(setting.choices) + "}"
    if setting.kind == "size":
        return "SIZE"
    if setting.kind in ("int", "float"):
        return "N"
    if setting.name.endswith("listen"):
        return "HOST:PORT"
    return "PATH" if "path" in setting.name or setting.name.endswith(("socket", "dir")) else "TEXT"


def _add_setting_flag(parser: argparse.ArgumentParser, setting: Setting) -> None:
    shown = setting.show(setting.default)
    default = '""' if shown == "" else shown
    bounds = setting.bounds() if setting.choices is None else ""
    help_text = f"{setting.help} [default {default}{'; ' + bounds if bounds else ''}]"
    help_text = help_text.replace("%", "%%")  # argparse formats help with %
    action = "append" if setting.kind == "list" else "store"
    parser.add_argument(
        setting.flag, dest=setting.name, action=action, metavar=_metavar(setting), help=help_text
    )


def _add_no_ssd(parser: argparse.ArgumentParser) -> None:
    # A flag cannot spell an empty list (``--ssd-path ''`` is an empty path,
    # refused), so this one does what ``ssd_path = []`` does in a file.
    parser.add_argument(
        "--no-ssd",
        action="store_true",
        help="no L2: ssd_path is the empty list (not with --ssd-path)",
    )


def _add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default=os.environ.get("KVD_TARGET", DEFAULT_TARGET),
        help=f"daemon address HOST:PORT or unix:///PATH [default $KVD_TARGET or {DEFAULT_TARGET}]",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="deadline of each call"
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("KVD_TOKEN") or None,
        help="bearer token, when the daemon has auth_tokens_file [default $KVD_TOKEN]",
    )


def _add_namespace(parser: argparse.ArgumentParser, keys: str) -> None:
    parser.add_argument(
        "-n", "--namespace", help="namespace; without it the first argument is the namespace"
    )
    parser.add_argument("args", nargs="+", metavar="[NS] KEY", help=keys)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvd", description="kvd: a per-node KV-cache storage daemon for LLM inference"
    )
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon. Settings come from defaults < --config FILE < "
        "KVD_<NAME> environment variables < these flags.",
    )
    serve.add_argument("--config", metavar="FILE", help="TOML file [default $KVD_CONFIG]")
    for setting in SETTINGS:
        _add_setting_flag(serve, setting)
    _add_no_ssd(serve)

    config = commands.add_parser(
        "config",
        help="print the settings serve would use, as TOML",
        description="Print the effective settings (same inputs as serve) as a TOML file.",
    )
    config.add_argument("--config", metavar="FILE", help="TOML file [default $KVD_CONFIG]")
    for setting in SETTINGS:
        _add_setting_flag(config, setting)
    _add_no_ssd(config)

    commands.add_parser("version", help="print the version")

    health = commands.add_parser(
        "health", help="exit 0 if the daemon answers SERVING to a gRPC health check"
    )
    health.add_argument(
        "--target",
        default=os.environ.get("KVD_TARGET", DEFAULT_TARGET),
        help=f"daemon address HOST:PORT or unix:///PATH [default $KVD_TARGET or {DEFAULT_TARGET}]",
    )
    health.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    commands.add_parser(
        "token", help="print a new random bearer token and the sha256 line for the token file"
    )

    stats = commands.add_parser("stats", help="print the daemon's counters as JSON")
    _add_client_options(stats)
    stats.add_argument("-n", "--namespace", default="", help="only this namespace")

    put = commands.add_parser("put", help="store a value read from --file or stdin")
    _add_client_options(put)
    _add_namespace(put, "key: text, or hex:0a1b...")
    put.add_argument("--file", default="-", help="value file; - is stdin [default -]")
    put.add_argument("--parent", help="key of the previous chunk of the same chain")

    get = commands.add_parser("get", help="write a value to stdout or --out; exit 1 on a miss")
    _add_client_options(get)
    _add_namespace(get, "key: text, or hex:0a1b...")
    get.add_argument("--out", default="-", help="output file; - is stdout [default -]")

    lookup = commands.add_parser("lookup", help="print how many leading keys are stored")
    _add_client_options(lookup)
    _add_namespace(lookup, "keys of one chain, in order")
    lookup.add_argument("--lease-ms", type=int, default=0, help="protect the hits this long")

    for name, (_, help_text) in _PLUGIN_COMMANDS.items():
        if _plugin_installed(name):
            commands.add_parser(name, help=help_text, add_help=False)  # main() runs it
    return parser


def _settings_given(args: argparse.Namespace) -> dict[str, object]:
    given: dict[str, object] = {setting.name: getattr(args, setting.name) for setting in SETTINGS}
    if args.no_ssd:
        if given["ssd_path"] is not None:
            raise UsageError("--no-ssd and --ssd-path conflict: give one or the other")
        given["ssd_path"] = []
    return given


def _serve(args: argparse.Namespace) -> int:
    given = _settings_given(args)
    config = config_from_environment(args.config, given)
    from kvd.daemon.server import run  # the server pulls in grpc; other commands need not

    try:
        # SIGHUP reads the same inputs again: the file may have changed.
        code = run(config, lambda: config_from_environment(args.config, given))
    except OSError as error:
        print(f"kvd: {error}", file=sys.stderr)
        return 1
    # A daemon that read its peers over NIXL ends here, its shutdown done:
    # UCX's teardown at interpreter exit crashed (kvd.cluster.nixl_node).
    nixl = sys.modules.get("kvd.cluster.nixl_node")
    if nixl is not None:
        nixl.exit_past_ucx(code)
    return code


def _config(args: argparse.Namespace) -> int:
    config = config_from_environment(args.config, _settings_given(args))
    sys.stdout.write(config.to_toml())
    return EXIT_OK


def _split_namespace(args: argparse.Namespace, keys_exact: int | None) -> tuple[str, list[bytes]]:
    """NS and keys from ``-n NS KEY...`` or ``NS KEY...``."""
    words: list[str] = list(args.args)
    namespace = args.namespace
    if namespace is None:
        if len(words) < 2:
            raise UsageError("give the namespace first (or with -n), then the key")
        namespace = words.pop(0)
    if keys_exact is not None and len(words) != keys_exact:
        raise UsageError(f"expected {keys_exact} key(s), got {len(words)}: {' '.join(words)}")
    return namespace, [parse_key(word) for word in words]


def _talk(args: argparse.Namespace, action: "Callable[[Client], int]") -> int:
    """Run ``action`` with a client of ``--target``; daemon errors exit 3."""
    from kvd.client import Client, KvdError

    if not 0 < args.timeout_s <= TIMEOUT_S_MAX:
        raise UsageError(f"--timeout-s must be in (0, {TIMEOUT_S_MAX}]")
    try:
        with Client(args.target, token=args.token, timeout_s=args.timeout_s) as client:
            return action(client)
    except KvdError as error:
        print(f"kvd: {args.target}: {error}", file=sys.stderr)
        return EXIT_DAEMON


def _read_value(path: str) -> bytes:
    if path == "-":
        data = sys.stdin.buffer.read(PUT_VALUE_MAX_BYTES + 1)
    else:
        with open(path, "rb") as stream:
            data = stream.read(PUT_VALUE_MAX_BYTES + 1)
    if len(data) > PUT_VALUE_MAX_BYTES:
        raise UsageError(f"value larger than {PUT_VALUE_MAX_BYTES} bytes; use kvd.client")
    return data


def _put(args: argparse.Namespace) -> int:
    namespace, (key,) = _split_namespace(args, 1)
    parent = parse_key(args.parent) if args.parent else None
    value = _read_value(args.file)

    def put(client: "Client") -> int:
        existed = client.put(namespace, key, value, parent=parent)
        print("exists" if existed else f"stored {len(value)} bytes")
        return EXIT_OK

    return _talk(args, put)


def _get(args: argparse.Namespace) -> int:
    namespace, (key,) = _split_namespace(args, 1)

    def get(client: "Client") -> int:
        value = client.get(namespace, key)
        if value is None:
            print("kvd: miss", file=sys.stderr)
            return EXIT_MISS
        if args.out == "-":
            sys.stdout.buffer.write(value)
            sys.stdout.buffer.flush()
        else:
            with open(args.out, "wb") as out:
                out.write(value)
        return EXIT_OK

    return _talk(args, get)


def _lookup(args: argparse.Namespace) -> int:
    namespace, keys = _split_namespace(args, None)
    if not keys:
        raise UsageError("give at least one key")
    if args.lease_ms < 0:
        raise UsageError("--lease-ms must not be negative")

    def lookup(client: "Client") -> int:
        print(client.lookup(namespace, keys, lease_ms=args.lease_ms))
        return EXIT_OK

    return _talk(args, lookup)


def _stats(args: argparse.Namespace) -> int:
    def stats(client: "Client") -> int:
        print(json.dumps(client.stats(args.namespace), indent=2, sort_keys=True, default=str))
        return EXIT_OK

    return _talk(args, stats)


def _plugin_installed(name: str) -> bool:
    module = _PLUGIN_COMMANDS.get(name)
    return module is not None and importlib.util.find_spec(module[0]) is not None


def _plugin(name: str, argv: list[str]) -> int:
    module = importlib.import_module(_PLUGIN_COMMANDS[name][0])
    status: Any = module.main(argv)
    return int(status or 0)


def _health(args: argparse.Namespace) -> int:
    """The standard grpc.health.v1 check (open even with auth), for probes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = args.target.removeprefix("kvd://")
    with grpc.insecure_channel(target) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=args.timeout_s
            )
        except grpc.RpcError as error:
            print(f"kvd: {args.target}: {error.code().name}", file=sys.stderr)
            return EXIT_DAEMON
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_DAEMON


def _token(args: argparse.Namespace) -> int:
    from kvd.paths.auth import hash_token, new_token

    token = new_token()
    print(f"token: {token}")
    print(f'sha256 = "{hash_token(token)}"')
    return EXIT_OK


_COMMANDS = {
    "health": _health,
    "token": _token,
    "serve": _serve,
    "config": _config,
    "put": _put,
    "get": _get,
    "lookup": _lookup,
    "stats": _stats,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvd`` command; returns the exit status."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        # A plugin parses its own arguments, --help included.
        if words and _plugin_installed(words[0]):
            return _plugin(words[0], words[1:])
        args = build_parser().parse_args(words)
        if args.command == "version":
            print(f"kvd {__version__}")
            return EXIT_OK
        return _COMMANDS[args.command](args)
    except ConfigError as error:
        print(f"kvd: config: {error}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as error:
        print(f"kvd: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except OSError as error:  # a --file or --out that cannot be opened
        print(f"kvd: {error}", file=sys.stderr)
        return EXIT_USAGE
