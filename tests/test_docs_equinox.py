"""docs/equinox.md: its code blocks run, in order, in one namespace; their
asserts compare the page's module with eqx.nn.MultiheadAttention."""

import pathlib
import re

import pytest

pytest.importorskip("equinox", reason="Equinox is a test extra: pip install 'fastattn-jax[flax]'")

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "equinox.md"


def test_the_pages_code_runs_and_its_checks_hold():
  blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), re.S | re.M)
  assert len(blocks) == 2, f"{PAGE}: expected the module and its check, got {len(blocks)} blocks"
  namespace = {}
  for block in blocks:
    exec(compile(block, str(PAGE), "exec"), namespace)
  assert "FastMultiheadAttention" in namespace and "ours_grad" in namespace
