"""The wheel as a user gets it: built from a copy of the repository, installed
into a fresh venv, imported and served from outside the repository.

The dependencies (torch, transformers, Hugging Face's `kernels`, ...) are too
heavy to install again without a network, so the fresh venv sees the dev
venv's site-packages through a .pth file. Python does not process .pth files
inside a directory added that way, so the dev venv's editable-install finder
for pagoda stays behind and `pagoda` can only come from the wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from tests.frontend.servers import Pagoda, free_port, wait_pagoda_healthy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine_core", "frontend", "kernels", "protocol")
# Local state that a fresh clone would not have: a stale build/ or egg-info
# would leak old files into the wheel.
NOT_COPIED = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    ".whl",
    ".gl",
)

# Run by the fresh venv's python in a directory outside the repository.
IMPORT_PROBE = """
import json, sys
import kernels
import transformers.modeling_utils
import pagoda
from pagoda import LLM, SamplingParams
import pagoda.kernels
print(json.dumps({
    "kernels": kernels.__file__,
    "kernels_has_get_kernel": hasattr(kernels, "get_kernel"),
    "pagoda": pagoda.__file__,
    "pagoda_kernels": pagoda.kernels.__file__,
    "llm": sys.modules[LLM.__module__].__file__,
    "sampling_params": sys.modules[SamplingParams.__module__].__file__,
}))
"""


def run(
    argv: list[str | Path], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def build_wheel(tmp: Path) -> Path:
    """Build the wheel from a copy of the repository (pip builds in-tree, and
    the copy keeps build/ and egg-info out of the working tree)."""
    for needed in ("pip", "setuptools"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"the dev venv has no {needed} to build the wheel with")
    source = tmp / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_COPIED)
    dist = tmp / "dist"
    out = run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--no-cache-dir", "--disable-pip-version-check", "-w", dist, source]
    )
    assert out.returncode == 0, f"the wheel did not build:\n{out.stdout}\n{out.stderr}"
    (wheel,) = dist.glob("pagoda-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A venv with only the wheel installed, seeing the dev venv's site-packages."""
    venv = tmp / "venv"
    out = run([sys.executable, "-m", "venv", "--without-pip", venv])
    if out.returncode != 0:
        pytest.skip(f"cannot create a venv: {out.stderr.strip()}")
    # The wheel goes in before the .pth exists: otherwise pip would find the
    # dev venv's pagoda already installed.
    out = run(
        [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install"]
        + ["--no-deps", "--no-index", "--no-cache-dir", "--disable-pip-version-check", wheel]
    )
    assert out.returncode == 0, f"the wheel did not install:\n{out.stdout}\n{out.stderr}"
    site = site_packages(venv)
    (site / "pagoda_test_dev_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def site_packages(venv: Path) -> Path:
    out = run(
        [venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    )
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def clean_env(venv: Path) -> dict[str, str]:
    """The test's environment without anything that points back at the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def source_files(root: Path, pattern: str) -> set[str]:
    """Paths under `root` matching `pattern`, relative to it, caches left out."""
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob(pattern)
        if "__pycache__" not in p.parts and p.is_file()
    }


def check_installed_files(site: Path) -> None:
    """Every module and every kernel source of the repository is in the installed package."""
    installed = site / "pagoda"
    assert not installed.is_symlink() and installed.is_dir()
    for package in PACKAGES:
        assert source_files(installed / package, "*.py") == source_files(REPO / package, "*.py")
    sources = REPO / "kernels" / "csrc"
    csrc = source_files(sources, "*.cpp") | source_files(sources, "*.h")
    assert any(name.endswith(".cpp") for name in csrc)
    # Without these the compiled CPU kernels cannot build from the installed package.
    installed_csrc = source_files(installed / "kernels" / "csrc", "*")
    assert csrc <= installed_csrc, f"missing from the wheel: {sorted(csrc - installed_csrc)}"


def check_imports(venv: Path, site: Path, cwd: Path) -> None:
    out = run([venv / "bin" / "python", "-c", IMPORT_PROBE], cwd=cwd, env=clean_env(venv))
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    dev_site = Path(sysconfig.get_paths()["purelib"]).resolve()
    # Hugging Face's package from the dev site-packages, not our kernels/.
    assert Path(found["kernels"]).resolve().is_relative_to(dev_site), found
    assert found["kernels_has_get_kernel"], found
    for name in ("pagoda", "pagoda_kernels", "llm", "sampling_params"):
        assert Path(found[name]).is_relative_to(site), (name, found)
        assert not Path(found[name]).resolve().is_relative_to(REPO), (name, found)


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM `pagoda serve` (it stops its children), SIGKILL its session if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def test_wheel_installs_imports_and_serves(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    venv = fresh_venv(tmp_path, wheel)
    site = site_packages(venv)
    check_installed_files(site)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    check_imports(venv, site, outside)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "pagoda-serve.log"
    argv = [venv / "bin" / "pagoda", "serve", "--port", str(port), "--host", "127.0.0.1"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            cwd=outside,
            env=clean_env(venv),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_pagoda_healthy(base, Pagoda(proc, log), timeout=120)
        response = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
    finally:
        code = stop(proc)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert isinstance(text, str) and text.strip(), response.text
    assert code == 0, log.read_text(errors="replace")[-3000:]
