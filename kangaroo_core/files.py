"""Reading the small JSON files kangaroo writes (manifests, adapter metadata) with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, error: type[Exception], what: str = "") -> Any:
    """Parse a UTF-8 JSON file; unreadable, non-UTF-8 or malformed content raises ``error`` with one line."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what or path} is not valid UTF-8 JSON: {exc}") from None
