"""The settings table: defaults, precedence, strictness, sizes, bounds."""

import dataclasses
from pathlib import Path

import pytest

from kvd.config.addresses import is_loopback_host, parse_address
from kvd.config.docs import settings_markdown
from kvd.config.loading import load_config
from kvd.config.settings import SETTINGS, Config, ConfigError
from kvd.config.sizes import SizeError, format_size, parse_size

GiB = 1 << 30
MiB = 1 << 20


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_contract() -> None:
    config = load_config(None, {}, {})
    assert config == Config()
    assert config.listen == "127.0.0.1:7070"
    assert config.metrics_listen == "127.0.0.1:9470"
    assert config.dram_bytes == 1 * GiB
    assert config.ssd_bytes == 4 * GiB
    assert config.ssd_path == ("./kvd-data/kvd-0.dat",)
    assert config.socket == "/dev/shm/kvd/grpc.sock"  # in shm_dir: engines on the node find it
    assert config.socket_mode == 0o660


def test_every_setting_is_declared_once_with_help() -> None:
    names = [setting.name for setting in SETTINGS]
    assert len(names) == len(set(names))
    assert names == [field.name for field in dataclasses.fields(Config)]
    for setting in SETTINGS:
        assert setting.help, setting.name
        assert setting.env == "KVD_" + setting.name.upper()
        assert setting.flag == "--" + setting.name.replace("_", "-")
        if setting.name.endswith("_bytes"):
            assert setting.kind == "size", setting.name


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'dram_bytes = "2GiB"\nssd_bytes = "8GiB"\nmax_batch_items = 7\n')
    from_file = load_config(path, {}, {})
    assert (from_file.dram_bytes, from_file.ssd_bytes, from_file.max_batch_items) == (
        2 * GiB,
        8 * GiB,
        7,
    )

    env = {"KVD_SSD_BYTES": "16GiB", "KVD_MAX_BATCH_ITEMS": "9"}
    from_env = load_config(path, env, {})
    assert (from_env.dram_bytes, from_env.ssd_bytes, from_env.max_batch_items) == (
        2 * GiB,
        16 * GiB,
        9,
    )

    from_flag = load_config(path, env, {"max_batch_items": "11", "dram_bytes": None})
    assert (from_flag.dram_bytes, from_flag.ssd_bytes, from_flag.max_batch_items) == (
        2 * GiB,
        16 * GiB,
        11,
    )


def test_unrelated_environment_is_ignored() -> None:
    config = load_config(None, {"PATH": "/bin", "KVD_CONFIG": "x", "KVD_TARGET": "y"}, {})
    assert config == Config()


def test_unknown_file_key_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "dram_byte = 5\n")
    with pytest.raises(ConfigError, match=r"dram_byte: unknown setting .*did you mean dram_bytes"):
        load_config(path, {}, {})


def test_nested_table_is_an_unknown_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nlisten = '127.0.0.1:1'\n")
    with pytest.raises(ConfigError, match="server: unknown setting"):
        load_config(path, {}, {})


def test_unknown_environment_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="KVD_DRAM_SIZE: unknown setting in the environment"):
        load_config(None, {"KVD_DRAM_SIZE": "1GiB"}, {})
    with pytest.raises(ConfigError, match="KVD_dram_bytes"):
        load_config(None, {"KVD_dram_bytes": "1GiB"}, {})


def test_out_of_bounds_names_key_and_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dram_bytes: 1KiB is below the minimum 1MiB.*flag"):
        load_config(None, {}, {"dram_bytes": "1KiB"})
    with pytest.raises(ConfigError, match=r"max_message_bytes: 2GiB is above .*1GiB.*KVD_MAX"):
        load_config(None, {"KVD_MAX_MESSAGE_BYTES": "2GiB"}, {})
    path = write(tmp_path, "max_concurrent_rpcs = 0\n")
    with pytest.raises(ConfigError, match=r"max_concurrent_rpcs: 0 is below the minimum 1.*file"):
        load_config(path, {}, {})


def test_wrong_types_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_leases: expected an integer"):
        load_config(write(tmp_path, "max_leases = 1.5\n"), {}, {})
    with pytest.raises(ConfigError, match="listen: expected a string"):
        load_config(write(tmp_path, "listen = 7070\n"), {}, {})
    with pytest.raises(ConfigError, match="max_leases: invalid literal"):
        load_config(None, {"KVD_MAX_LEASES": "lots"}, {})
    with pytest.raises(ConfigError, match="dram_bytes: expected"):
        Config(dram_bytes="1GiB")  # type: ignore[arg-type]


def test_choices_are_enforced() -> None:
    with pytest.raises(ConfigError, match="log_level: 'loud' is not one of"):
        load_config(None, {}, {"log_level": "loud"})
    assert load_config(None, {}, {"io_backend": "threads"}).io_backend == "threads"


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "dram_bytes = \n"), {}, {})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "absent.toml"), {}, {})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("65536", 65536),
        ("64KiB", 64 << 10),
        ("512MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("100MB", 100_000_000),
        ("2 TiB", 2 << 40),
        ("10b", 10),
        ("1gib", GiB),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "4G", "1.5", "0.3KiB", "GiB", "1e9", "1 GiBs", True])
