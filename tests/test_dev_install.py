"""The dev install (README: `pip install -e '.[dev]'`, which brings fla-core for its compile
check) builds and runs a transformers Qwen3.5-MoE model on CPU with nothing hidden from the
import system.

transformers before 5.25 binds Qwen3.5's Gated DeltaNet (and its gated RMSNorm) to
flash-linear-attention whenever fla imports, whatever the device; on CPU the first Triton launch
then fails (`RuntimeError: 0 active drivers`). From 5.25 it calls fla only for inputs on a device
fla supports, so the dev extra requires that release.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _dev_requirement(name: str) -> Requirement:
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    (req,) = [Requirement(r) for r in dev if Requirement(r).name == name]
    return req


def test_dev_extra_requires_a_transformers_that_keeps_fla_off_the_cpu():
    spec = _dev_requirement("transformers").specifier
    assert not spec.contains("5.24.0"), "5.24 runs fla's Triton kernels on CPU tensors"
    assert spec.contains("5.25.0")
    assert spec.contains(version("transformers"), prereleases=True), (
        f"installed transformers {version('transformers')} is outside the dev extra's {spec}")


# No sys.modules entry is touched: what a user's script does after the README's install.
BUILD = """
import json, sys
import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
torch.manual_seed(0)
m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
    vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_hidden_layers=4,
    shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=8))
ids = torch.randint(0, 64, (2, 9))
out = m(ids, labels=ids)
out.loss.backward()
new = m.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
print(json.dumps({"loss": out.loss.item(), "generated": new.shape[1],
                  "fla_loaded": "fla" in sys.modules}))
"""


def test_qwen35_model_builds_trains_and_generates_on_cpu_in_a_fresh_process():
    p = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["loss"] == got["loss"] and got["generated"] == 7  # finite loss; 4 + 3 tokens
    if importlib.util.find_spec("fla") is not None:  # the dev extra's case: fla was in play
        assert got["fla_loaded"], "transformers did not import fla: the case is not exercised"
