"""SGLang 0.5.23's own source, from its released wheel, for tests that check our code against it.

The wheel is downloaded once (`pip download --no-deps sglang==0.5.23`, 39 MB) into a cache
(BAPO_CACHE_DIR, default ~/.cache/bapo-megatron). SGLang cannot be installed on a CPU machine,
so tests either read its source (ast) or run chosen functions, classes and methods of it:
`load_defs` compiles exactly those definitions from the wheel's files into one namespace, with
the names they need from elsewhere supplied by the caller (torch, a logger). What runs is
SGLang's code, unchanged.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.5.23"
ROOT = "sglang/srt/"


class WheelUnavailable(RuntimeError):
    """The registry could not be reached: the calling test skips with this reason."""


def cache_dir(name: str = "sglang", version: str = VERSION) -> Path:
    return Path(os.environ.get("BAPO_CACHE_DIR", Path.home() / ".cache" / "bapo-megatron")) / f"{name}-{version}"


def wheel_path(name: str = "sglang", version: str = VERSION) -> Path:
    """The cached wheel of name==version (SGLang's by default), downloaded on first use."""
    cache = cache_dir(name, version)
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", f"{name}=={version}", "-d", str(cache), "-q"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        raise WheelUnavailable(f"pip download {name}=={version} timed out (registry unreachable?)") from None
    found = sorted(cache.glob(f"{name}-{version}-*.whl"))
    if result.returncode != 0 or not found:
        raise WheelUnavailable(f"cannot download {name}=={version}: {result.stderr.strip()[-300:]}")
    return found[0]


def source(wheel: zipfile.ZipFile, path: str) -> str:
    """The text of sglang/srt/<path>."""
    return wheel.read(ROOT + path).decode()


def load_defs(wheel: zipfile.ZipFile, wanted: dict[str, list[str]], namespace: dict) -> dict:
    """Compile SGLang's definitions into `namespace` and return it.

    wanted: {path under sglang/srt/: names}; a name is a top-level function or class, or
    "Class.method" for one method of a class (compiled as a plain function taking self).
    Module-level imports are not run: `namespace` supplies what the definitions use beyond
    the standard library's dataclass, ipaddress, socket and typing names (given here).
    """
    import dataclasses
    import ipaddress
    import socket
    import typing

    namespace = {
        "dataclass": dataclasses.dataclass,
        "field": dataclasses.field,
        "ipaddress": ipaddress,
        "socket": socket,
        **{n: getattr(typing, n) for n in ("Any", "List", "Optional", "Tuple", "Union")},
        **namespace,
    }
    chunks = ["from __future__ import annotations"]
    for path, names in wanted.items():
        text = source(wheel, path)
        tree = ast.parse(text)
        top = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        for name in names:
            owner, _, method = name.partition(".")
            if owner not in top:
                raise AssertionError(f"SGLang {VERSION} has no {owner} in {path}")
            node = top[owner]
            if method:
                found = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method]
                if not found:
                    raise AssertionError(f"SGLang {VERSION} has no {name} in {path}")
                node = found[0]
            node.decorator_list = [d for d in node.decorator_list if _keeps(d)]
            chunks.append(ast.unparse(node))
    exec(compile("\n\n".join(chunks), f"<sglang {VERSION}>", "exec"), namespace)
    return namespace


def _keeps(decorator: ast.expr) -> bool:
    """Decorators that only add behaviour around the call (caching) are dropped; dataclass stays."""
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id in ("dataclass", "staticmethod", "classmethod")


PARSER_DEPS = ("orjson", "pybase64", "msgspec", "pyzmq", "ipython")
"""What importing sglang.srt.server_args needs beyond this project's environment (a few MB;
triton, 1 GB, is replaced by SGLang's own stub for machines without it: tests/sglang_parser.py)."""


def extracted_wheel() -> Path:
    """The wheel unpacked once into the cache (its sglang package importable from here)."""
    target = cache_dir() / "src"
    if not (target / "sglang").is_dir():
        tmp = target.with_name(f"src.tmp{os.getpid()}")
        with zipfile.ZipFile(wheel_path()) as wheel:
            wheel.extractall(tmp)
        tmp.rename(target)
    return target


def parser_deps() -> Path:
    """PARSER_DEPS installed once into the cache (pip --target), to be put after site-packages."""
    target = cache_dir() / "deps"
    if not (target / ".complete").exists():
        tmp = target.with_name(f"deps.tmp{os.getpid()}")
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--target", str(tmp), *PARSER_DEPS],
                capture_output=True,
                text=True,
                timeout=600,
            )
        except subprocess.TimeoutExpired:
            raise WheelUnavailable(f"pip install {' '.join(PARSER_DEPS)} timed out (registry unreachable?)") from None
        if result.returncode != 0:
            raise WheelUnavailable(f"cannot install {' '.join(PARSER_DEPS)}: {result.stderr.strip()[-300:]}")
        (tmp / ".complete").touch()
        if target.exists():
            import shutil

            shutil.rmtree(target)
        tmp.rename(target)
    return target
