"""Every code block in docs/ runs: python blocks in one namespace per page, shell blocks in bash."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
PAGES = sorted(DOCS.rglob("*.md"))
# Pages generated from the package's docstrings (whose examples run as doctests) hold no blocks.
REFERENCE = {"api.md"}


def blocks(page: Path) -> list[tuple[str, str, int]]:
    text = page.read_text()
    return [
        (m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in BLOCK.finditer(text)
    ]


def test_docs_exist() -> None:
    assert (DOCS / "quickstart.md") in PAGES


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    found = blocks(page)
    assert found or page.name in REFERENCE, f"{page.name} has no code blocks"
    for lang, code, line in found:
        where = f"{page.name}:{line}"
        if lang == "python":
            exec(compile(code, where, "exec"), namespace)
        elif lang in ("bash", "sh", "console"):
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            assert result.returncode == 0, f"{where}\n{result.stdout}\n{result.stderr}"
        else:
            pytest.fail(f"{where}: code block of unknown language {lang!r} cannot be run")


def test_site_builds_strictly(tmp_path: Path) -> None:
    """The mkdocs site builds with warnings as errors: every page in the nav, no broken
    link, and an API reference generated from docstrings that all parse."""
    repo = DOCS.parent
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    api = (tmp_path / "api" / "index.html").read_text()
    for name in ("save_metadata", "VerifyReport", "balance", "state_dict", "CacheCorruptError"):
        assert name in api, f"{name} is missing from the API reference"
    nav = (tmp_path / "index.html").read_text()
    for title in ("Quickstart", "Serialize Python records", "Run your own benchmarks"):
        assert title in nav
