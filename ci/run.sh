#!/usr/bin/env bash
# The one CI entry point. Every job (local, .ci/run, GitHub Actions, the docker images) calls this.
#
#   bash ci/run.sh cpu       [--no-install]   CPU torch + longmoe[dev], doctor, the wheel check,
#                                             the README test command, the slow tier (-m slow)
#   bash ci/run.sh gpu       [--no-install] [--write-golden] [--install-only]
#                                             in a GPU image: whole test suite on the device, bench
#                                             smoke (if `longmoe bench` exists), 20-step golden run
#   bash ci/run.sh multi-gpu [--no-install] [--install-only]
#                                             in a GPU image: the tests that need two or more GPUs
#
# Environment: OUT_DIR (default ci-out/) collects doctor, metrics and verdict files;
# PYTHON (default python); TORCH_INDEX_URL (cpu tier: install torch from this index directly,
# e.g. https://download.pytorch.org/whl/cpu on machines with no local CPU wheel);
# TEST_TIMEOUT (default 75m: a hung distributed test fails the tier well inside a 90-minute job
# instead of being killed silently with it).
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

TIER=${1:-}
[[ $TIER == cpu || $TIER == gpu || $TIER == multi-gpu ]] || usage
shift
INSTALL=1 INSTALL_ONLY=0 WRITE_GOLDEN=0
for arg in "$@"; do
    case $arg in
        --no-install) INSTALL=0 ;;
        --install-only) INSTALL_ONLY=1 ;;
        --write-golden) WRITE_GOLDEN=1 ;;
        *) echo "ci/run.sh: unknown option $arg" >&2; usage ;;
    esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python}
command -v "$PY" >/dev/null || PY=python3
OUT_DIR=${OUT_DIR:-ci-out}
mkdir -p "$OUT_DIR"
TEST_TIMEOUT=${TEST_TIMEOUT:-75m}
CPU_TORCH=2.13.0  # the CPU build CI tests against (pyproject: torch>=2.11, the GPU images' floor)

# Phases: each prints its elapsed time; the EXIT trap names the phase that failed.
PHASE="" PHASE_T0=0
begin() { PHASE=$1; PHASE_T0=$SECONDS; echo; echo "==> [$TIER] $PHASE"; }
end() { echo "<== [$TIER] $PHASE: ok, $((SECONDS - PHASE_T0)) s"; PHASE=""; }
on_exit() {
    local rc=$?
    if [[ $rc -ne 0 && -n $PHASE ]]; then
        echo "<== [$TIER] $PHASE: FAILED (exit $rc), $((SECONDS - PHASE_T0)) s" >&2
    fi
    echo "[$TIER] total $SECONDS s, exit $rc"
}
trap on_exit EXIT

# `timeout` so a hang ends as a named failure; exit 124 is the timeout, said in words.
run_tests() {
    echo "+ $*"
    local rc=0
    timeout --kill-after=60 "$TEST_TIMEOUT" "$@" || rc=$?
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        echo "tests did not finish within TEST_TIMEOUT=$TEST_TIMEOUT (a hung rank?)" >&2
    elif [[ $rc -eq 5 ]]; then
        echo "pytest collected no tests for this tier: nothing was checked" >&2
    fi
    return $rc
}

install_cpu() {
    begin "install CPU torch $CPU_TORCH"
    if [[ -n ${TORCH_INDEX_URL:-} ]]; then
        "$PY" -m pip install "torch==$CPU_TORCH" --index-url "$TORCH_INDEX_URL"
    elif ! "$PY" -m pip install "torch==$CPU_TORCH"; then
        echo "no local torch $CPU_TORCH; trying the PyTorch CPU index" >&2
        "$PY" -m pip install "torch==$CPU_TORCH" --index-url https://download.pytorch.org/whl/cpu
    fi
    end
    # torch first: with it satisfied, the project's plain `torch` requirement cannot pull the
    # multi-GB CUDA wheel.
    begin "install longmoe[dev]"
    "$PY" -m pip install -e '.[dev]'
    end
}

# The GPU images bring their own torch (and triton) built for the vendor; installing longmoe must
# not replace them. Pin whatever torch/triton distributions the image has as constraints, so a
# requirement they cannot meet fails the install instead of pulling a PyPI wheel over them, and
# check afterwards that the stack is byte-for-byte the same (a ROCm image whose triton is named
# pytorch-triton-rocm would otherwise get PyPI's CUDA triton installed beside it).
install_gpu() {
    begin "install longmoe over the image's torch"
    local extras=dev stack='^(torch|triton|pytorch-triton|pytorch-triton-rocm|triton-rocm)=='
    if "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.hip else 1)'; then
        extras=dev,rocm
    fi
    local before after
    before=$(mktemp) after=$(mktemp)
    "$PY" -m pip list --format=freeze 2>/dev/null | grep -E "$stack" | sort >"$before" || true
    if ! grep -q '^torch==' "$before"; then
        echo "no torch installed: the $TIER tier installs over a GPU image's torch" >&2
        return 1
    fi
    echo "keeping: $(tr '\n' ' ' <"$before")"
    echo "+ pip install -c <the list above> -e '.[$extras]'"
    "$PY" -m pip install -c "$before" -e ".[$extras]"
    "$PY" -m pip list --format=freeze 2>/dev/null | grep -E "$stack" | sort >"$after" || true
    if ! diff -u "$before" "$after"; then
        echo "installing longmoe changed the image's torch/triton stack (diff above)" >&2
        return 1
    fi
    end
}

