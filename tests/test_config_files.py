"""A config file that holds no settings, or whose top level is not a mapping, is one line naming
the file and what it holds (exit 2), never a run of the defaults or a traceback; the same for a
section, a model field or a `--set` value of the wrong shape."""

from __future__ import annotations

import pytest

from longmoe.errors import ConfigError


@pytest.mark.parametrize("text,holds", [
    ("", r"holds no settings \(empty or only comments\)"),
    ("# lr: 1e-3\n\n", r"holds no settings"),
    ("- 1\n- 2\n", r"the top level holds a list \(2 items\), expected a mapping of sections"),
    ("optim\n", r"the top level holds a string \('optim'\)"),
    ("3\n", r"the top level holds a number \(3\)"),
    ("true\n", r"the top level holds a bool \(true\)"),
])
def test_a_file_that_is_not_a_mapping_names_the_file(tmp_path, text, holds):
    from longmoe.train.config import load_run_config
    p = tmp_path / "run.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_run_config(str(p))
    msg = str(e.value)
    assert msg.startswith(f"--config: {p}: ") and "\n" not in msg, msg
    assert __import__("re").search(holds, msg), msg


def test_an_explicit_empty_mapping_is_the_defaults(tmp_path):
    from longmoe.train.config import load_run_config
    p = tmp_path / "defaults.yaml"
    p.write_text("{}\n")
    assert load_run_config(str(p)) == load_run_config(None)


@pytest.mark.parametrize("text,field", [
    ("model: 5\n", "model"),
    ("model: [tiny]\n", "model"),
    ("optim: [1, 2]\n", "optim"),
    ("model:\n  preset: [tiny]\n", "model.preset"),
    ("model:\n  hf_config: 3\n", "model.hf_config"),
    ("optim:\n  betas: 0.9\n", "optim.betas"),
])
def test_a_section_or_field_of_the_wrong_shape_names_it(tmp_path, text, field):
    from longmoe.train.config import load_run_config
    p = tmp_path / "run.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_run_config(str(p))
    assert e.value.field == field and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides,pattern", [
    (["optim=5"], r"^--set: 'optim=5': optim is a section and takes a mapping .*a number \(5\)"),
    (["model=[1, 2]"], r"^--set: 'model=\[1, 2\]': model is a section .*a list \(2 items\)"),
    (["optim.lr=0.1", "optim.lr.x=1"], r"^--set: 'optim.lr.x=1': optim.lr holds a number \(0.1\), "
                                       r"not a mapping"),
    ([".lr=1"], r"^--set: '.lr=1': expected dotted.key=value"),
    (["optim.betas=0.9"], r"^optim.betas: expected a list, got a number \(0.9\)"),
    (["model.preset=[1]"], r"^model.preset: expected a preset name"),
])
def test_set_values_of_the_wrong_shape_are_one_line(overrides, pattern):
    from longmoe.train.config import load_run_config
    with pytest.raises(ConfigError, match=pattern) as e:
        load_run_config(None, overrides)
    assert "\n" not in str(e.value)
    # A section given as a mapping stays fine.
    assert load_run_config(None, ["optim={lr: 0.5}"]).optim.lr == 0.5


def test_cli_exits_2_with_one_line_naming_the_file(tmp_path, capsys):
    from longmoe.cli import main
    for name, text, holds in (("empty.yaml", "", "holds no settings"),
                              ("list.yaml", "- 1\n- 2\n", "the top level holds a list")):
        p = tmp_path / name
        p.write_text(text)
        assert main(["train", "--config", str(p), "--steps", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --config: {p}: {holds}") and "\n" not in err, err
    ok = tmp_path / "ok.yaml"
    ok.write_text("model:\n  preset: tiny\n")
    assert main(["train", "--config", str(ok), "--set", "optim=5", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set: 'optim=5'") and "\n" not in err, err
