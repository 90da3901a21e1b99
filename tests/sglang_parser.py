"""SGLang 0.5.23's own server-argument parser and --config merger, run on CPU from its wheel.

    python -m tests.sglang_parser SRC DEPS [CONFIG.yaml ...]

SRC: the unpacked wheel; DEPS: what its import needs beyond ours (tests/sglang_wheel.py).
Triton (GPU kernels, 1 GB, unused by argument parsing) is replaced by the stub SGLang itself
installs on machines that lack it (sglang/_platform_stubs.py, meant for Apple Silicon: its
platform test is satisfied for the one call). Prints JSON: the options SGLang registers as
deprecated with their replacement, and for each config file the argument list and namespace that
SGLang's own ConfigArgumentMerger and parser make of `--config CONFIG.yaml`, or the error they raise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys


def _install_triton_stub(src: str) -> None:
    import torch

    spec = importlib.util.spec_from_file_location("sglang_platform_stubs", f"{src}/sglang/_platform_stubs.py")
    stubs = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = stubs
    spec.loader.exec_module(stubs)
    real = sys.platform, platform.machine, torch.backends.mps.is_available
    sys.platform, platform.machine, torch.backends.mps.is_available = "darwin", (lambda: "arm64"), (lambda: True)
    try:
        stubs.install_platform_stubs()
    finally:
        sys.platform, platform.machine, torch.backends.mps.is_available = real


def main() -> None:
    src, deps, *configs = sys.argv[1:]
    sys.path.insert(0, src)
    sys.path.append(deps)  # after site-packages: our own versions of shared packages win
    _install_triton_stub(src)
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    out: dict = {"deprecated": {}, "configs": []}
    for action in parser._actions:
        deprecated = type(action).__name__.startswith("Deprecated") or (action.help or "").lstrip("(").startswith(
            "Deprecated"
        )
        for option in action.option_strings:
            if deprecated and option.startswith("--"):
                out["deprecated"][option[2:]] = getattr(action, "new_flag", None) or action.help
    for config in configs:
        result: dict = {}
        try:
            result["argv"] = ConfigArgumentMerger(parser).merge_config_with_args(["--config", config])
            result["args"] = {
                k: v
                for k, v in vars(parser.parse_args(result["argv"])).items()
                if isinstance(v, (str, int, float, bool, list, type(None)))
            }
        except (ValueError, argparse.ArgumentError) as err:
            result["error"] = f"{type(err).__name__}: {err}"
        out["configs"].append(result)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
