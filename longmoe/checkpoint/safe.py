"""Reading a checkpoint without running code from it.

Three kinds of files in a step directory are pickles:
- rng-rank{r}.pt (ours): a dict of tensors, read with torch.load(weights_only=True);
- DCP's `.metadata`: torch writes it with plain pickle and reads it with pickle.load. We read it
  ourselves, after checking its sha256 against the manifest, with an unpickler that resolves only
  the classes DCP metadata is made of, and hand DCP the object through a FileSystemReader;
- DCP's non-tensor entries inside the shards (optimizer hyper-parameters), which DCP's default
  planner reads with torch.load(weights_only=False): our planner reads them with
  weights_only=True first and refuses what that refuses.
Digests catch damage; these catch a crafted file whose manifest was rewritten to match.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md

from longmoe.errors import UserError
from longmoe.checkpoint.manifest import verified_bytes

DCP_METADATA = ".metadata"
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
        "BytesStorageMetadata", "TensorStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},                 # and every torch.dtype, checked by type below
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


def rng_name(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _refusal(e: Exception) -> str:
    """torch's weights_only message is a page long; the global it refused is the useful part."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    if m:
        return f"it names {m.group(1)}, which is not tensor data"
    first = str(e).strip().splitlines()
    return first[0] if first else type(e).__name__


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of DCP "
                                     f"metadata")


def read_dcp_metadata(step_dir: Path, manifest: dict) -> dcp_md.Metadata:
    path = step_dir / DCP_METADATA
    data = verified_bytes(step_dir, DCP_METADATA, manifest)
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any failure of a foreign file is one line
        raise UserError(f"checkpoint {path}: refused to read it: {_refusal(e)}") from None
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.storage_data, dict):
        raise UserError(f"checkpoint {path}: not DCP metadata (got {type(md).__name__})")
    files = manifest["files"]
    for idx, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if rel not in files or not (0 <= info.offset and info.offset + info.length
                                    <= files[rel]["size"]):
            raise UserError(f"checkpoint {path}: entry {getattr(idx, 'fqn', idx)!r} points "
                            f"outside the checkpoint's shards ({rel!r})")
    return md


def _byte_entries(md: dcp_md.Metadata):
    """(fqn, storage info) of every non-tensor entry: the pickled parts of the shards."""
    for idx, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata.get(idx.fqn), dcp_md.BytesStorageMetadata):
            yield idx.fqn, info


def check_contents(step_dir: Path, manifest: dict, md: dcp_md.Metadata):
    """Parse every pickled piece of the checkpoint with torch's weights-only unpickler (which
    cannot run code): the RNG files and the shards' non-tensor entries. For the launcher, so a
    crafted file is named before any rank starts."""
    for name in manifest["files"]:
        if re.fullmatch(r"rng-rank\d+\.pt", name):
            parse_rng(step_dir / name, verified_bytes(step_dir, name, manifest))
    for fqn, info in _byte_entries(md):
        path = step_dir / info.relative_path
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"checkpoint {path}: entry {fqn!r} uses a storage transform "
                            f"({', '.join(info.transform_descriptors)}) longmoe does not write")
        with open(path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        safe_torch_load(blob, f"checkpoint {path}: entry {fqn!r}")


def safe_torch_load(data: bytes, what: str):
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise UserError(f"{what}: refused to load it: {_refusal(e)}") from None


# ---- RNG states ----------------------------------------------------------------------------------

def save_rng(path: Path, device_state):
    state = {"cpu": torch.get_rng_state()}
    if device_state is not None:
        state["device"] = device_state
    torch.save(state, path)


def parse_rng(path: Path, data: bytes) -> dict:
    state = safe_torch_load(data, f"checkpoint {path}")
    if not (isinstance(state, dict) and set(state) <= {"cpu", "device"}
            and all(torch.is_tensor(v) and v.dtype == torch.uint8 for v in state.values())
            and "cpu" in state):
        raise UserError(f"checkpoint {path}: expected the generator states as uint8 tensors")
    return state


def load_rng(step_dir: Path, rank: int, manifest: dict) -> dict | None:
    """This rank's generator states, or None where the saving run had no such rank."""
    name = rng_name(rank)
    if name not in manifest["files"]:
        return None
    return parse_rng(step_dir / name, verified_bytes(step_dir, name, manifest))


# ---- DCP seams -----------------------------------------------------------------------------------

class VerifiedReader(FileSystemReader):
    """Reads shards like DCP's own reader; its metadata is the object we parsed and verified."""

    def __init__(self, step_dir: Path, metadata: dcp_md.Metadata):
        super().__init__(str(step_dir))
        self._metadata = metadata

    def read_metadata(self) -> dcp_md.Metadata:  # no **kwargs: no per-rank metadata fallback
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = dcp_md.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor entry must load with weights_only=True first."""

    def __init__(self, step_dir: Path):
        super().__init__()
        self._step_dir = step_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        safe_torch_load(value.getvalue(),
                        f"checkpoint {self._step_dir}: entry {read_item.dest_index.fqn!r}")
        value.seek(0)
        super().load_bytes(read_item, value)  # same bytes, proven to be plain data
