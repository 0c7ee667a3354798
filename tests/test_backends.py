"""Backend registry, probes, timers, kernel-config lookup, collective env, and `longmoe doctor`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import longmoe.backends as backends
from longmoe.backends.cpu import CpuBackend
from longmoe.backends.cuda import CudaBackend
from longmoe.backends.cuda.probe import nvlink_summary
from longmoe.backends.kernels import kernel_config_from, lookup_kernel_config
from longmoe.backends.rocm import RocmBackend
from longmoe.backends.rocm.probe import hip_summary, link_summary
from longmoe.doctor import run_doctor

PROBE_FIELDS = {"name", "arch", "sm_count", "memory_bytes", "warp_size", "device_count",
                "interconnect", "errors"}
BACKENDS_DIR = Path(backends.__file__).parent
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")


@pytest.fixture(autouse=True)
def _fresh_choice(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.reset_active_backend()
    yield
    backends.reset_active_backend()


# --- registry --------------------------------------------------------------------------------
@no_gpu
def test_active_backend_is_cpu_here_and_env_var_forces(monkeypatch):
    b = backends.active_backend()
    assert b.name == "cpu" and b.device_type == "cpu" and b.dist_backend == "gloo"
    assert backends.active_backend() is b  # cached
    backends.reset_active_backend()
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match="cuda"):
        backends.active_backend()


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        backends.get_backend("nope")
    for name in ("cpu", "cuda", "rocm"):
        assert repr(name) in str(info.value)


@no_gpu
@pytest.mark.parametrize("name", ["cuda", "rocm"])
def test_absent_device_raises_one_line(name):
    with pytest.raises(RuntimeError) as info:
        backends.get_backend(name)
    assert "\n" not in str(info.value) and "not available" in str(info.value)


def test_list_and_register(monkeypatch):
    assert backends.list_backends()[:3] == ["rocm", "cuda", "cpu"]
    from longmoe.backends import registry
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_INSTANCES", {})
    Extra = backends.register(type("Extra", (CpuBackend,), {"name": "extra"}))
    assert backends.list_backends()[-1] == "extra"
    assert isinstance(backends.get_backend("EXTRA"), Extra)


# --- cpu backend -----------------------------------------------------------------------------
def test_cpu_probe_fields():
    p = CpuBackend().probe()
    assert PROBE_FIELDS <= set(p)
    assert p["name"] == "cpu" and p["arch"] == "cpu" and p["warp_size"] is None
    assert p["sm_count"] == os.cpu_count() and p["memory_bytes"] > 0
    assert p["interconnect"]["link"] == "loopback" and p["errors"] == []


def test_cpu_timer_measures_sleep():
    with CpuBackend().timer() as t:
        time.sleep(0.02)
    assert 15 <= t.elapsed_ms <= 500
    t2 = CpuBackend().timer().start()
    time.sleep(0.02)
    assert 15 <= t2.stop() <= 500


def test_cpu_peak_memory_sees_an_allocation():
    b = CpuBackend()
    b.reset_peak_memory()
    x = torch.ones(48 * 2**20)  # 192 MiB, touched by the fill
    assert b.peak_memory_bytes() >= x.numel() * x.element_size()
    assert "RSS" in b.memory_label


def test_capabilities_cpu():
    b = CpuBackend()
    assert not b.supports_grouped_mm(torch.bfloat16)
    assert b.supports_reduce_dtype(torch.float32) and not b.supports_reduce_dtype(torch.bfloat16)
    assert CudaBackend().supports_reduce_dtype(torch.bfloat16)
    assert b.comm_stream_priority == 0 and CudaBackend().comm_stream_priority == -1
    assert b.a2a_transport == "process_group"


# --- kernel configs --------------------------------------------------------------------------
def _tagged_table() -> dict:
    """Each (arch, bucket) slot's config names the slot, so a lookup shows where it landed."""
    table: dict = {"_doc": "test data", "k": {}}
    for arch, bucket in [("sm_90", "small"), ("sm_90", "any"), ("any", "small"), ("any", "any"),
                         ("sm_80", "tiny")]:
        table["k"].setdefault(arch, {})[bucket] = {"slot": f"{arch}/{bucket}"}
    return table


