"""The chunk-count cache: measured best chunk counts, keyed by what decides them.

Key fields (joined with "|"): vendor, arch, interconnect signature, EP size, hidden size, top-k,
dtype, local-sequence bucket (the next power of two >= local tokens per rank). One JSON file per
directory, `chunks.json`: {"schema": SCHEMA, "entries": {key: entry}}. A file that is not valid
JSON or has another schema is ignored with a warning; the run goes on with the formula.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

SCHEMA = 1
FILE_NAME = "chunks.json"
SHIPPED_DIR = Path(__file__).parent / "cache"
ENV_DIR = "LONGMOE_TUNING_DIR"


def seq_bucket(local_tokens: int) -> int:
    if local_tokens < 1:
        raise ValueError(f"local tokens must be >= 1, got {local_tokens}")
    return 1 << (local_tokens - 1).bit_length()


def interconnect_signature(probe: dict) -> str:
    """"nvlink-8", "xgmi-8", "pcie-2", "cpu" ...: link kind and GPUs per node from the probe."""
    link = (probe.get("interconnect") or {}).get("link") or "unknown"
    n = (probe.get("interconnect") or {}).get("gpus_per_node") or probe.get("device_count") or 0
    return "cpu" if probe.get("name") == "cpu" else f"{link}-{n}"


def make_key(vendor: str, arch: str, interconnect: str, ep: int, hidden: int, top_k: int,
             dtype: str, local_tokens: int) -> str:
    return "|".join(str(v) for v in (vendor, arch, interconnect, f"ep{ep}", f"h{hidden}",
                                     f"k{top_k}", dtype, f"t{seq_bucket(local_tokens)}"))


def search_dirs() -> list[Path]:
    """Where the runtime looks, first match wins: $LONGMOE_TUNING_DIR, then the shipped cache."""
    dirs = [Path(os.environ[ENV_DIR])] if os.environ.get(ENV_DIR) else []
    return dirs + [SHIPPED_DIR]


def load(path: Path) -> dict:
    """The entries of one cache file; {} (with a warning) if it is unreadable or foreign."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        warnings.warn(f"tuning cache {path} ignored: not valid JSON ({e})", stacklevel=2)
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or \
            not isinstance(data.get("entries"), dict):
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        warnings.warn(f"tuning cache {path} ignored: schema {got!r}, this longmoe reads "
                      f"schema {SCHEMA}", stacklevel=2)
        return {}
    return data["entries"]


def save(directory: Path, entries: dict) -> Path:
    """Merge `entries` into directory/chunks.json, written atomically (temp file + rename)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILE_NAME
    merged = {**load(path), **entries}
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".chunks-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"schema": SCHEMA, "entries": merged}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def lookup(key: str, dirs: list[Path] | None = None):
    """(entry, file) of the first directory holding `key`, else (None, None)."""
    for d in dirs if dirs is not None else search_dirs():
        entry = load(Path(d) / FILE_NAME).get(key)
        if entry is not None:
            return entry, Path(d) / FILE_NAME
    return None, None
