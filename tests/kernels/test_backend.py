"""Backend selection, import hygiene and packaging of freescale_kernels."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import freescale_kernels as fk
from freescale_kernels import BACKEND_ENV, resolve_backend

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_auto_picks_reference_on_cpu_and_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, torch.zeros(1)) == "reference"
    assert resolve_backend("auto", torch.zeros(1)) == "reference"
    if torch.cuda.is_available():
        assert resolve_backend(None, torch.zeros(1, device="cuda")) == "triton"


def test_argument_beats_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert resolve_backend(None, torch.zeros(1)) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.zeros(1)) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend(None, torch.zeros(1)) == "triton"
    assert resolve_backend("reference", torch.zeros(1)) == "reference"


def test_bad_names_and_impossible_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="backend argument"):
        resolve_backend("cuda", torch.zeros(1))
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend(None, torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("triton", torch.zeros(1))


def test_environment_routes_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "nonsense")
    with pytest.raises(ValueError):
        fk.unique_with_inverse(torch.tensor([1, 2]))
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert fk.unique_with_inverse(torch.tensor([2, 1, 2])).values.tolist() == [1, 2]


def test_import_does_not_load_triton() -> None:
    code = (
        "import sys, torch, freescale_kernels, freescale_kernels.cli; "
        "freescale_kernels.ranged_dispatch(torch.arange(3), torch.tensor([1, 2]), "
        "torch.tensor([1, 0]), 2); "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_shared_cli_is_a_relative_symlink() -> None:
    link = KERNELS / "src" / "freescale_kernels" / "_freescale_cli.py"
    assert link.is_symlink()
    target = Path(link.readlink())
    assert not target.is_absolute()
    assert target.as_posix() == "../../../freescale_balance/src/freescale_balance/_freescale_cli.py"
    assert link.resolve().is_file()


def test_docstring_examples() -> None:
    import doctest

    from freescale_kernels import api

    result = doctest.testmod(api, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 10 and result.failed == 0
