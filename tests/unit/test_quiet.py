"""Known, harmless upstream warnings are kept off the console and in the run's warnings.log; any
other warning shows; Transformer Engine's absence shows where CUDA is. (In a process of its own:
pytest records warnings itself.)"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, warnings
from bapo_megatron.common import quiet
quiet.install(cuda=sys.argv[1] == "cuda")
warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
warnings.warn("`load_state_dict` is deprecated and will be removed in future versions.", FutureWarning)
warnings.warn("something the user must see")
print(quiet.flush(sys.argv[2]), quiet.flush(sys.argv[2]))
"""


def _run(where: str, log_dir: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-W", "default", "-c", SCRIPT, where, str(log_dir)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True)


def test_known_warnings_go_to_the_runs_log_and_others_show(tmp_path):
    done = _run("cpu", tmp_path)
    assert "something the user must see" in done.stderr
    assert "Apex" not in done.stderr and "load_state_dict" not in done.stderr
    assert done.stdout.split() == ["2", "0"]
    log = (tmp_path / "warnings.log").read_text()
    assert "Falling back to Torch optimizers" in log and "FutureWarning" in log and "must see" not in log


def test_transformer_engines_absence_shows_where_there_is_cuda(tmp_path):
    done = _run("cuda", tmp_path)
    assert "Transformer Engine and Apex are not installed" in done.stderr
    assert "load_state_dict" not in done.stderr and done.stdout.split() == ["1", "0"]