@pytest.mark.parametrize("arch,bucket,slot", [
    ("sm_90", "small", "sm_90/small"), ("sm_80", "tiny", "sm_80/tiny"),  # exact
    ("sm_90", "large", "sm_90/any"), ("sm_90", None, "sm_90/any"),  # arch + any
    ("sm_80", "small", "any/small"),  # sm_80 has no "any" bucket: any + bucket
    ("gfx942", "large", "any/any"),  # any + any
])
def test_lookup_order_on_constructed_file(tmp_path, arch, bucket, slot):
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(_tagged_table()))
    assert kernel_config_from(path, "k", arch, bucket) == {"slot": slot}


def test_lookup_errors_and_copies():
    table = _tagged_table()
    with pytest.raises(KeyError, match="missing_kernel"):
        lookup_kernel_config(table, "missing_kernel", "sm_90")
    with pytest.raises(KeyError, match="_doc"):
        lookup_kernel_config(table, "_doc", "sm_90")
    del table["k"]["any"]["any"]
    with pytest.raises(KeyError, match="no config"):
        lookup_kernel_config(table, "k", "sm_75", "huge")
    cfg = lookup_kernel_config(table, "k", "sm_90")
    cfg["slot"] = "mutated"
    assert lookup_kernel_config(table, "k", "sm_90") == {"slot": "sm_90/any"}


def test_shipped_kernel_configs():
    nv, amd = BACKENDS_DIR / "cuda" / "kernels.json", BACKENDS_DIR / "rocm" / "kernels.json"
    assert kernel_config_from(nv, "grouped_gemm", "sm_90", "m<=256")["BLOCK_M"] == 64
    assert kernel_config_from(nv, "grouped_gemm", "sm_90", "huge")["BLOCK_N"] == 128
    assert kernel_config_from(nv, "grouped_gemm", "sm_75", "m<=256")["BLOCK_M"] == 32
    assert kernel_config_from(nv, "linear_ce_rows", "sm_75")["BLOCK_V"] == 2048
    g = kernel_config_from(amd, "grouped_gemm", "gfx942")
    assert (g["num_warps"], g["num_stages"], g["matrix_instr_nonkdim"], g["kpack"]) == (8, 2, 16, 2)
    assert kernel_config_from(amd, "linear_ce_rows", "gfx942")["waves_per_eu"] == 2
    assert CpuBackend().kernel_config("linear_ce_rows")["BLOCK_V"] > 0
    with pytest.raises(KeyError, match="flash_attn"):
        CpuBackend().kernel_config("flash_attn")
    # Every shipped config carries the launch keys its vendor's kernels pass to Triton.
    amd_keys = {"waves_per_eu", "matrix_instr_nonkdim", "kpack"}
    for vendor in ("cpu", "cuda", "rocm"):
        table = json.loads((BACKENDS_DIR / vendor / "kernels.json").read_text())
        for kernel, keys in (("grouped_gemm", {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps",
                                                "num_stages"}),
                             *((k, {"BLOCK_V", "num_warps", "BLOCK_V_GRAD", "num_warps_grad"})
                               for k in ("linear_ce_rows", "linear_ce_rows_inplace",
                                         "linear_ce_rows_lowp"))):
            for by_bucket in table[kernel].values():
                for cfg in by_bucket.values():
                    assert keys <= set(cfg)
                    if vendor != "rocm":
                        assert not amd_keys & set(cfg)
    # ...and exactly those keys reach the launch: the vendor backend owns them
    assert set(RocmBackend.launch_keys) == amd_keys and not CudaBackend.launch_keys


