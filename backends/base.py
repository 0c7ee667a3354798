"""The Backend interface: everything longmoe asks of a device vendor, in one place.

Core code holds a Backend (from `longmoe.backends.active_backend()`) and never branches on the
vendor itself. Each implementation lives in `backends/<vendor>/` and registers itself.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from longmoe.backends.collective import CollectiveAdapter
from longmoe.backends.kernels import kernel_config_from
from longmoe.backends.timing import Timer
from longmoe.backends.versions import versions

# Packages every backend needs; vendors add the ones their probes use (see `packages`).
CORE_PACKAGES: tuple[str, ...] = ("torch", "triton")
# The peers longmoe's paired tests and benchmarks compare against (the `peers` extra): optional.
PEER_PACKAGES: tuple[str, ...] = ("liger-kernel", "megatron-core", "cut-cross-entropy")

log = logging.getLogger("longmoe.backends")

# Device type -> None when a bf16 GEMM writing fp32 runs there, else why not (tried once).
_FP32_OUTPUT_GEMM: dict[str, str | None] = {}


class Backend(abc.ABC):
    name: str = ""
    device_type: str = "cpu"
    packages: tuple[str, ...] = CORE_PACKAGES
    # Vendor directory holding kernels.json; set by each implementation to its own folder.
    data_dir: Path = Path(__file__).parent
    collective: CollectiveAdapter = CollectiveAdapter()
    # Triton launch options beyond num_warps/num_stages that this vendor's kernel tables may
    # carry (hints to its code generator); every other key of a table entry is a tile size.
    launch_keys: tuple[str, ...] = ()

    # --- availability -----------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool: ...

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """One line saying why `is_available()` is False, None when it is True."""
        return None if cls.is_available() else f"{cls.name} backend is not available"

    # --- devices ----------------------------------------------------------------------------
    def device(self, local_rank: int) -> torch.device:
        return torch.device(self.device_type, local_rank)

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its device; a no-op where there is only the host."""

    def synchronize(self) -> None:
        """Block until queued device work is done; a no-op where work is synchronous."""

    @abc.abstractmethod
    def probe(self) -> dict[str, Any]:
        """name, arch, sm_count, memory_bytes, warp_size, device_count, interconnect, errors.

        Never raises: a field that could not be read is None and the reason is in `errors`.
        """

    @abc.abstractmethod
    def _read_arch(self) -> str: ...

    @functools.cached_property
    def arch(self) -> str:
        """Arch name that keys kernel configs ("sm_90", "gfx942", "cpu"); "any" if unreadable."""
        try:
            return self._read_arch()
        except Exception:  # an unreadable arch means generic configs, not a crash
            return "any"

    # --- timing and memory ------------------------------------------------------------------
    @abc.abstractmethod
    def timer(self) -> Timer: ...

    @abc.abstractmethod
    def reset_peak_memory(self) -> None: ...

    @abc.abstractmethod
    def peak_memory_bytes(self) -> int: ...

    def memory_allocated(self) -> int:
        """Bytes the device allocator holds now (0 where there is no device allocator)."""
        return 0

    def empty_cache(self) -> None:
        """Return cached allocator blocks to the device (between benchmark cases)."""

    def get_rng_state(self):
        """The device generator's state for checkpoints (None where the host RNG is all)."""
        return None

    def set_rng_state(self, state) -> None:
        """Restore what get_rng_state returned."""

    @property
    @abc.abstractmethod
    def memory_label(self) -> str:
        """What `peak_memory_bytes` measures, for reports next to the number."""

    # --- capabilities -----------------------------------------------------------------------
    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        """Whether torch._grouped_mm runs here in `dtype`; the ops registry falls back if not."""
        return False

    def supports_reduce_dtype(self, dtype: torch.dtype) -> bool:
        return self.collective.supports_reduce_dtype(dtype)

    def fp32_output_gemm(self, device: torch.device) -> str | None:
        """None when a bf16 GEMM that writes fp32 (torch.mm(..., out_dtype=torch.float32)) runs
        on `device`, else the one-line reason it does not. Support depends on the torch build and
        the vendor's GEMM library, so one 2x2 product, tried once per device type, is the fact a
        version check would guess."""
        key = torch.device(device).type
        if key not in _FP32_OUTPUT_GEMM:
            try:
                a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
                torch.mm(a, a, out_dtype=torch.float32)
                _FP32_OUTPUT_GEMM[key] = None
            except Exception as e:  # any failure means "not on this device"; callers fall back
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                _FP32_OUTPUT_GEMM[key] = f"no bf16 GEMM with fp32 output on {key}: {first[:80]}"
                log.info("%s", _FP32_OUTPUT_GEMM[key])
        return _FP32_OUTPUT_GEMM[key]

    # --- collectives ------------------------------------------------------------------------
    @property
    def dist_backend(self) -> str:
        return self.collective.dist_backend

    @property
    def comm_stream_priority(self) -> int:
        return self.collective.comm_stream_priority

    @property
    def a2a_transport(self) -> str:
        return self.collective.a2a_transport

    def streams(self, priority: int | None = None):
        """Compute/communication stream pair for overlapped schedules (backends/streams.py);
        `priority` overrides the adapter's comm-stream priority (for benchmarks)."""
        from longmoe.backends.streams import HostStreams
        return HostStreams()

    def a2a(self, name: str = "auto", device: torch.device | None = None):
        """The expert all-to-all transport `name` (or the best available for "auto")."""
        return self.collective.a2a(name, device or self.device(0))

    def collective_env(self) -> dict[str, str]:
        """Environment defaults for init_process_group (before user overrides)."""
        return self.collective.env()

    def apply_collective_env(self) -> dict[str, str]:
        """Set the defaults the user has not set in os.environ; returns what was set."""
        return self.collective.apply_env()

    # --- kernel configs ---------------------------------------------------------------------
    @classmethod
    def launch_options(cls, cfg: Mapping[str, Any], num_warps_key: str = "num_warps") -> dict:
        """The Triton launch kwargs of one table entry: its warps (`num_warps_key`, else
        num_warps), its stages where the entry sets them (the key named like the warps key,
        num_warps_X -> num_stages_X, else num_stages: kernels of one entry may pipeline best
        at different depths), and this vendor's launch_keys."""
        opts = {"num_warps": cfg.get(num_warps_key, cfg["num_warps"])}
        stages_key = num_warps_key.replace("num_warps", "num_stages", 1)
        if stages_key in cfg or "num_stages" in cfg:
            opts["num_stages"] = cfg.get(stages_key, cfg.get("num_stages"))
        opts.update({k: cfg[k] for k in cls.launch_keys if k in cfg})
        return opts

    @classmethod
    def compile_targets(cls) -> tuple:
        """The GPU targets (backends/aot.py's CompileTarget) whose kernels this vendor compiles
        ahead of time; none for a backend without Triton code generation of its own."""
        return ()

    def kernel_config(self, kernel: str, shape_bucket: str | None = None) -> dict[str, Any]:
        """The table's config for this arch, looked up once per (kernel, bucket): kernels call this
        at every launch, and a lookup resolves the table's path (filesystem calls: 650 lstat
        calls in five 16K-token MoE layer steps at C = 8 under cProfile on an H200 host), host
        time that a chunked layer pays per chunk."""
        cache = self.__dict__.setdefault("_kernel_configs", {})
        key = (kernel, shape_bucket)
        if key not in cache:
            cache[key] = kernel_config_from(self.data_dir / "kernels.json", kernel, self.arch,
                                            shape_bucket)
        return {**cache[key], **self.__dict__.get("_kernel_overrides", {}).get(kernel, {})}

    @contextlib.contextmanager
    def kernel_overrides(self, kernel: str, cfg: dict[str, Any] | None):
        """Within the block, `kernel`'s config (every bucket) has `cfg`'s keys replaced: the tile
        sweeps of `longmoe bench` time candidate configs through the same lookup kernels use."""
        overrides = self.__dict__.setdefault("_kernel_overrides", {})
        overrides[kernel] = dict(cfg or {})
        try:
            yield
        finally:
            overrides.pop(kernel, None)

    # --- reporting --------------------------------------------------------------------------
    def versions(self) -> dict[str, str | None]:
        return versions()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "probe": self.probe(),
            "versions": self.versions(),
            "packages": list(self.packages),
            "collective_env": self.collective_env(),
            "collective_env_to_apply": self.collective.env_to_apply(),
            "comm_stream_priority": self.comm_stream_priority,
            "a2a_transport": self.a2a_transport,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r}>"
