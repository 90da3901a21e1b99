"""python -m bapo_megatron.engines.embedded --model HF_DIR --port 30000: the CPU engine."""

import sys

from bapo_megatron.engines.embedded.cli import main

if __name__ == "__main__":
    sys.exit(main())
