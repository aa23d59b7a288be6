"""What the paths' tests share: the tokens of a test token table and the
file that holds them."""

from __future__ import annotations

from pathlib import Path

from kvd.paths.auth import hash_token

TOKEN_A = "token-for-team-a"
TOKEN_ADMIN = "token-for-the-admin"
TOKEN_LATER = "token-added-by-reload"


def token_file(path: Path, *, extra: str = "") -> Path:
    path.write_text(
        f'admin_sha256 = ["{hash_token(TOKEN_ADMIN)}"]\n'
        "[[tokens]]\n"
        'name = "team-a"\n'
        f'sha256 = "{hash_token(TOKEN_A)}"\n'
        'namespaces = ["team-a/*", "shared"]\n' + extra
    )
    return path
