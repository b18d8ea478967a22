"""Files of the profilers: profile.json, the symbolic-profile cache, the CAPTURE run log (JSONL)
and calibrated hardware YAMLs. Every write is atomic (temp file + rename) or a single appended
line, so an interrupted job leaves whole records behind and can resume from them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from reports.files import write_text
from specs.profile import Profile, cache_key  # noqa: F401  (cache_key re-exported)


def write_profile(path: Path, profile: Profile) -> Path:
    return write_text(path, profile.model_dump_json(indent=2) + "\n")


def load_profile(path: Path) -> Profile:
    """A profile.json as a Profile: strict JSON (no duplicate keys, no NaN), every field bounded.
    Raises ValueError (pydantic's ValidationError is one) naming what is wrong."""
    from reports.outputs import read_json_strict

    return Profile.model_validate(read_json_strict(path))


def cached_profile(cache_dir: Path, key: str) -> Profile | None:
    path = Path(cache_dir) / f"{key}.json"
    if not path.exists():
        return None
    try:
        return load_profile(path)
    except ValueError as exc:  # an older schema, or a damaged/edited file: say so and profile again
        print(f"note: ignoring the cached profile {path} ({one_line(exc)}); profiling again", flush=True)
        return None


def one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def store_profile(cache_dir: Path, key: str, profile: Profile) -> Path:
    return write_profile(Path(cache_dir) / f"{key}.json", profile)


def append_record(path: Path, record: dict) -> None:
    """Append one JSON line and flush it to disk: the run log survives a kill after any line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
    """Records of a JSONL log; a torn last line (killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
