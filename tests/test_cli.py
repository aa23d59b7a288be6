"""The kvd command: version, configuration errors, and the client commands
against a live daemon."""

import importlib.util
import os
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvd import __version__
from kvd.cli import UsageError, build_parser, main, parse_key
from kvd.client import Client, Unavailable
from kvd.config.settings import SETTINGS
from kvd.io.backend import native_density_learn
from tests.support import DaemonProcess

REPO = Path(__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT_S = 60


def run_kvd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVD_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )


@pytest.fixture(autouse=True)
def no_kvd_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVD_"):
            monkeypatch.delenv(name)


def test_version_subprocess() -> None:
    result = run_kvd("version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvd {__version__}"


def test_version_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out == f"kvd {__version__}\n"


def test_serve_refuses_non_loopback_listen() -> None:
    result = run_kvd("serve", "--listen", "0.0.0.0:7070")
    assert result.returncode == 2
    assert "kvd: config: listen: refusing to listen on 0.0.0.0:7070 without auth" in result.stderr


def test_config_error_exits_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--dram-bytes", "12 parsecs"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvd: config: dram_bytes: ")
    assert "--dram-bytes" in err


def test_unknown_environment_variable_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVD_DRAM_GIGABYTES", "4")
    assert main(["serve"]) == 2
    assert "kvd: config: KVD_DRAM_GIGABYTES: unknown setting" in capsys.readouterr().err


def test_config_file_from_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('dram_bytes = "2GiB"\nssd_path = ["/x/a.dat"]\n')
    monkeypatch.setenv("KVD_CONFIG", str(path))
    assert main(["config", "--ssd-path", "/y/b.dat", "--ssd-path", "/y/c.dat"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["dram_bytes"] == "2GiB"
    assert printed["ssd_path"] == ["/y/b.dat", "/y/c.dat"]


def test_no_ssd_flag_empties_ssd_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kvd.toml"
    path.write_text('ssd_path = ["/x/a.dat"]\n')
    monkeypatch.setenv("KVD_CONFIG", str(path))
    assert main(["config", "--no-ssd"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["ssd_path"] == []


def test_no_ssd_conflicts_with_ssd_path_and_an_empty_path_stays_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--no-ssd", "--ssd-path", "/x/a.dat"]) == 2
    assert "kvd: --no-ssd and --ssd-path conflict" in capsys.readouterr().err
    assert main(["serve", "--ssd-path", ""]) == 2
    assert "ssd_path: contains an empty path" in capsys.readouterr().err


def test_serve_with_no_ssd_runs_without_l2(tmp_path: Path) -> None:
    workdir = tmp_path / "d"
    workdir.mkdir()
    # ssd="": the test daemon gets --no-ssd and no --ssd-path, nor a config.
    daemon = DaemonProcess(workdir, [], ssd="")
    try:
        assert "--no-ssd" in daemon.proc.args and "--ssd-path" not in daemon.proc.args
        assert daemon.alive() and daemon.port, daemon.log[-5:]
        started = [line for line in daemon.log if "kvd started" in line]
        assert started and 'ssd_paths="" ssd_bytes=0' in started[0], started
        # Which implementation the eviction policy learns lookups with.
        learning = "native" if native_density_learn() is not None else '"python'
        assert f"eviction_learning={learning}" in started[0], started
        with Client(daemon.target, timeout_s=10) as client:
            assert client.put("ns", b"k", b"value") is False
            assert client.get("ns", b"k") == b"value"
            stats = client.stats()
            assert stats.get("l2_bytes", 0) == 0 and stats.get("l2_writes", 0) == 0
            with pytest.raises(Unavailable, match="no L2"):
                client.put("ns", b"durable", b"value", durable=True)
    finally:
        daemon.stop()
    assert not list(workdir.glob("*.dat"))


def test_serve_has_a_flag_per_setting() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", *[part for s in SETTINGS for part in (s.flag, "1")]])
    for setting in SETTINGS:
        expected = ["1"] if setting.kind == "list" else "1"
        assert getattr(args, setting.name) == expected, setting.name


def test_parse_key() -> None:
    assert parse_key("chunk-1") == b"chunk-1"
    assert parse_key("hex:00ff") == b"\x00\xff"
    for bad in ("hex:0", "hex:zz", "x" * 65, "hex:"):
        with pytest.raises(UsageError):
            parse_key(bad)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["get", "only-one-word"]) == 2
    assert "namespace" in capsys.readouterr().err
    assert main(["put", "-n", "ns", "k1", "k2"]) == 2
    assert "expected 1 key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2


def test_unreachable_daemon_exits_3(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = f"unix://{tmp_path}/absent.sock"
    assert main(["stats", "--target", target, "--timeout-s", "2"]) == 3
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_client_commands_against_a_daemon(
    daemon_factory: Callable[..., Any],
    tmp_path: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
) -> None:
    daemon = daemon_factory("--max-value-bytes", "16MiB")
    value_path = tmp_path / "value.bin"
    value = bytes(range(256)) * 1000
    value_path.write_bytes(value)
    for target in (daemon.target, daemon.socket_target):
        common = ["--target", target, "--timeout-s", "10"]
        namespace = f"cli-{target[:4]}"
        assert main(["put", *common, namespace, "hex:0102", "--file", str(value_path)]) == 0
        assert capsysbinary.readouterr().out == f"stored {len(value)} bytes\n".encode()
        assert main(["put", *common, "-n", namespace, "hex:0102", "--file", str(value_path)]) == 0
        assert capsysbinary.readouterr().out == b"exists\n"

        assert main(["get", *common, namespace, "hex:0102"]) == 0
        assert capsysbinary.readouterr().out == value
        out_path = tmp_path / "out.bin"
        assert main(["get", *common, "-n", namespace, "hex:0102", "--out", str(out_path)]) == 0
        assert out_path.read_bytes() == value
        assert main(["get", *common, namespace, "absent"]) == 1
        assert b"miss" in capsysbinary.readouterr().err

        assert main(["lookup", *common, namespace, "hex:0102", "absent", "hex:0102"]) == 0
        assert capsysbinary.readouterr().out == b"1\n"

        assert main(["stats", *common]) == 0
        assert b'"entries"' in capsysbinary.readouterr().out


def test_plugin_commands_parse_their_own_help(capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("kvd.tools.bench") is None:
        pytest.skip("kvd.tools.bench is not part of this tree")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvd bench")
    if importlib.util.find_spec("kvd.tools.fsck") is None:  # an absent plugin is no command
        with pytest.raises(SystemExit) as exit_info:
            main(["fsck"])
        assert exit_info.value.code == 2