def test_launch_options_come_from_the_vendor_backend():
    cfg = {"BLOCK_M": 64, "num_warps": 8, "num_warps_dw": 4, "num_stages": 2, "kpack": 2,
           "waves_per_eu": 1, "matrix_instr_nonkdim": 16}
    assert RocmBackend.launch_options(cfg) == {"num_warps": 8, "num_stages": 2, "kpack": 2,
                                               "waves_per_eu": 1, "matrix_instr_nonkdim": 16}
    assert CudaBackend.launch_options(cfg, "num_warps_dw") == {"num_warps": 4, "num_stages": 2}
    assert CpuBackend.launch_options({"num_warps": 4}, "num_warps_grad") == {"num_warps": 4}
    # a kernel's own stages key wins over the entry's num_stages; others keep num_stages
    staged = {"num_warps": 4, "num_stages": 1, "num_warps_scan": 4, "num_stages_scan": 3}
    assert CudaBackend.launch_options(staged, "num_warps_scan") == {"num_warps": 4,
                                                                     "num_stages": 3}
    assert CudaBackend.launch_options(staged) == {"num_warps": 4, "num_stages": 1}
    assert CudaBackend.launch_options({"num_warps": 4, "num_stages_qk": 3},
                                      "num_warps_qk") == {"num_warps": 4, "num_stages": 3}
    from longmoe.backends.aot import compile_targets
    targets = compile_targets()
    assert {"sm_90", "gfx942", "gfx950"} <= set(targets)
    for t in targets.values():  # a target compiles with its vendor's options
        want = backends.backend_classes()[t.vendor].launch_options(cfg)
        assert t.launch_options(cfg) == want


def test_fp32_output_gemm_probe_is_the_backends():
    from longmoe.ops.linear_ce_engines import _has_out_dtype
    from longmoe.ops.router_matmul import _native_reason
    cpu = torch.device("cpu")
    reason = CpuBackend().fp32_output_gemm(cpu)
    a = torch.ones(2, 2, dtype=torch.bfloat16)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        runs = True
    except Exception:  # noqa: BLE001 - the probe's own criterion
        runs = False
    assert (reason is None) == runs and (runs or "on cpu" in reason)
    # both users ask the same probe
    assert _native_reason(cpu) == reason and _has_out_dtype(cpu) == runs


# --- GPU probes degrade instead of raising ---------------------------------------------------
@pytest.mark.parametrize("cls", [CudaBackend, RocmBackend])
def test_gpu_probe_never_raises(cls):
    p = cls().probe()
    assert PROBE_FIELDS <= set(p) and isinstance(p["errors"], list)
    if not cls.is_available():
        assert p["errors"] and p["arch"] is None


def _raising(exc: Exception):
    def f(*args, **kwargs):
        raise exc
    return f


