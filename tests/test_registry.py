"""The implementation registries: every reference is called "reference", a former name is
rejected with its new one (never mapped silently), unknown names list the valid ones."""

from __future__ import annotations

import pytest

from longmoe.errors import ConfigError
from longmoe.ops import GROUPED_MM, LINEAR_CE, POLICY_LOSS, RECOMPUTE, ImplUnavailable, Registry
from longmoe.ops.gated_delta import GATED_DELTA
from longmoe.ops.moe_rows import MOE_ROWS
from longmoe.ops.router_matmul import ROUTER_MATMUL

REGISTRIES = [LINEAR_CE, POLICY_LOSS, GROUPED_MM, RECOMPUTE, GATED_DELTA, MOE_ROWS, ROUTER_MATMUL]
# field of the run config's impl section -> (registry, a name it was known by before)
FORMER = {"linear_ce": (LINEAR_CE, "naive"), "grouped_mm": (GROUPED_MM, "loop"),
          "moe_rows": (MOE_ROWS, "torch"), "router_matmul": (ROUTER_MATMUL, "fp32"),
          "gated_delta": (GATED_DELTA, "recurrent"), "recompute": (RECOMPUTE, "none")}


@pytest.mark.parametrize("reg", REGISTRIES, ids=lambda r: r.primitive)
def test_every_reference_is_called_reference(reg):
    assert reg.reference == "reference" and "reference" in reg.names()
    assert sum(1 for n in reg.names() if reg._impls[n].reference) == 1


def test_a_reference_under_another_name_is_refused():
    reg = Registry("demo")
    with pytest.raises(ValueError, match="'reference'"):
        reg.register("plain", reference=True)
    with pytest.raises(ValueError, match="'reference'"):
        reg.register("reference")  # the name is kept for the reference


@pytest.mark.parametrize("field", list(FORMER))
def test_former_name_is_one_line_naming_the_new_one(field):
    from longmoe.train.config import ImplConfig
    reg, old = FORMER[field]
    with pytest.raises(ConfigError) as e:
        ImplConfig(**{field: old})
    msg = str(e.value)
    assert msg == f"impl.{field}: impl {old!r} is now called 'reference'", msg
    with pytest.raises(ImplUnavailable, match=f"{old!r} is now called 'reference'"):
        reg.select(old)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"impl\.linear_ce: unknown implementation 'nope'; "
                                          r"valid: auto, .*reference"):
        LINEAR_CE.check_name("nope", "impl.linear_ce")
    POLICY_LOSS.check_name("unfused", "impl.policy_loss", extra=("unfused",))


def test_cli_former_name_is_one_error_line(capsys):
    from longmoe.cli import main
    assert main(["paired", "linear_ce", "--impl", "naive"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert err == ["error: --impl: linear_ce: impl 'naive' is now called 'reference'"], err
    assert main(["bench", "moe-layer", "--smoke", "--device", "cpu", "--rows-impl", "torch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --rows-impl: impl 'torch' is now called 'reference'"], err
