import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_is_clean():
    """ruff (in the test extra) finds nothing to fix or reformat."""
    for args in (["check", "."], ["format", "--check", "."]):
        out = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
