"""Build the sdist and the wheel, install the wheel in clean venvs, and say what each costs.

`make install-check` runs this, and CI with it. It builds with `python -m build` (the
wheel from the sdist, so a file the sdist lacks fails here), then installs the wheel
into one fresh venv per install below, with this interpreter's pip (`pip --python`),
so that each venv's site-packages holds only what that install brought. There it
checks what the README promises:

- the core alone: the README's quickstart fails with `BackendUnavailable` naming the
  cpu extra, and `trioinfer demo`, `serve` and `bench` each fail in one line naming
  their extra;
- core + cpu, what a library user installs: the quickstart, taken from README.md so
  that it cannot drift, prints the labels it should; `trioinfer demo` runs;
  `trioinfer plugins` loads every plugin; the GPU build is not there;
- core + cpu + serve, and + bench: `trioinfer serve` and `bench` get past their
  imports.

It prints the distributions each install brought and the size of its site-packages
(MB: 10^6 bytes; with the .pyc files pip compiles, and without). The gpu and cuda
extras are only resolved (`pip install --dry-run`; nothing is downloaded): the size
of gpu shows with `--gpu`, which installs it (onnxruntime-gpu is a 350 MB download;
cuda adds NVIDIA's libraries, over 1 GB more).

Needs the package registries only; pip's cache makes a second run quick.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
# The same block tests/test_readme.py runs with the development install.
QUICKSTART = re.compile(r"## Quickstart\n\n```python\n(.*?)```", re.S)
# Paths an sdist must not carry: a developer's venv, build outputs, caches.
NOT_IN_SDIST = {".venv", "site", "dist", "build", "__pycache__", ".git", ".mypy_cache"}
# Per-distribution sizes, computed inside each venv from the installed RECORD files.
SIZES = """
import importlib.metadata as m, json, os
sizes = {}
for d in m.distributions():
    total = 0
    for f in d.files or ():
        try:
            total += os.lstat(f.locate()).st_size
        except OSError:
            pass
    sizes[d.metadata["Name"]] = total
print(json.dumps(sizes))
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="install the gpu extra too, to size it")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trioinfer-install-check-") as tmp_name:
        tmp = Path(tmp_name)
        wheel = build(tmp / "dist")
        quickstart = tmp / "quickstart.py"
        block = QUICKSTART.search((ROOT / "README.md").read_text())
        if block is None:
            fail("README.md has no ```python block right under '## Quickstart'")
        quickstart.write_text(block.group(1))
        rows: list[tuple[str, list[str], tuple[int, int] | None, dict[str, int]]] = []

        def measure(label: str, extras: str) -> Path:
            venv, dists = install(tmp, wheel, extras)
            sizes = json.loads(run([venv / "python", "-c", SIZES], cwd=tmp).stdout)
            rows.append((label, dists, site_packages_size(venv), sizes))
            return venv

        core = measure("core", "")
        check_core(core, quickstart, tmp)
        cpu = measure("core + cpu", "cpu")
        if "onnxruntime-gpu" in [d.lower() for d in rows[-1][1]]:
            fail("the cpu extra brings the GPU build of ONNX Runtime as well")
        check_cpu(cpu, quickstart, tmp)
        check_command(measure("core + cpu + serve", "cpu,serve"), "serve", tmp)
        check_command(measure("core + cpu + bench", "cpu,bench"), "bench", tmp)
        measure("core + cpu + dev (make test)", "cpu,dev")
        for extra in ("gpu", "cuda"):
            if args.gpu and extra == "gpu":
                measure(f"core + {extra}", extra)
            else:
                dists = resolve(core, wheel, extra, tmp)
                rows.append((f"core + {extra} (resolved only)", dists, None, {}))
            if "onnxruntime" in [d.lower() for d in rows[-1][1]]:
                fail(f"the {extra} extra brings the CPU build of ONNX Runtime as well")
        report(rows)
    print(f"install-check: passed in {time.monotonic() - started:.0f} s")
    return 0


def build(outdir: Path) -> Path:
    print("install-check: python -m build (the sdist, then the wheel from it)", flush=True)
    run([sys.executable, "-m", "build", "--outdir", str(outdir), str(ROOT)])
    (sdist,) = outdir.glob("*.tar.gz")
    (wheel,) = outdir.glob("*.whl")
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    stray = sorted({m for m in members if NOT_IN_SDIST & set(Path(m).parts)})
    if stray:
        fail(f"{sdist.name} carries what it should not: {', '.join(stray[:5])}")
    for path in (sdist, wheel):
        print(f"  {path.name}: {path.stat().st_size / 1e6:.1f} MB")
    print(f"  {sdist.name}: {len(members)} files", flush=True)
    return wheel


def install(tmp: Path, wheel: Path, extras: str) -> tuple[Path, list[str]]:
    """Install the wheel with *extras* into a new venv; return its bin/ and what pip installed."""
    venv = tmp / ("venv-" + (extras.replace(",", "-") or "core"))
    requirement = f"{wheel}[{extras}]" if extras else str(wheel)
    print(f"install-check: pip install {Path(requirement).name}", flush=True)
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    report = tmp / "report.json"
    pip(venv / "bin", "install", "--quiet", "--report", str(report), requirement)
    dists = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    return venv / "bin", sorted(dists, key=str.lower)


