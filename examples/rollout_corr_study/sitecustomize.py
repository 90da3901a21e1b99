"""Run by Python at start-up when this folder is on PYTHONPATH: the study's quantised engine (engine_quantization.py).

Nothing happens unless $ROLLOUT_CORR_STUDY_ENGINE_LEVELS is set (run.py sets it for its runs' processes).
"""

import os

if os.environ.get("ROLLOUT_CORR_STUDY_ENGINE_LEVELS"):
    import engine_quantization

    engine_quantization.install()
