#!/usr/bin/env bash
# Turns a bare GPU machine (CUDA 13, Python 3.12 with torch, no package registry, at most
# 64 MiB carried per command) into a test bed for this project, and runs the GPU tests and
# benchmarks there. Steps, in this order:
#
#   here:   tools/gpu_check.sh prepare        wheels into .gpu/ (ignored): base/ (megatron-core,
#                                             pydantic for TE, TE's python wheel and
#                                             its torch-extension sdist) and te1..te3/ (TE's
#                                             CUDA-13 core wheel unpacked into a tar.xz, 128 MiB,
#                                             cut into parts of 50 MiB)
#   there:  tools/gpu_check.sh install        base wheels into /tmp/site (carry .gpu/base; .gpu/te1
#                                             fits beside it: `install && stash 1`)
#   there:  tools/gpu_check.sh stash K        keep part K in /tmp/te-parts (carry .gpu/teK); the
#                                             machine must stay up between these commands
#   there:  tools/gpu_check.sh install-te     join the parts (sha256 checked), unpack TE's core,
#                                             install its python wheel, build its torch extension
#                                             against the machine's torch (C++ only, about 28 files)
#   there:  tools/gpu_check.sh tests [PATHS]  pytest tests/gpu or PATHS (TE tests skip without TE)
#   there:  tools/gpu_check.sh bench          bench_logprobs, bench_train_step (Qwen2.5-1.5B shape,
#                                             TE spec, 8k and 16k-token micro-batches), bench_export
#   there:  tools/gpu_check.sh bench-7b [N]   bench_train_step at Qwen2.5-7B's layer shape cut to N
#                                             layers (default 6: what one 80 GB GPU holds with Adam),
#                                             bf16 against fp8, 16k-token micro-batches
#
# What each step cost on an H100 machine (2026-11-23): machine start about 30 s; install 18 s;
# each stash well under a second once its 57 MiB arrived (the call, transfer included, about
# 5-8 s); install-te 104 s (the extension's 28 C++ files, 16 jobs); tests 130 s with TE; bench
# about 4 minutes. The whole bring-up fits one 30-minute lease with room for a profile.
# The local (non-TE) spec is not benchmarked at this size: its unfused attention keeps
# [heads, s, s] scores per layer and runs out of memory at 4096 tokens on 80 GB.
#
# Logs and result tables go to $OUT when it is set (the device tool brings them back), else to
# ./gpu-results. Every step prints its own wall time; the figures of a run are in
# benchmarks/RESULTS.md.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=$ROOT/.gpu
SITE=/tmp/site
PARTS=/tmp/te-parts
RESULTS=${OUT:-$ROOT/gpu-results}
PART_BYTES=$((50 * 1024 * 1024)) # a part beside base/ (6 MiB) and the checkout (6 MiB) stays under 64 MiB
MCORE=megatron-core==0.16.1
TE=2.11.0
PY=${PYTHON:-python3}

step() { echo "== $* ($(date -u +%H:%M:%S))"; }
timed() {
  local start=$SECONDS
  "$@"
  echo "-- $1 ${2:-}: $((SECONDS - start)) s"
}
env_there() {
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
  mkdir -p "$RESULTS"
}

