"""The CI entry points: .ci/run is the cpu tier of ci/run.sh, the scripts parse, the Dockerfiles
pin their base images and run the gpu tier, and the golden-loss checker passes and fails."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dot_ci_run_is_the_cpu_tier():
    text = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"exec bash ci/run\.sh cpu", text)
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest -q tests" in readme
    assert '"$PY" -m pytest -q tests' in (ROOT / "ci" / "run.sh").read_text()


def test_the_slow_tier_is_left_out_by_default_and_run_by_the_cpu_tier():
    opts = re.search(r"^addopts = (.*)$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert "-m 'not slow'" in opts  # the README's plain command is the fast tier
    run = (ROOT / "ci" / "run.sh").read_text()
    cpu = run[run.index("tier_cpu() {"):run.index("\n}\n", run.index("tier_cpu() {"))]
    assert '"$PY" -m pytest -q tests\n' in cpu and '"$PY" -m pytest -q tests -m slow\n' in cpu
    gpu = run[run.index("tier_gpu() {"):]
    assert '"$PY" -m pytest -q tests -m "slow or not slow"' in gpu  # the whole suite


@pytest.mark.parametrize("script", [".ci/run", "ci/run.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


@pytest.mark.parametrize("name,base", [("Dockerfile.cuda", r"pytorch/pytorch:2\.\d+\.\d+-cuda"),
                                       ("Dockerfile.rocm", r"rocm/pytorch:rocm[\d.]+_")])
def test_dockerfiles_pin_official_bases_and_run_the_gpu_tier(name, base):
    text = (ROOT / "docker" / name).read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) == 1 and re.match(base, froms[0]) and not froms[0].endswith(":latest")
    assert 'CMD ["bash", "ci/run.sh", "gpu", "--no-install"]' in text


def _golden(tmp_path, losses, want, atol=0.01):
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses)))
    g = tmp_path / "g.json"
    g.write_text(json.dumps({"tolerance": {"loss": {"rtol": 0.0, "atol": atol}},
                             "steps": [{"step": i + 1, "loss": x} for i, x in enumerate(want)]}))
    return subprocess.run([sys.executable, str(ROOT / "ci" / "check_golden.py"), str(m), str(g)],
                          capture_output=True, text=True)


def test_golden_checker_passes_and_fails(tmp_path):
    assert _golden(tmp_path, [0.25, 0.24], [0.251, 0.245]).returncode == 0
    bad = _golden(tmp_path, [0.25, 0.30], [0.251, 0.245])
    assert bad.returncode == 1 and "step    2" in bad.stdout


def test_shipped_cuda_golden_is_well_formed():
    g = json.loads((ROOT / "ci" / "golden" / "cuda_gpu_smoke.json").read_text())
    assert len(g["steps"]) == 20 and g["tolerance"]["loss"]["atol"] > 0


def _check_wheel():
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import check_wheel
    finally:
        sys.path.pop(0)
    return check_wheel


def test_cpu_tier_runs_the_wheel_check():
    text = (ROOT / "ci" / "run.sh").read_text()
    tier = text[text.index("tier_cpu() {"):]
    tier = tier[:tier.index("\n}\n")]
    assert '"$PY" ci/check_wheel.py' in tier
    assert tier.index("ci/check_wheel.py") < tier.index("pytest")  # before the long part


def test_wheel_check_names_a_missing_module_and_a_stray_file(tmp_path):
    import zipfile
    cw = _check_wheel()
    files, dirs = cw.source_files(), cw.package_dirs()
    expected = cw.expected_wheel_files(files, dirs)
    assert {"longmoe/api/__init__.py", "longmoe/backends/cuda/kernels.json",
            "longmoe/tuning/cache/chunks.json", "longmoe/recipes/cpu_demo.yaml"} <= expected
    assert not any(p.startswith(("tests/", "bench/", "backends/", "tuning/")) for p in expected)
    assert "longmoe.api" in cw.source_modules(files, dirs)

    def wheel(names):
        path = tmp_path / "w.whl"
        with zipfile.ZipFile(path, "w") as z:
            for n in names:
                z.writestr(n, "")
        return path
    cw.check_contents(wheel([*expected, "longmoe-0.1.0.dist-info/RECORD"]), expected)
    with pytest.raises(RuntimeError, match="longmoe/api/__init__.py"):
        cw.check_contents(wheel(sorted(expected - {"longmoe/api/__init__.py"})), expected)
    with pytest.raises(RuntimeError, match="tests/conftest.py"):
        cw.check_contents(wheel([*expected, "tests/conftest.py"]), expected)


def test_wheel_check_finds_the_api_doc_examples():
    blocks = _check_wheel().runnable_blocks((ROOT / "docs" / "api.md").read_text())
    assert blocks and all("longmoe" in b for b in blocks)
