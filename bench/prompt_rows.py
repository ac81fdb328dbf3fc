"""Prompt chunks as one-token rows in the native decode step against the eager chunks they replace
(ModelRunner.prompts_as_rows): the step time of ModelRunner.execute on the same batches both ways, in
alternating rounds in one process, as served steps follow one another (planner.timing.served_time:
four batches of other random tokens in turn, no eviction).

    python bench/prompt_rows.py [--model DIR | --shape mixtral] [--rounds 2] [--quick]

Shapes: one prompt of 16 to 1,024 tokens from context 0, a chunk after cached context, four prompts at
once, and a prompt beside decode rows (a served step that admits a request while others decode), each
with its key reads (n c + n (n + 1) / 2 per chunk: what PROMPT_ROWS_KEY_READS bounds). "rows / eager"
below 1: the rows are faster. The default model is the built-in one in bf16 (the native step needs bf16
on AVX-512 BF16; elsewhere both columns are the eager chunks and the script says so); --shape takes a
random checkpoint of one of bench/planner.py's SHAPES (mixtral: hidden 1024, 8 layers, 8 experts of 2,048,
top-2). Writes bench/results/prompt_rows.json (--shape S: prompt_rows_S.json; --quick: ..._quick.json).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_nodes.config import CacheConfig, EngineConfig  # noqa: E402
from attention_nodes.model_runner import PROMPT_ROWS_KEY_READS, ModelRunner, prompt_key_reads  # noqa: E402
from bench.common import print_table, save  # noqa: E402
from planner.timing import SERVED_VARIANTS, served_time, synthetic_batch  # noqa: E402

SHAPES = [([16], [0]), ([64], [0]), ([128], [0]), ([256], [0]), ([512], [0]), ([768], [0]), ([1024], [0]),
          ([128], [512]), ([256], [1024]), ([64] * 4, [0] * 4), ([64, 1, 1, 1], [0, 80, 80, 80]),
          ([128] + [1] * 16, [0] + [300] * 16)]
QUICK = [([16], [0]), ([128], [0]), ([512], [0]), ([64, 1, 1, 1], [0, 80, 80, 80])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--shape", default=None, help="a random checkpoint of bench/planner.py's SHAPES (mixtral, fine)")
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds of both ways (the best kept)")
    ap.add_argument("--quick", action="store_true", help="four shapes, one round")
    args = ap.parse_args()
    if args.shape is not None:
        import tempfile

        from bench.planner import SHAPES, checkpoint
        args.model = str(checkpoint(Path(tempfile.mkdtemp(prefix="shuttle-prompt-rows-")) / args.shape,
                                    SHAPES[args.shape], "bfloat16"))
    elif args.model is None:
        from models.builtin import builtin_model_dir
        args.model = str(builtin_model_dir())
    shapes, rounds = (QUICK, 1) if args.quick else (SHAPES, args.rounds)
    blocks = 1 + max(-(-(max(q) + max(c)) // 16) for q, c in shapes)
    runner = ModelRunner(EngineConfig(args.model, dtype=torch.bfloat16, cache=CacheConfig(16, blocks)), None)
    if runner.model.native_decode is None:
        print("this model or CPU has no native decode step: both ways are the eager chunks")
    rows = []
    for q, c in shapes:
        batches = [synthetic_batch(q, c, 16, blocks, runner.model_cfg.vocab_size, v) for v in range(SERVED_VARIANTS)]
        times = {True: [], False: []}
        for r in range(rounds):
            for as_rows in ((True, False) if r % 2 == 0 else (False, True)):
                runner.prompt_rows_key_reads = 1 << 62 if as_rows else 0
                times[as_rows].append(served_time([lambda b=b: runner.execute(b) for b in batches], 3))
        runner.prompt_rows_key_reads = PROMPT_ROWS_KEY_READS
        rows_ms, eager_ms = 1e3 * min(times[True]), 1e3 * min(times[False])
        rows.append({"seqs": len(q), "prompt_tokens": sum(n for n in q if n > 1), "context": max(c),
                     "key_reads": prompt_key_reads(batches[0].seqs, q), "eager_ms": eager_ms, "rows_ms": rows_ms,
                     "rows_over_eager": rows_ms / eager_ms, "engine_takes_rows": runner.prompts_as_rows(batches[0])})
    print_table(rows, ["seqs", "prompt_tokens", "context", "key_reads", "eager_ms", "rows_ms", "rows_over_eager",
                       "engine_takes_rows"])
    name = "prompt_rows" + (f"_{args.shape}" if args.shape else "") + ("_quick" if args.quick else "")
    payload = {"model": args.shape or args.model, "rounds": rounds, "prompt_rows_key_reads": PROMPT_ROWS_KEY_READS,
               "rows": rows, "date": time.strftime("%Y-%m-%d")}
    print(f"wrote {save(name, payload)}")


if __name__ == "__main__":
    main()
