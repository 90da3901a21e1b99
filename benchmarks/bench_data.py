"""Start-up time and memory to the first batch, for prompt data in verl's layout at scale.

    python benchmarks/bench_data.py                          # 10k, 100k and 1M records, parquet and jsonl
    python benchmarks/bench_data.py --records 1e4 --formats jsonl    # a smoke run

Each data set is generated once under --dir (verl's columns: data_source, prompt as chat
messages, ability, reward_model {ground_truth, style}, extra_info; DAPO's instruction around
each problem). Each row is a fresh process that opens the data with PromptSource (chat template,
the answer at reward_model.ground_truth, data.check_records up front) and draws one batch of
--batch prompts in the shuffled order, as a run's first step does:
  start s      seconds from before PromptSource to the batch drawn (median of --repeat, min-max)
  cold s       the same on the first open of a parquet file (decoded into the Arrow cache)
  rss MB       the process's peak resident memory at the batch (VmHWM), and at its start (imports done)
  file MB      the data file's size; x file: the peak's growth over the start as a multiple of it
  anon MB      private memory (RssAnon) gained from the start to the batch, and as a multiple of the
               file: what the data costs beyond pages of files mapped read-only (the Arrow cache's
               pages that random draws map count in rss, not here; the kernel reclaims them)
Goal (issue 29): at 1M records, start under 10 s and memory growth within 2x the file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem."
)
WORDS = [f"x{i}" for i in range(500)]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def generate(path: Path, records: int, fmt: str, seed: int = 0) -> None:
    """`records` verl-layout records, written a slice at a time (the generator's memory stays flat)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    tmp = path.with_suffix(path.suffix + ".tmp")
    writer = None
    with open(tmp, "w") if fmt == "jsonl" else open(os.devnull, "w") as text:
        for lo in range(0, records, 50_000):
            rows = []
            for i in range(lo, min(records, lo + 50_000)):
                problem = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120)))
                content = f"{INSTRUCTION}\n\n{problem}\n\nRemember the Answer line."
                rows.append(
                    {
                        "data_source": "math_dapo",
                        "prompt": [{"role": "user", "content": content}],
                        "ability": "MATH",
                        "reward_model": {"ground_truth": str(rng.randrange(10**6)), "style": "rule-lax"},
                        "extra_info": {"index": i, "split": "train"},
                    }
                )
            if fmt == "jsonl":
                text.write("".join(json.dumps(r) + "\n" for r in rows))
            else:
                table = pa.Table.from_pylist(rows)
                writer = writer or pq.ParquetWriter(tmp, table.schema)
                writer.write_table(table)
    if writer is not None:
        writer.close()
    tmp.rename(path)


def tokenizer_dir(root: Path) -> Path:
    """A model directory's tokenizer: whitespace words, the template's markers, a chat template."""
    import tokenizers

    words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "system", *WORDS]
    words += sorted({w for w in f"{INSTRUCTION} Remember the Answer line.".split()})
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, "<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "unk_token": "<unk>"}))
    return root


def status_mb(field: str) -> float:
    """A memory figure of this process from /proc/self/status, in MiB: VmHWM (its own peak, where
    getrusage's ru_maxrss keeps the parent's across exec), RssAnon (private memory now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def probe(path: str, model: str, cache: str, batch: int) -> None:
    """(In a fresh process.) Open the data, draw one batch; print seconds and peak RSS as JSON."""
    sys.path.insert(0, str(ROOT))
    from bapo_megatron.config import DataConfig
    from bapo_megatron.data.prompts import PromptSource, load_tokenizer

    tokenizer = load_tokenizer(model)
    start_rss, start_anon = status_mb("VmHWM"), status_mb("RssAnon")
    t = time.perf_counter()
    config = DataConfig(path=path, answer_field="reward_model.ground_truth", cache_dir=cache, seed=1)
    source = PromptSource(config, tokenizer=tokenizer)
    drawn = [source.next() for _ in range(batch)]
    seconds = time.perf_counter() - t
    assert all(ids and meta["answer"] for _, ids, meta in drawn)
    peak, anon = status_mb("VmHWM"), status_mb("RssAnon") - start_anon
    figures = {"seconds": seconds, "start_mb": start_rss, "peak_mb": peak, "anon_mb": anon}
    print(json.dumps({**figures, "records": len(source)}))


def measure(path: Path, model: Path, cache: Path, batch: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--probe", str(path), str(model), str(cache), str(batch)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"bench_data: the probe of {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        probe(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", nargs="+", type=float, default=[1e4, 1e5, 1e6])
    parser.add_argument("--formats", nargs="+", choices=["parquet", "jsonl"], default=["parquet", "jsonl"])
    parser.add_argument("--batch", type=int, default=512, help="prompts drawn (a 7B preset's step: 64 x ... groups)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bapo-bench-data"), help="data sets kept here")
    args = parser.parse_args()
    model = tokenizer_dir(args.dir / "model")
    print(f"{'records':>9} {'format':>8} {'start s':>8} {'min-max':>11} {'cold s':>7} {'rss MB':>7} "
          f"{'start MB':>8} {'file MB':>8} {'x file':>7} {'anon MB':>8} {'x file':>7}")  # fmt: skip
    print("-" * 98)
    for records in (int(r) for r in args.records):
        for fmt in args.formats:
            path = args.dir / f"verl-{records}.{fmt}"
            if not path.is_file():
                generate(path, records, fmt)
            cache = args.dir / f"cache-{records}-{fmt}"
            shutil.rmtree(cache, ignore_errors=True)
            cold = measure(path, model, cache, args.batch)
            runs = [measure(path, model, cache, args.batch) for _ in range(args.repeat)]
            seconds = [r["seconds"] for r in runs]
            peak = statistics.median(r["peak_mb"] for r in runs)
            start = statistics.median(r["start_mb"] for r in runs)
            anon = statistics.median(r["anon_mb"] for r in runs)
            size = path.stat().st_size / 2**20
            cold_s = f"{cold['seconds']:.2f}" if fmt == "parquet" else "-"
            print(
                f"{records:>9} {fmt:>8} {statistics.median(seconds):>8.2f} "
                f"{f'{min(seconds):.2f}-{max(seconds):.2f}':>11} "
                f"{cold_s:>7} {peak:>7.0f} {start:>8.0f} "
                f"{size:>8.1f} {(peak - start) / size:>7.2f} {anon:>8.0f} {anon / size:>7.2f}",
                flush=True,
            )
    print(f"\nCPU: {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
