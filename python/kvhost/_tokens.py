"""An owner token read from a file: how the engines' settings
(kvhost.vllm's ``kvhost_owner_token_file``, the sglang storage backend's)
keep the token out of the engine's configuration, which engines log."""

from __future__ import annotations


def read_token_file(path: str) -> str:
    """The token in `path` (its text, surrounding whitespace stripped).
    ValueError saying why when it cannot be read or holds no token (the
    caller names the setting and the path)."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(e.strerror if isinstance(e, OSError) else "not UTF-8 text") from None
    if not token:
        raise ValueError("it is empty")
    return token
