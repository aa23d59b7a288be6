"""The settings reference table the README shows, built from ``kvd.config.settings``'s
table (``make readme`` writes it; a test checks the README is current)."""

from __future__ import annotations

from kvd.config.settings import SETTINGS


def settings_markdown() -> str:
    """The settings reference table, as the README shows it."""
    rows = [
        "| Setting | Default | Bounds | Meaning |",
        "|---|---|---|---|",
    ]
    for setting in SETTINGS:
        default = setting.toml(setting.default)
        bounds = setting.bounds()
        rows.append(f"| `{setting.name}` | `{default}` | {bounds} | {setting.help} |")
    return "\n".join(rows) + "\n"
