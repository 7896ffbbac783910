"""examples/plugin-template builds, installs and passes its own tests against this trioinfer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "examples" / "plugin-template"


def test_the_plugin_template_installs_and_passes_its_tests(tmp_path: Path) -> None:
    # A copy, so that building leaves nothing in the repository; installed into a
    # target of its own with the build backend already here (the test extra has
    # hatchling), so that nothing is fetched: only what pip builds is tested.
    package = tmp_path / "plugin-template"
    shutil.copytree(
        TEMPLATE, package, ignore=shutil.ignore_patterns("__pycache__", ".*cache", "*.egg-info")
    )
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
            "--no-build-isolation", "--no-index", "--target", str(site), str(package),
        ],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    dist_info = next(site.glob("trioinfer_template-*.dist-info"))
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "lifo = trioinfer_template:LifoScheduler" in entry_points
    assert "scale = trioinfer_template:ScaleBackend" in entry_points

    # Its tests, run from the copy but importing the installed package: src/ is
    # not on the path, so a package that did not install would fail them.
    shutil.rmtree(package / "src")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary, summary
    assert "skipped" not in summary, summary  # every check ran