def test_parse_size_refuses(text: str | int) -> None:
    with pytest.raises(SizeError):
        parse_size(text)


def test_format_size_round_trips() -> None:
    for size in (0, 1, 1000, 64 << 10, 3 * GiB // 2, 5 << 40):
        assert parse_size(format_size(size)) == size
    assert format_size(GiB) == "1GiB"
    assert format_size(3 * GiB // 2) == "1536MiB"


def test_sizes_from_file_env_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "ssd_bytes = 1073741824\nmax_value_bytes = '64MiB'\n")
    config = load_config(path, {"KVD_DRAM_BYTES": "1.5GiB"}, {"max_inflight_bytes": "100MB"})
    assert config.ssd_bytes == GiB
    assert config.max_value_bytes == 64 * MiB
    assert config.dram_bytes == 3 * GiB // 2
    assert config.max_inflight_bytes == 100_000_000


def test_lists_from_file_env_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'ssd_path = ["/a/x.dat", "/b/x.dat"]\n')
    assert load_config(path, {}, {}).ssd_path == ("/a/x.dat", "/b/x.dat")
    assert load_config(None, {"KVD_SSD_PATH": "/a,/b:/c"}, {}).ssd_path == ("/a", "/b", "/c")
    assert load_config(path, {}, {"ssd_path": ["/z"]}).ssd_path == ("/z",)
    with pytest.raises(ConfigError, match="ssd_path: lists a path twice"):
        load_config(None, {}, {"ssd_path": ["/a", "/a"]})
    with pytest.raises(ConfigError, match="ssd_path: contains an empty path"):
        load_config(path, {}, {"ssd_path": ["/a", ""]})


def test_socket_mode_is_octal(tmp_path: Path) -> None:
    assert load_config(None, {"KVD_SOCKET_MODE": "0600"}, {}).socket_mode == 0o600
    assert load_config(None, {}, {"socket_mode": "0o640"}).socket_mode == 0o640
    assert load_config(write(tmp_path, "socket_mode = 0o600\n"), {}, {}).socket_mode == 0o600
    with pytest.raises(ConfigError, match="socket_mode"):
        load_config(None, {}, {"socket_mode": "1000"})


@pytest.mark.parametrize(
    "listen", ["0.0.0.0:7070", "[::]:7070", "10.1.2.3:7070", "kvd.example:7070"]
)
def test_non_loopback_listen_is_refused(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"listen: refusing to listen on .* without auth"):
        load_config(None, {}, {"listen": listen})


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:7070", "localhost:7070", "127.0.0.2:1"])
def test_loopback_listen_is_accepted(listen: str) -> None:
    assert load_config(None, {}, {"listen": listen}).listen == listen


def test_addresses() -> None:
    assert parse_address("[::1]:7070") == ("::1", 7070)
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)
    for bad in ("7070", "host:", ":7070", "::1:7070", "h:70000", "h:x"):
        with pytest.raises(ValueError, match=r"."):
            parse_address(bad)
    assert is_loopback_host("localhost")
    assert not is_loopback_host("0.0.0.0")
    with pytest.raises(ConfigError, match="metrics_listen"):
        load_config(None, {}, {"metrics_listen": "nope"})
    assert load_config(None, {}, {"metrics_listen": ""}).metrics_listen == ""


def test_cross_field_rules_name_the_keys() -> None:
    with pytest.raises(ConfigError, match=r"max_value_bytes: .* dram_bytes .*--dram-bytes"):
        load_config(None, {}, {"dram_bytes": "16MiB", "max_value_bytes": "32MiB"})
    config = load_config(None, {}, {"dram_bytes": "64MiB", "max_value_bytes": "16MiB"})
    assert config.max_value_bytes == 16 * MiB
    with pytest.raises(ConfigError, match=r"max_message_bytes: .* max_inflight_bytes"):
        load_config(None, {}, {"max_inflight_bytes": "32MiB"})


def test_socket_path_length_is_bounded() -> None:
    with pytest.raises(ConfigError, match="socket: unix socket path longer than 107"):
        load_config(None, {}, {"socket": "/tmp/" + "s" * 200})


def test_toml_round_trip(tmp_path: Path) -> None:
    config = load_config(
        None,
        {},
        {"ssd_path": ["/a", "/b"], "dram_bytes": "1536MiB", "socket": "/tmp/k.sock"},
    )
    assert load_config(write(tmp_path, config.to_toml()), {}, {}) == config


def test_describe_is_short_and_complete() -> None:
    summary = Config().describe()
    assert set(summary) == {setting.name for setting in SETTINGS}
    assert summary["dram_bytes"] == "1GiB"
    assert summary["socket_mode"] == "0o660"


def test_readme_lists_every_setting() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    begin = readme.index("-->", readme.index("<!-- settings-table:begin")) + 4
    end = readme.index("<!-- settings-table:end")
    assert readme[begin:end] == settings_markdown(), "README table is stale: run `make readme`"
    for setting in SETTINGS:
        assert f"| `{setting.name}` |" in readme
