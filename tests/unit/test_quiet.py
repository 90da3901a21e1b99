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
quiet.hold_known_warnings(cuda=sys.argv[1] == "cuda")
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


RANKS = """
import logging, sys, warnings
from bapo_megatron.common import quiet
quiet.hold_known_warnings(cuda=False)
rank, run_dir = int(sys.argv[1]), sys.argv[2]
warnings.warn("When using sequence parallelism it is recommended to set the environment variable "
              "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
logging.getLogger("megatron.core.dist_checkpointing.validation").warning(
    f"Rank {rank} common state dict differs from rank 0 common state dict. Keys only on rank 0: []")
logging.getLogger("transformers.utils.generic").warning("`past_key_values`/`cache_params` are deprecated.")
warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed."
              "reduce_scatter_single` instead.", FutureWarning)
logging.getLogger("megatron.core.dist_checkpointing.validation").warning("another notice the user must see")
print(quiet.flush(run_dir + "/not-made-yet", rank), quiet.flush(run_dir, rank))
"""


def test_every_ranks_notices_go_to_one_log_tagged_with_the_rank(tmp_path):
    """Under torchrun each rank holds its known notices (warnings and log records alike) and appends
    them, tagged, to the one warnings.log; a run directory not made yet keeps them held."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-W", "default", "-c", RANKS, str(rank), str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.split() == ["0", "4"]  # held while the directory is missing, then all four
        assert "another notice the user must see" in err
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in err and "common state dict" not in err
        assert "past_key_values" not in err and "reduce_scatter" not in err
    lines = (tmp_path / "warnings.log").read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert any("CUDA_DEVICE_MAX_CONNECTIONS" in line for line in mine)
        assert any(f"Rank {rank} common state dict differs" in line for line in mine)
        assert any("past_key_values" in line for line in mine)
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in lines)


def test_this_packages_own_warnings_are_one_line():
    import warnings

    from bapo_megatron.common import quiet

    own = quiet._formatter(warnings.formatwarning)
    line = own(UserWarning("step 3 trains on nothing"), UserWarning, f"{quiet.PACKAGE}/rollout/filtering.py", 9)
    assert line == "warning: step 3 trains on nothing\n"
    theirs = own(UserWarning("x"), UserWarning, "/usr/lib/python3/site-packages/megatron/core/a.py", 9)
    assert theirs.startswith("/usr/lib/python3/site-packages/megatron/core/a.py:9: UserWarning: x")
