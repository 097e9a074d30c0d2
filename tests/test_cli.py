"""The dataset-rt command line: ls, info, demo, exit codes, --root and DATASET_RT_HOME."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dataset_rt as drt
from dataset_rt.cli import main


def test_ls_and_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls"]) == 0
    assert "no caches" in capsys.readouterr().out
    c = drt.cache(range(7), "cli-cache", metadata=lambda i: {"even": i % 2 == 0}, progress=False)
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "cli-cache" in out and c.cache_id in out
    assert main(["info", "cli-cache"]) == 0
    out = capsys.readouterr().out
    assert "samples     7" in out
    assert "even" in out and "Boolean" in out
    assert "metadata    version 1" in out


def test_root_option_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other-root"
    drt.cache(range(2), "elsewhere", root=other, progress=False)
    assert main(["info", "elsewhere"]) == 1
    assert "no cache 'elsewhere'" in capsys.readouterr().err
    assert main(["info", "elsewhere", "--root", str(other)]) == 0
    assert main(["info", "bad/name"]) == 1
    assert "invalid cache name 'bad/name'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["frobnicate"])
    assert usage.value.code == 2


def test_console_script_help_for_each_command() -> None:
    exe = Path(sys.executable).parent / "dataset-rt"
    for args in ([], ["ls"], ["info"], ["verify"], ["bench"], ["demo"]):
        result = subprocess.run(
            [str(exe), *args, "--help"], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stderr
        assert "usage: dataset-rt" in result.stdout


def test_demo_caches_real_digits_and_reads_them_back(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "Cache('sklearn-digits-v1', samples=1,797" in out
    assert "Records and mean ink per label" in out
    assert "ink = the sum of the image's pixel intensities" in out
    assert "serializer 'pickle': pickle protocol 5" in out and "pickle-oob" not in out
    assert "Record 0 read back with digits.get(0): label=0, image (8, 8)" in out
    assert "sum to 1.000000" in out
    digits = drt.open("sklearn-digits-v1")
    counts = digits.metadata.group_by("label").len()
    assert counts.height == 10 and counts["len"].sum() == 1797
    # The second run reuses the cache instead of rebuilding it.
    assert main(["demo"]) == 0
    assert drt.open("sklearn-digits-v1").cache_id == digits.cache_id


def test_bench_measures_each_stage_and_names_a_bottleneck(
    capsys: pytest.CaptureFixture[str],
) -> None:
    drt.cache(({"x": np.arange(64)} for _ in range(2000)), "to-bench", progress=False)
    assert main(["bench", "to-bench", "--samples", "2000", "--workers", "0,1"]) == 0
    out = capsys.readouterr().out
    for stage in ("raw reads", "reads + decode", "loader, 0 workers", "loader, 1 workers"):
        assert stage in out
    assert re.search(r"bottleneck: (I/O|decode|collate)\.", out)
    assert "read 2,000 samples" in out
    with pytest.raises(SystemExit) as usage:
        main(["bench", "to-bench", "--workers", "x"])
    assert usage.value.code == 2


def test_info_lists_metadata_versions(capsys: pytest.CaptureFixture[str]) -> None:
    c = drt.cache(range(10), "versions", progress=False)
    c.save_metadata(c.metadata.head(5))
    assert main(["info", "versions"]) == 0
    assert "version 2 (saved: 1, 2)" in capsys.readouterr().out


def test_every_subcommand_works_on_the_demo_cache_from_a_shell(tmp_path: Path) -> None:
    exe = str(Path(sys.executable).parent / "dataset-rt")
    root = str(tmp_path / "root")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [exe, *args, "--root", root], capture_output=True, text=True, check=False
        )

    assert run("demo").returncode == 0
    listed = run("ls")
    assert listed.returncode == 0 and "sklearn-digits-v1" in listed.stdout
    info = run("info", "sklearn-digits-v1")
    assert info.returncode == 0 and "1,797" in info.stdout
    verified = run("verify", "sklearn-digits-v1", "-q")
    assert verified.returncode == 0 and "intact" in verified.stdout
    benched = run("bench", "sklearn-digits-v1", "--samples", "1000", "--workers", "0")
    assert benched.returncode == 0 and "bottleneck:" in benched.stdout
    missing = run("info", "absent")
    assert missing.returncode == 1 and "no cache 'absent'" in missing.stderr
    assert run("no-such-command").returncode == 2


def test_ls_prints_one_aligned_line_per_cache_with_human_sizes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    drt.cache([bytes(3000)] * 700, "a-rather-long-cache-name-for-the-table", progress=False)
    drt.cache(range(3), "tiny", progress=False)
    assert main(["ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3, lines  # header and one line per cache: nothing wraps
    header, long, tiny = lines
    assert header.split()[:3] == ["NAME", "SAMPLES", "SIZE"]
    assert "700" in long and re.search(r"\b2\.\d MiB\b", long), long
    assert re.search(r"\d+ B\b", tiny), tiny
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", tiny)
    assert long.index("MiB") + 3 == tiny.index(" B") + 2, "sizes are right-aligned"


@pytest.mark.parametrize(
    "args",
    [["--batch-size", "0"], ["--samples", "-3"], ["--samples", "many"], ["--workers", "-1"]],
)
def test_bad_bench_arguments_are_usage_errors(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    drt.cache(range(10), "to-bench", progress=False)
    with pytest.raises(SystemExit) as usage:
        main(["bench", "to-bench", *args])
    assert usage.value.code == 2
    assert "usage: dataset-rt bench" in capsys.readouterr().err


def test_bench_without_pytorch_says_what_it_measured(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dataset_rt import bench

    monkeypatch.setattr(bench, "_torch_installed", lambda: False)
    drt.cache(({"x": list(range(50))} for _ in range(500)), "no-torch", progress=False)
    with pytest.raises(SystemExit) as usage:
        main(["bench", "no-torch", "--samples", "500", "--workers", "0,2"])
    assert usage.value.code == 2
    assert "PyTorch is not installed" in capsys.readouterr().err
    assert main(["bench", "no-torch", "--samples", "500"]) == 0
    out = capsys.readouterr().out
    assert "loader, 0 workers" in out and "loader, 2 workers" not in out
    assert "loaders with workers were not measured" in out
    assert "Use more workers" not in out


def test_bench_shares_never_exceed_the_whole() -> None:
    from dataset_rt.bench import Stage, _verdict

    # The loader ran faster than reads + decode measured alone (noise, caching): the
    # decode stage must still be a share of the whole, not 271% of it.
    raw = Stage("raw reads", 1000, 10**6, 0.01)
    decoded = Stage("reads + decode", 1000, 10**6, 0.30)
    loader = Stage("loader, 0 workers", 1000, 10**6, 0.11)
    worst, advice = _verdict(raw, decoded, loader, has_torch=True)
    share = int(re.search(r"It takes (\d+)%", advice).group(1))  # type: ignore[union-attr]
    assert worst == "decode" and 0 < share <= 100
