"""The versions CI tests (constraints.txt, which make installs with) and the line a run says when
it meets others (jaxtrain/versions.py)."""

from jaxtrain import versions


def test_make_installs_the_versions_constraints_txt_names():
    pins = versions.tested()
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"} <= set(pins)
    assert versions.untested(pins) == {}  # CI's venv is installed with -c constraints.txt
    assert versions.warning() is None


def test_a_run_on_other_versions_names_them_in_one_line(tmp_path):
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# comment\njax==0.0.1  # old\nno-such-package==1.0\nnumpy>=1\n")
    pins = versions.tested(constraints)
    assert pins == {"jax": "0.0.1", "no-such-package": "1.0"}  # a range pins nothing
    line = versions.warning(pins)
    assert line is not None and "\n" not in line
    installed = versions.untested(pins)["jax"][1]
    assert line.startswith(f"untested versions: jax {installed} (tested 0.0.1);")
    assert "no-such-package" not in line and "pip install -c constraints.txt" in line
    assert versions.tested(tmp_path / "missing.txt") == {}
