"""How the configuration names its keys: the `Tracon` root, and the one form all spellings of a key
share, because the reliability guide's .NET configuration matches keys case-insensitively.
"""

from __future__ import annotations

ROOT_KEY = "Tracon"
"""The file's root object, as in the reliability guide's JSON examples; other roots (e.g.
"Logging") are ignored."""


def normalize_key(key: str) -> str:
    """The form two keys share when the configuration treats them as the same key."""
    return key.replace("_", "").lower()
