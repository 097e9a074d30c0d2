"""The wheels users install, each in a fresh virtual environment without Rust or PyTorch on
every Python the machine has; then the quickstart runs.

scripts/test.sh builds the wheels once (a cp311-abi3 wheel, and a cp310 wheel where Python 3.10
is present) and names their folder in DATASET_RT_WHEELS; without it the abi3 wheel is built
here.
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
SUPPORTED = ("3.10", "3.11", "3.12", "3.13")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _interpreters() -> dict[str, str]:
    """One interpreter per Python minor version found on this machine, by version."""
    found: dict[str, str] = {}
    candidates = [sys.executable]
    for minor in ("3.9", *SUPPORTED):
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
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheels by the tag pip matches them with: ``cp311-abi3`` and maybe ``cp310``."""
    if "DATASET_RT_WHEELS" in os.environ:
        out = Path(os.environ["DATASET_RT_WHEELS"])
    else:
        out = tmp_path_factory.mktemp("dist")
        build = ["build", "--release", "--features", "abi3", "--out", str(out)]
        result = _run([sys.executable, "-m", "maturin", *build], cwd=REPO)
        assert result.returncode == 0, result.stderr[-3000:]
    found = {}
    for wheel in out.glob("*.whl"):
        # name-version-python tag-abi tag-platform tag.whl
        python_tag, abi_tag = wheel.name.split("-")[2:4]
        found["cp311-abi3" if abi_tag == "abi3" else python_tag] = wheel
    assert found.get("cp311-abi3", Path()).name.startswith("dataset_rt-"), found
    return found


def _wheel_for(version: str, wheels: dict[str, Path]) -> Path:
    """The wheel pip would choose for CPython ``version`` from these."""
    tag = "cp" + version.replace(".", "")
    return wheels[tag] if version == "3.10" else wheels["cp311-abi3"]


def test_one_abi3_wheel_for_3_11_on_and_a_version_specific_one_for_3_10(
    wheels: dict[str, Path],
) -> None:
    # cp311-abi3: one file serves 3.11 and every later CPython; 3.10 lacks the buffer protocol
    # in the limited API, so it gets its own build.
    assert "-cp311-abi3-" in wheels["cp311-abi3"].name
    assert set(wheels) <= {"cp311-abi3", "cp310"}, wheels
    if "cp310" in wheels:
        assert "-cp310-cp310-" in wheels["cp310"].name


@pytest.mark.parametrize("version", [v for v in SUPPORTED if v in INTERPRETERS])
def test_the_wheel_installs_without_rust_or_torch_and_the_quickstart_runs(
    wheels: dict[str, Path], version: str, tmp_path: Path
) -> None:
    if version == "3.10" and "cp310" not in wheels:
        pytest.skip("no cp310 wheel was built (scripts/test.sh builds it)")
    venv = tmp_path / "venv"
    assert _run([INTERPRETERS[version], "-m", "venv", str(venv)]).returncode == 0
    python, bindir = venv / "bin" / "python", venv / "bin"
    # numpy is the quickstart's own data library, not a dependency of dataset_rt.
    wheel = _wheel_for(version, wheels)
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
    ran = _run([str(python), "-W", "error", "-c", python_code], cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    ran = _run(["bash", "-euo", "pipefail", "-c", shell_code], cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "quickstart-v1" in ran.stdout
    helped = _run([str(bindir / "dataset-rt"), "--help"], env=env)
    assert helped.returncode == 0 and "verify" in helped.stdout


@pytest.mark.skipif("3.9" not in INTERPRETERS, reason="no Python 3.9 on this machine")
def test_python_3_9_is_refused_at_install_with_the_reason(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    venv = tmp_path / "venv39"
    assert _run([INTERPRETERS["3.9"], "-m", "venv", str(venv)]).returncode == 0
    for wheel in wheels.values():
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