prepare() {
  # Wheels for the GPU machine's interpreter (cp312, manylinux x86-64), never its dependencies:
  # torch, numpy, transformers, safetensors, tokenizers, yaml and aiohttp are in its image.
  local platforms=(--only-binary=:all: --python-version 3.12 --implementation cp)
  local p
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
  done
  rm -rf "$WHEELS" && mkdir -p "$WHEELS/base"
  step "download wheels"
  $PY -m pip download -q --no-deps "${platforms[@]}" -d "$WHEELS/base" \
    "$MCORE" "transformer-engine==$TE" pydantic pydantic-core annotated-types typing-inspection \
    "typing-extensions>=4.16"
  # pydantic pins its pydantic-core exactly: fetch the pinned one if the newest differs
  local core
  core=$(unzip -p "$WHEELS"/base/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
  rm -f "$WHEELS"/base/pydantic_core-*.whl
  $PY -m pip download -q --no-deps "${platforms[@]}" -d "$WHEELS/base" "pydantic-core==$core"
  # TE's torch extension exists only as an sdist (pip download would try to build it here)
  $PY - "$WHEELS/base" "$TE" <<'EOF'
import re, sys, urllib.request
dest, version = sys.argv[1], sys.argv[2]
page = urllib.request.urlopen("https://pypi.org/simple/transformer-engine-torch/").read().decode()
url = re.search(rf'href="([^"#]*/transformer_engine_torch-{re.escape(version)}\.tar\.gz)', page).group(1)
urllib.request.urlretrieve(url, f"{dest}/{url.rsplit('/', 1)[1]}")
EOF
  step "TE core wheel, unpacked and xz-compressed (128 MiB where the wheel's deflate is 171), in parts"
  local tmp
  tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps "${platforms[@]}" -d "$tmp" "transformer-engine-cu13==$TE"
  mkdir "$tmp/core" && $PY -m zipfile -e "$tmp"/transformer_engine_cu13-*.whl "$tmp/core"
  tar -C "$tmp/core" -cf - . | xz -T0 -6 > "$tmp/te-core.tar.xz"
  (cd "$tmp" && sha256sum te-core.tar.xz) > "$WHEELS/base/te-core.sha256"
  split -b "$PART_BYTES" -d -a 1 "$tmp/te-core.tar.xz" "$tmp/part-"
  local i=1 part
  for part in "$tmp"/part-*; do
    mkdir -p "$WHEELS/te$i" && mv "$part" "$WHEELS/te$i/"
    i=$((i + 1))
  done
  rm -rf "$tmp"
  du -sh "$WHEELS"/*
  echo "carry .gpu/base and .gpu/te1 with install and stash 1; .gpu/te2 .. .gpu/te$((i - 1)) with one stash each"
}

install() {
  env_there
  step "install base wheels into $SITE"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/base/megatron_core-*.whl "$WHEELS"/base/pydantic*.whl "$WHEELS"/base/annotated_types-*.whl \
    "$WHEELS"/base/typing_inspection-*.whl "$WHEELS"/base/typing_extensions-*.whl
  mkdir -p "$PARTS"
  cp "$WHEELS"/base/transformer_engine-*.whl "$WHEELS"/base/transformer_engine_torch-*.tar.gz \
    "$WHEELS"/base/te-core.sha256 "$PARTS"/
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'mcore', m.__version__, torch.cuda.get_device_name())"
}

stash() {
  mkdir -p "$PARTS"
  cp "$WHEELS/te$1"/part-* "$PARTS"/
  ls -la "$PARTS"
}

install_te() {
  env_there
  step "join the TE core parts"
  cat "$PARTS"/part-* > "$PARTS/te-core.tar.xz"
  (cd "$PARTS" && sha256sum -c te-core.sha256)
  # the python wheel first: pip's --target --upgrade replaces the whole transformer_engine folder,
  # which the core's files (wheel_lib/libtransformer_engine.so) share
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$PARTS"/transformer_engine-*.whl
  xz -dc -T0 "$PARTS/te-core.tar.xz" | tar -C "$SITE" -xf -
  step "build TE's torch extension against $($PY -c 'import torch; print(torch.__version__)')"
  local src=/tmp/te-src  # kept: a second build reuses its objects
  mkdir -p "$src" && tar xzf "$PARTS"/transformer_engine_torch-*.tar.gz -C "$src" --skip-old-files
  # cudnn.h and nccl.h come from the image's nvidia-* wheels, not the toolkit's include folder
  local includes
  includes=$($PY -c "import nvidia, pathlib; print(':'.join(str(p) for p in sorted(pathlib.Path(list(nvidia.__path__)[0]).glob('**/include')) if p.is_dir()))")
  (
    cd "$src"/transformer_engine_torch-*
    CPATH=$includes${CPATH:+:$CPATH} NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-16} \
      $PY -m pip wheel -q --no-index --no-deps --no-build-isolation --no-cache-dir -w "$src/wheel" .
  ) 2>&1 | tail -40
  # unpacked, not pip-installed: --target would skip (or, with --upgrade, replace) the core's folder
  $PY -m zipfile -e "$src"/wheel/transformer_engine_torch-*.whl "$SITE"
  $PY -c "import transformer_engine.pytorch as te, transformer_engine as t; print('transformer_engine', t.__version__)"
}

tests() {
  env_there
  step "pytest ${*:-tests/gpu}"
  set +e
  $PY -m pytest -q -ra -p no:cacheprovider "${@:-tests/gpu}" 2>&1 | tee "$RESULTS/tests-gpu.log"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

bench() {
  env_there
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  step "bench_logprobs (8192 tokens x 151,936)"
  $PY benchmarks/bench_logprobs.py 2>&1 | tee "$RESULTS/logprobs.txt"
  local precisions=(bf16) impl=local
  if $PY -c "import transformer_engine.pytorch" 2>/dev/null; then
    precisions+=(fp8)
    impl=transformer_engine
  fi
  local tokens
  for tokens in 8192 16384; do
    step "bench_train_step, Qwen2.5-1.5B shape, $tokens tokens per micro-batch"
    $PY benchmarks/bench_train_step.py --shape qwen2.5-1.5b --impl "$impl" --precision "${precisions[@]}" \
      --fp8-recipe tensorwise blockwise --microbatch-tokens "$tokens" --json "$RESULTS/train_step_$tokens.json" \
      2>&1 | tee "$RESULTS/train_step_$tokens.txt"
  done
  step "bench_export, Qwen2.5-7B shape"
  $PY benchmarks/bench_export.py --shape qwen2.5-7b --json "$RESULTS/export.json" 2>&1 | tee "$RESULTS/export.txt"
}

bench_7b() {
  env_there
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  local layers=${1:-6}
  step "bench_train_step, Qwen2.5-7B layer shape, $layers layers, 16384 tokens per micro-batch"
  $PY benchmarks/bench_train_step.py --shape qwen2.5-7b --layers "$layers" --impl transformer_engine \
    --precision bf16 fp8 --fp8-recipe tensorwise blockwise --prompts 4 --microbatch-tokens 16384 \
    --json "$RESULTS/train_step_7b_$layers.json" 2>&1 | tee "$RESULTS/train_step_7b_$layers.txt"
}

case "${1:-}" in
  prepare) timed prepare ;;
  install) timed install ;;
  stash) timed stash "$2" ;;
  install-te) timed install_te ;;
  tests) shift; timed tests "$@" ;;
  bench) timed bench ;;
  bench-7b) shift; timed bench_7b "$@" ;;
  *)
    sed -n '2,36p' "$0"
    exit 2
    ;;
esac