def test_nvml_missing_or_broken(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if not installed
    summary, errors = nvlink_summary(4)
    assert summary == {"gpus_per_node": 4, "link": "unknown"} and "pynvml" in errors[0]
    fake = types.SimpleNamespace(nvmlInit=_raising(RuntimeError("NVML Shared Library Not Found")))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    summary, errors = nvlink_summary(4)
    assert summary["link"] == "unknown" and "NVML Shared Library" in errors[0]


def test_nvml_reports_links(monkeypatch):
    class NVMLError(Exception):
        pass

    def state(handle, link):  # 18 links up, then "invalid argument" past the GPU's last link
        if link >= 18:
            raise NVMLError("invalid argument")
        return 1

    fake = types.SimpleNamespace(
        NVMLError=NVMLError, NVML_NVLINK_MAX_LINKS=20, NVML_FEATURE_ENABLED=1,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 8,
        nvmlDeviceGetHandleByIndex=lambda i: object(), nvmlDeviceGetNvLinkState=state,
        nvmlDeviceGetNvLinkVersion=lambda h, link: 4,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    summary, errors = nvlink_summary(2)
    assert errors == [] and summary["gpus_per_node"] == 8 and summary["link"] == "nvlink"
    assert (summary["nvlink_active_links"], summary["nvlink_version"]) == (18, 4)


def _fake_hip(monkeypatch, **functions):
    """A `hip` package whose `hip` module holds `functions`, like hip-python's layout."""
    inner = types.SimpleNamespace(hipError_t=types.SimpleNamespace(hipSuccess=0), **functions)
    monkeypatch.setitem(sys.modules, "hip", types.SimpleNamespace(hip=inner))


def test_rocm_probe_when_hip_imports_but_runtime_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    lib_missing = OSError("libamdhip64.so: cannot open shared object file")
    _fake_hip(monkeypatch, hipGetDeviceCount=_raising(lib_missing))
    summary, errors = link_summary(2)
    assert summary == {"gpus_per_node": 2, "link": "unknown"}
    assert any(e.startswith("amdsmi") for e in errors)
    assert any("libamdhip64" in e for e in errors)


def test_rocm_probe_reads_hip_links(monkeypatch):
    _fake_hip(monkeypatch, hipGetDeviceCount=lambda: (0, 8),
              hipExtGetLinkTypeAndHopCount=lambda a, b: (0, 4, 1))  # 4 = XGMI, 1 hop
    assert hip_summary(8) == ({"gpus_per_node": 8, "link": "xgmi", "hops": 1}, [])
    _fake_hip(monkeypatch, hipGetDeviceCount=lambda: (100, 0))  # hipErrorNoDevice
    summary, errors = hip_summary(0)
    assert summary is None and "hipGetDeviceCount" in errors[0]


# --- collective environment ------------------------------------------------------------------
def test_apply_collective_env_keeps_user_values(monkeypatch):
    b = CudaBackend()
    assert b.collective_env()["NCCL_NVLS_ENABLE"] == "0"
    for key in b.collective_env():
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    applied = b.apply_collective_env()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in applied
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert applied["NCCL_NVLS_ENABLE"] == "0" and os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert b.apply_collective_env() == {}  # idempotent
    assert CpuBackend().apply_collective_env() == {}


# --- doctor ----------------------------------------------------------------------------------
def test_doctor_json_and_tables(capsys):
    assert run_doctor(as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert report["backend"] == backends.active_backend().name
    assert isinstance(report["missing"], list) and "collective_env" in report
    assert report["a2a_transports"]["process_group"] == "available"
    assert set(report["a2a_transports"]) == {"process_group", "symmetric_memory"}
    assert any(p.endswith("chunks.json") for p in report["tuning_caches"])
    gd = report["gated_delta"]  # on CPU: the eager core, planned as such, with the reasons
    assert gd["core"] == "chunked" and gd["recipe_linear_core"] == "chunked"
    assert set(gd["skipped"]) == {"fla", "chunked_triton", "chunked_compiled"}
    assert gd["state_scan"].startswith("loop")
    assert run_doctor() == 0 and "longmoe doctor" in capsys.readouterr().out
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


@no_gpu
def test_doctor_reports_bad_forced_backend(monkeypatch, capsys):
    monkeypatch.setenv(backends.ENV_VAR, "rocm")
    assert run_doctor(as_json=True) == 1
    report = json.loads(capsys.readouterr().out)
    assert "rocm" in report["backend_error"] and report["backend"] == "cpu"


def test_versions_never_import_megatron():
    code = ("import sys, longmoe.backends as b; b.active_backend().versions(); "
            "print(any(m.startswith('megatron') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_kernel_overrides_apply_inside_the_block_only():
    from longmoe.backends import get_backend
    be = get_backend("cpu")
    base = be.kernel_config("moe_rows")
    with be.kernel_overrides("moe_rows", {"BLOCK_H": 8}):
        assert be.kernel_config("moe_rows") == {**base, "BLOCK_H": 8}
        assert "BLOCK_H" not in be.kernel_config("grouped_gemm")  # other kernels untouched
    assert be.kernel_config("moe_rows") == base
