"""The PEM files the TLS settings name: read with a bound, and checked the
way TLS will use them (a key that does not match its certificate, or a CA
bundle without a certificate, is a ConfigError naming its setting)."""

from __future__ import annotations

import ssl

from kvd.config.setting import ConfigError

# A PEM chain or CA bundle is a few KiB; 1 MiB stops a wrong path.
PEM_FILE_MAX_BYTES = 1 << 20


def read_pem(path: str, setting: str) -> bytes:
    try:
        with open(path, "rb") as file:
            data = file.read(PEM_FILE_MAX_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{setting}: cannot read {path}: {error.strerror}", key=setting) from None
    if len(data) > PEM_FILE_MAX_BYTES:
        raise ConfigError(f"{setting}: {path} is over {PEM_FILE_MAX_BYTES} bytes", key=setting)
    return data


def check_pem(
    cert_file: str, key_file: str, ca_file: str, ca_setting: str, *, server: bool,
    cert_setting: str = "tls_cert_file",
) -> None:  # fmt: skip
    """Parse the files as a TLS server (``server``) or client would: the key,
    where there is a certificate, must match it (``cert_setting``);
    ``ca_file``, where set, must hold a certificate (``ca_setting``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    if cert_file:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(
                f"{cert_setting}: {cert_file} with {key_file}: {error}", key=cert_setting
            ) from None
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"{ca_setting}: {ca_file}: {error}", key=ca_setting) from None
