"""One loader for the small durable JSON records a run leaves in its save directory.

Commit markers, branch records, `current.json` and the queue and batch-builder snapshots are read through
`load_json_record`, which turns every way such a file can be wrong (missing, truncated or not JSON, another
format version, a missing key, or a size or sha256 that differs from what the joint commit marker listed) into
one `DurableFileError` naming the file, what is wrong with it and what gets the user out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: The way out when a caller knows no better one.
DEFAULT_REMEDY = "restore the file from a copy, or point the command at another save directory"


class DurableFileError(ValueError):
    """A durable record is missing or damaged: `path`, the `problem` and the `remedy` (what gets the user out)."""

    def __init__(self, path: Path | str, problem: str, remedy: str = DEFAULT_REMEDY) -> None:
        self.path = Path(path)
        self.problem = problem
        self.remedy = remedy
        super().__init__(f"{path}: {problem}; {remedy}")


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_listed_file(path: Path, listed: Mapping[str, Any], *, what: str, remedy: str = DEFAULT_REMEDY) -> None:
    """Check that `path` still is the file a commit marker listed (`{"size": ..., "sha256"?: ...}`)."""
    if not path.is_file():
        raise DurableFileError(path, f"{what} listed by the commit marker is missing", remedy)
    size = path.stat().st_size
    if size != listed.get("size"):
        raise DurableFileError(
            path, f"{what} has {size} bytes but the commit marker listed {listed.get('size')} (changed or torn)", remedy
        )
    expected = listed.get("sha256")
    if expected is not None and file_sha256(path) != expected:
        raise DurableFileError(path, f"{what} differs from the sha256 the commit marker listed (edited)", remedy)


def load_json_record(
    path: Path | str,
    *,
    what: str,
    required_keys: Iterable[str] = (),
    version: int | None = None,
    listed: Mapping[str, Any] | None = None,
    remedy: str = DEFAULT_REMEDY,
) -> Any:
    """Read the JSON record `what` at `path`; raise `DurableFileError` when it is unusable.

    `required_keys` must be present (the value must then be an object), `version` must equal its `"version"`,
    and with `listed` (the commit marker's entry for the file) its size and sha256 must match first.
    """
    path = Path(path)
    if listed is not None:
        check_listed_file(path, listed, what=what, remedy=remedy)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DurableFileError(path, f"{what} is missing", remedy) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DurableFileError(path, f"{what} cannot be read ({exc})", remedy) from None
    try:
        value = json.loads(text)
    except ValueError as exc:
        problem = "is empty" if not text.strip() else f"is not valid JSON, truncated or edited ({exc})"
        raise DurableFileError(path, f"{what} {problem}", remedy) from None
    keys = list(required_keys)
    if (keys or version is not None) and not isinstance(value, dict):
        raise DurableFileError(path, f"{what} must hold a JSON object, not {type(value).__name__}", remedy)
    if version is not None and value.get("version") != version:
        raise DurableFileError(
            path, f"{what} has format version {value.get('version')!r}; this slime-rl reads version {version}", remedy
        )
    missing = [key for key in keys if key not in value]
    if missing:
        raise DurableFileError(path, f"{what} lacks {', '.join(map(repr, missing))}", remedy)
    return value
