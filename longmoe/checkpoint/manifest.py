"""What a checkpoint is, by content: DIR/step-N/manifest.json lists every other file of the step
directory with its size and sha256, and the identity of the run that wrote it.

A step directory counts as complete only when its manifest is there, parses, and every file it
lists is present with the listed size (the cheap check, done whenever a checkpoint is picked) and,
for --resume and `longmoe checkpoint verify`, the listed sha256. A file the manifest does not list
is an error too: nothing enters a checkpoint after the manifest was written.

The manifest is written into the temporary directory before the rename that publishes it, so a
published directory without one was never finished (or comes from a longmoe that wrote none).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from longmoe.errors import UserError

FORMAT = "longmoe-checkpoint-1"
MANIFEST = "manifest.json"
META = "meta.json"
_CHUNK = 8 << 20   # streamed: a multi-GB shard never sits in memory whole
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sha256_file(path: Path, durable: bool = False) -> dict:
    """{"size", "sha256"} of a file, read in chunks. `durable`: also fsync it, so the digest
    describes bytes that are on disk when the manifest publishes them."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if durable:
            os.fsync(f.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- the run identity --------------------------------------------------------------------------

def config_view(run) -> dict:
    """The part of the run config that says what is trained, as JSON gives it back. Left out:
    `parallel` and `impl` (how it is computed; world, EP and CP are recorded on their own),
    `data.batch_size` (it enters as the global batch), and train fields that only say how long,
    where, or what to write besides (steps, nproc, device, checkpoint_every, keep_checkpoints,
    init_hf, export_hf)."""
    d = run.to_dict()
    view = {"model": d["model"], "data": {k: v for k, v in d["data"].items() if k != "batch_size"},
            "loss": d["loss"], "optim": d["optim"], "train": {"seed": d["train"]["seed"]}}
    return json.loads(json.dumps(view))  # tuples become lists, as a reader of meta.json sees them


def config_hash(run) -> str:
    return sha256_bytes(json.dumps(config_view(run), sort_keys=True,
                                   separators=(",", ":")).encode())


def global_batch(run, world: int, cp: int) -> int:
    """Sequences per optimizer step over all data-parallel ranks: data.batch_size is the global
    batch (world and cp stay in the signature: the identity records them beside it)."""
    return run.data.batch_size


def run_identity(run, world: int, ep: int, cp: int) -> dict:
    return {"config_sha256": config_hash(run), "global_batch": global_batch(run, world, cp),
            "world": world, "ep": ep, "cp": cp}


# ---- writing and reading manifests -------------------------------------------------------------

def write_manifest(step_dir: Path, step: int, files: dict[str, dict], identity: dict):
    body = {"format": FORMAT, "step": step, "identity": identity,
            "written_by": {"host": socket.gethostname(), "pid": os.getpid(),
                           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "files": {k: files[k] for k in sorted(files)}}
    path = step_dir / MANIFEST
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(step_dir: Path) -> dict:
    """The parsed manifest of a step directory; UserError naming the file for anything else."""
    path = step_dir / MANIFEST
    if not path.is_file():
        if (step_dir / META).is_file():
            raise UserError(f"checkpoint {step_dir}: written by an older longmoe without a "
                            f"manifest, so its files cannot be verified; resume it with the "
                            f"longmoe that wrote it, or start fresh with --overwrite")
        raise UserError(f"checkpoint {step_dir} is incomplete (no {MANIFEST})")
    try:
        m = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint {path}: not valid JSON ({e})") from None
    _check_shape(path, m, step_dir)
    return m


def _check_shape(path: Path, m, step_dir: Path):
    def bad(what):
        raise UserError(f"checkpoint {path}: {what}")
    if not isinstance(m, dict):
        bad("expected a JSON object")
    if m.get("format") != FORMAT:
        bad(f"format is {m.get('format')!r}, this longmoe reads {FORMAT!r}")
    if not isinstance(m.get("step"), int) or \
            step_dir.name.split(".", 1)[0] != f"step-{m['step']:08d}":
        bad(f"step {m.get('step')!r} does not match the directory name {step_dir.name}")
    ident = m.get("identity")
    if not isinstance(ident, dict) or not isinstance(ident.get("config_sha256"), str) or any(
            not isinstance(ident.get(k), int) or isinstance(ident.get(k), bool)
            for k in ("global_batch", "world", "ep", "cp")):
        bad("identity needs config_sha256, global_batch, world, ep and cp")
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        bad("files must be a non-empty object")
    for name, entry in files.items():
        if name in (MANIFEST, "", ".", "..") or "/" in name or "\\" in name:
            bad(f"lists {name!r}, not a file of the step directory")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and entry["size"] >= 0 and isinstance(entry.get("sha256"), str)
                and _HEX64.fullmatch(entry["sha256"])):
            bad(f"entry {name!r} needs a size and a sha256")


def check_files(step_dir: Path, manifest: dict, full: bool):
    """Every listed file there with its size (and, `full`, its sha256); nothing unlisted."""
    files = manifest["files"]
    for p in sorted(step_dir.iterdir()):
        if p.name != MANIFEST and p.name not in files:
            raise UserError(f"checkpoint {p}: not listed in {MANIFEST} (not written by the save "
                            f"that published {step_dir.name})")
    for name, entry in files.items():
        p = step_dir / name
        if not p.is_file():
            raise UserError(f"checkpoint {p}: missing (listed in {MANIFEST})")
        size = p.stat().st_size
        if size != entry["size"]:
            raise UserError(f"checkpoint {p}: {size} bytes, {MANIFEST} says {entry['size']} "
                            f"(truncated or damaged)")
    if full:
        # hashlib drops the GIL on large buffers: threads digest shards side by side
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            got = dict(zip(files, pool.map(lambda n: sha256_file(step_dir / n)["sha256"], files)))
        for name, entry in sorted(files.items()):
            if got[name] != entry["sha256"]:
                raise UserError(f"checkpoint {step_dir / name}: content differs from its sha256 "
                                f"in {MANIFEST} (damaged)")


def verify_step(step_dir: Path, full: bool) -> dict:
    """The manifest of a complete step directory (UserError naming the damaged file)."""
    m = read_manifest(step_dir)
    check_files(step_dir, m, full)
    return m


def verified_bytes(step_dir: Path, name: str, manifest: dict) -> bytes:
    """A small file's bytes, read once and checked against the manifest: what is checked is
    what is then parsed."""
    path = step_dir / name
    if name not in manifest["files"]:
        raise UserError(f"checkpoint {path}: missing from {MANIFEST}")
    data = path.read_bytes()
    if sha256_bytes(data) != manifest["files"][name]["sha256"]:
        raise UserError(f"checkpoint {path}: content differs from its sha256 in {MANIFEST} "
                        f"(damaged)")
    return data


def read_meta(path: Path, manifest: dict) -> dict:
    """meta.json (the model and run config), checked against the manifest before it is parsed."""
    file, data = path / META, verified_bytes(path, META, manifest)
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint {file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise UserError(f"checkpoint {file}: expected an object with the model config")
    return meta