def resolve(bin_dir: Path, wheel: Path, extra: str, tmp: Path) -> list[str]:
    """What installing the wheel with *extra* would bring, resolved without installing."""
    print(f"install-check: pip install --dry-run {wheel.name}[{extra}]", flush=True)
    report = tmp / "report.json"
    pip(
        bin_dir,
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        f"{wheel}[{extra}]",
    )
    dists = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    return sorted(dists, key=str.lower)


def check_core(bin_dir: Path, quickstart: Path, tmp: Path) -> None:
    """The core alone: every way to ONNX Runtime, serving and bench names its extra."""
    done = run([bin_dir / "python", str(quickstart)], cwd=tmp, expect=1)
    last = done.stderr.strip().splitlines()[-1]
    if "BackendUnavailable" not in last or "'cpu' extra" not in last:
        fail(f"the quickstart without ONNX Runtime should name the cpu extra; it ended: {last}")
    for command, extra in (("demo", "cpu"), ("serve", "serve"), ("bench", "bench")):
        done = run([bin_dir / "trioinfer", command], cwd=tmp, expect=1)
        if done.stderr.count("\n") != 1 or f"'{extra}' extra" not in done.stderr:
            fail(f"trioinfer {command} on the core alone should name the {extra} extra in one line")
    print("  core: the quickstart, demo, serve and bench each name their missing extra")


def check_cpu(bin_dir: Path, quickstart: Path, tmp: Path) -> None:
    """Core + cpu: the README's quickstart and `trioinfer demo` run; every plugin loads."""
    done = run([bin_dir / "python", str(quickstart)], cwd=tmp)
    shown = re.fullmatch(r"\[(.*)\] expected \[(.*)\]\n", done.stdout)
    if shown is None or shown.group(1) != shown.group(2) or done.stderr:
        fail(f"the quickstart printed {done.stdout!r} {done.stderr!r}")
    print(f"  core + cpu: the README's quickstart printed: {done.stdout.strip()}")
    done = run([bin_dir / "trioinfer", "demo"], cwd=tmp)
    print(f"  core + cpu: trioinfer demo ran ({len(done.stdout.splitlines())} lines)")
    run([bin_dir / "trioinfer", "plugins"], cwd=tmp)
    print("  core + cpu: trioinfer plugins: every plugin loads")


def check_command(bin_dir: Path, command: str, tmp: Path) -> None:
    """With its extra a command gets past its imports, to a usage error of its own."""
    # --no-grpc: without the grpc extra, serve would say (rightly) that it serves HTTP only.
    args = {"serve": ["--no-grpc", "--model-repository", str(tmp / "missing")], "bench": []}[
        command
    ]
    done = run([bin_dir / "trioinfer", command, *args], cwd=tmp, expect=None)
    if done.returncode == 0 or "extra" in done.stderr or "Traceback" in done.stderr:
        fail(f"trioinfer {command} with its extra: {done.returncode} {done.stderr!r}")
    print(f"  core + cpu + {command}: trioinfer {command} starts: {done.stderr.strip()}")


def site_packages_size(bin_dir: Path) -> tuple[int, int]:
    """The bytes in the venv's site-packages: all files, and all but the .pyc files."""
    (site,) = bin_dir.parent.glob("lib/python*/site-packages")
    total = pyc = 0
    for dirpath, _, filenames in os.walk(site):
        for name in filenames:
            size = os.lstat(os.path.join(dirpath, name)).st_size
            total += size
            pyc += size if name.endswith(".pyc") else 0
    return total, total - pyc


def report(rows: list[tuple[str, list[str], tuple[int, int] | None, dict[str, int]]]) -> None:
    print("\ninstall                          dists  site-packages  without .pyc  biggest (MB)")
    for label, dists, size, sizes in rows:
        if size is None:
            shown = f"{'(not sized)':>13}  {'':12}"
        else:
            shown = f"{size[0] / 1e6:10.1f} MB  {size[1] / 1e6:9.1f} MB"
        big = sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
        biggest = ", ".join(f"{name} {n / 1e6:.0f}" for name, n in big)
        print(f"{label:32} {len(dists):5}  {shown}  {biggest}")
        if size is None or len(dists) <= 20:
            print(f"{'':32} {' '.join(dists)}")
    print()


def pip(bin_dir: Path, *args: str) -> None:
    run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), *args])


def run(
    cmd: Sequence[str | Path], *, cwd: Path | None = None, expect: int | None = 0
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, env=env, check=False
    )
    if expect is not None and done.returncode != expect:
        print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
        fail(f"{' '.join(map(str, cmd))} exited {done.returncode}, expected {expect}")
    return done


def fail(message: str) -> NoReturn:
    print(f"install-check: FAILED: {message}", file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
    sys.exit(main())
