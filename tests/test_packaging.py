"""The wheel users install: built by `maturin build --release`, installed into fresh virtual
environments without Rust or PyTorch, on every Python the machine has; then the quickstart runs.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUPPORTED = ("3.11", "3.12", "3.13")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _interpreters() -> dict[str, str]:
    """One interpreter per Python minor version found on this machine, by version."""
    found: dict[str, str] = {}
    candidates = [sys.executable]
    for minor in ("3.10", *SUPPORTED):
        candidates += [shutil.which(f"python{minor}") or ""]
        candidates += sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/{minor}.*/bin/python{minor}"))
        )
    for exe in filter(None, candidates):
        try:
            version = subprocess.run(
                [exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        found.setdefault(version, exe)
    return found


INTERPRETERS = _interpreters()


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload, no-any-return]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = _run(
        [sys.executable, "-m", "maturin", "build", "--release", "--out", str(out)], cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def test_one_abi3_wheel_for_every_supported_python(wheel: Path) -> None:
    # cp311-abi3: one file serves 3.11 and every later CPython.
    assert "-cp311-abi3-" in wheel.name, wheel.name


@pytest.mark.parametrize("version", [v for v in SUPPORTED if v in INTERPRETERS])
def test_the_wheel_installs_without_rust_or_torch_and_the_quickstart_runs(
    wheel: Path, version: str, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    assert _run([INTERPRETERS[version], "-m", "venv", str(venv)]).returncode == 0
    python, bindir = venv / "bin" / "python", venv / "bin"
    # numpy is the quickstart's own data library, not a dependency of dataset_rt.
    installed = _run([str(python), "-m", "pip", "install", "-q", str(wheel), "numpy"])
    assert installed.returncode == 0, installed.stderr[-3000:]
    assert _run([str(python), "-c", "import torch"]).returncode != 0  # PyTorch stays optional

    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(bindir), "/usr/bin", "/bin"]),  # no cargo on this PATH
        "DATASET_RT_HOME": str(tmp_path / "home"),
    }
    env.pop("PYTHONPATH", None)
    page = (REPO / "docs" / "quickstart.md").read_text()
    python_code = "\n".join(code for lang, code in BLOCK.findall(page) if lang == "python")
    shell_code = "\n".join(code for lang, code in BLOCK.findall(page) if lang == "bash")
    assert python_code and shell_code
    ran = _run([str(python), "-c", python_code], cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    ran = _run(["bash", "-euo", "pipefail", "-c", shell_code], cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "quickstart-v1" in ran.stdout
    helped = _run([str(bindir / "dataset-rt"), "--help"], env=env)
    assert helped.returncode == 0 and "verify" in helped.stdout


@pytest.mark.skipif("3.10" not in INTERPRETERS, reason="no Python 3.10 on this machine")
def test_python_3_10_is_refused_at_install_with_the_reason(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv310"
    assert _run([INTERPRETERS["3.10"], "-m", "venv", str(venv)]).returncode == 0
    result = _run([str(venv / "bin" / "python"), "-m", "pip", "install", str(wheel)])
    assert result.returncode != 0
    assert "not a supported wheel" in result.stderr or "Requires-Python" in result.stderr


def test_the_sdist_holds_everything_a_source_build_needs(tmp_path: Path) -> None:
    result = _run([sys.executable, "-m", "maturin", "sdist", "--out", str(tmp_path)], cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in (
        "Cargo.lock",
        "pyproject.toml",
        "crates/drt-core/src/lib.rs",
        "crates/drt-python/src/lib.rs",
        "polars_plugin/src/lib.rs",
        "dataset_rt/__init__.py",
        "dataset_rt/_native.pyi",
        "dataset_rt/py.typed",
    ):
        assert needed in names, f"{needed} is missing from {sdist.name}"