# `python -m longmoe` rather than the `longmoe` script: the same interpreter as the tests.
longmoe() { "$PY" -m longmoe "$@"; }

doctor() {
    begin "longmoe doctor"
    longmoe doctor
    longmoe doctor --json >"$OUT_DIR/doctor_$TIER.json"
    end
}

# "backend device_count" from the doctor report just written.
doctor_devices() {
    "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(r["backend"], r["probe"].get("device_count") or 0)' "$OUT_DIR/doctor_$TIER.json"
}

# A GPU tier on a machine where longmoe sees no GPU would pass with every device test skipped.
require_devices() {
    local need=$1 backend count
    read -r backend count < <(doctor_devices)
    if [[ $backend == cpu || $count -lt $need ]]; then
        echo "the $TIER tier needs $need GPU(s); longmoe sees backend=$backend with $count device(s)." >&2
        echo "Run it in the GPU image with the devices passed in (docker/README.md)." >&2
        exit 1
    fi
    echo "backend $backend, $count device(s)"
}

tier_cpu() {
    if [[ $INSTALL -eq 1 ]]; then install_cpu; fi
    if [[ $INSTALL_ONLY -eq 1 ]]; then return 0; fi
    doctor
    # The built wheel, installed non-editable in a clean venv, used from outside the checkout:
    # every module imports, the demo and docs/api.md's examples run (ci/check_wheel.py).
    begin "wheel"
    "$PY" ci/check_wheel.py
    end
    begin "tests"
    run_tests "$PY" -m pytest -q tests
    end
    begin "slow tests"
    run_tests "$PY" -m pytest -q tests -m slow
    end
    verl_tests
}

# verl drives longmoe (tests/test_verl_*.py, unmodified verl on CPU). verl 0.9.1 pins
# transformers below 5.11 while the dev extra needs >= 5.25, so the verl extra goes into a venv
# layered over this environment (--system-site-packages): there only verl and what it pins
# differ (creating it and installing the extra took 1 min 44 s on two cores, pip cache warm).
verl_tests() {
    local venv="$OUT_DIR/verl-venv"
    if [[ $INSTALL -eq 1 || ! -x $venv/bin/python ]]; then
        begin "install longmoe[verl] (venv over this environment)"
        "$PY" -m venv --system-site-packages "$venv"
        "$venv/bin/python" -m pip install -e '.[verl]'
        end
    fi
    begin "tests: verl integration"
    run_tests "$venv/bin/python" -m pytest -q tests/test_verl_engine.py tests/test_verl_ranks.py tests/test_verl_syncs.py \
        tests/test_verl_temperature.py tests/test_verl_router_replay.py tests/test_verl_main_ppo.py \
        -m "slow or not slow"
    end
}

tier_gpu() {
    if [[ $INSTALL -eq 1 ]]; then install_gpu; fi
    if [[ $INSTALL_ONLY -eq 1 ]]; then return 0; fi
    doctor
    require_devices 1
    local backend count
    read -r backend count < <(doctor_devices)

    begin "tests, the slow tier too (GPU tests un-skip themselves)"
    run_tests "$PY" -m pytest -q tests -m "slow or not slow"
    end

    begin "bench smoke"
    if longmoe bench --help >/dev/null 2>&1; then
        longmoe bench linear-ce --smoke --out "$OUT_DIR/bench_linear_ce_smoke.json" 2>&1 | tee "$OUT_DIR/bench_smoke.log"
    else
        echo "skipped: this longmoe has no bench subcommand"
    fi
    end

    begin "train gpu_smoke, 20 steps"
    longmoe train --config gpu_smoke --steps 20 --metrics-out "$OUT_DIR/gpu_smoke.jsonl"
    end

    begin "golden loss ($backend)"
    local golden=ci/golden/${backend}_gpu_smoke.json
    if [[ $WRITE_GOLDEN -eq 1 ]]; then
        "$PY" ci/check_golden.py "$OUT_DIR/gpu_smoke.jsonl" "$golden" --write-golden \
            --backend "$backend" --recipe gpu_smoke --report "$OUT_DIR/golden_check.json"
    else
        "$PY" ci/check_golden.py "$OUT_DIR/gpu_smoke.jsonl" "$golden" \
            --report "$OUT_DIR/golden_check.json"
    fi
    end
}

tier_multi_gpu() {
    if [[ $INSTALL -eq 1 ]]; then install_gpu; fi
    if [[ $INSTALL_ONLY -eq 1 ]]; then return 0; fi
    doctor
    require_devices 2
    begin "tests marked needs_multi_gpu"
    run_tests "$PY" -m pytest -q tests -m needs_multi_gpu
    end
}

case $TIER in
    cpu) tier_cpu ;;
    gpu) tier_gpu ;;
    multi-gpu) tier_multi_gpu ;;
esac
