"""--m2n-dtype fp8 against dispatch in the model's dtype: how often the top token and greedy decoding change
when tokens cross to the expert workers as float8 e4m3 with one scale per token.

Per checkpoint (the built-in model, and random checkpoints of odd shapes: a Mixtral of hidden 200, 5 heads of
40 over 1, 6 experts of 88, top-2, and a Qwen3-MoE of hidden 136, 10 experts of 72, top-3, 3 layers each),
two deployments of 1 attention + --expert-workers expert workers (one thread each, bf16) that differ only in
--m2n-dtype ("auto": x crosses in bf16; "fp8"), --prompts prompts of 16 tokens (the built-in model: cut from
its held-out documents; the random ones: random ids), greedy, EOS ignored, --tokens new tokens:
- top-token agreement (teacher forced): both deployments score the bf16 deployment's sequences (prompt
  log-probabilities with each position's top token); the share of the generated positions where both give
  the same top token. Every position is compared on the same prefix, so one change does not hide the rest;
- free running: the share of sequences identical, and of tokens before each one's first difference;
- at each first difference, the bf16 deployment's log-probability margin between its token and the fp8
  deployment's there, both read from its scoring of the common prefix (a near-tie below --near-tie nats:
  e4m3's 3 mantissa bits move each activation by up to 1/16 of its token's largest one); "unscored": its
  token was not among that scoring's top 20 (prefill and decode rounding apart).

    python bench/m2n_fp8_agreement.py [--quick] [--prompts 100] [--tokens 32] [--expert-workers 1]

--quick: 20 prompts of 16 tokens. Writes bench/results/m2n_fp8_agreement.json (--quick: _quick).
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import print_table, save  # noqa: E402
from server import LLM, SamplingParams  # noqa: E402

VOCAB = 1000
MARGIN_TOP = 20  # top log-probabilities returned at a first difference's position


def odd_checkpoints(tmp: Path) -> dict[str, Path]:
    """Random checkpoints of odd shapes (one tokenizer trained for both)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from models.builtin import make_random_checkpoint, train_tokenizer

    tok = tmp / "tokenizer"
    train_tokenizer(tok, vocab_size=VOCAB)
    common = dict(vocab_size=VOCAB, num_hidden_layers=3, max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    cfgs = {"mixtral-odd": MixtralConfig(hidden_size=200, intermediate_size=88, num_attention_heads=5, head_dim=40,
                                         num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=2, **common),
            "qwen3_moe-odd": Qwen3MoeConfig(hidden_size=136, intermediate_size=96, moe_intermediate_size=72,
                                            num_attention_heads=4, head_dim=34, num_key_value_heads=2, num_experts=10,
                                            num_experts_per_tok=3, norm_topk_prob=True, **common)}
    return {name: make_random_checkpoint(tmp / name, cfg, seed=1, dtype="bfloat16", tokenizer_dir=tok)
            for name, cfg in cfgs.items()}


def prompts_for(name: str, ckpt: Path | None, n: int) -> list[list[int]]:
    if ckpt is None:  # the built-in model: 16-token windows of its held-out documents
        from models.builtin import builtin_model_dir
        from training.builtin import documents, is_held_out

        llm = LLM(builtin_model_dir(), num_kv_blocks=16)
        try:
            flat = [t for doc, text in documents() if is_held_out(doc) for t in llm.tokenizer.encode(text)]
        finally:
            llm.shutdown()
        step = max(16, (len(flat) - 16) // n)
        return [flat[i:i + 16] for i in range(0, len(flat) - 16, step)][:n]
    g = torch.Generator().manual_seed(len(name))
    return torch.randint(3, VOCAB, (n, 16), generator=g).tolist()


def compare(ckpt: Path | None, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    ids, top, llms = {}, {}, {}
    try:
        for wire in ("auto", "fp8"):
            llms[wire] = LLM(ckpt, dtype="bfloat16", colocated=False, expert_workers=args.expert_workers,
                             torch_threads=1, num_kv_blocks=256, m2n_dtype=wire)
            ids[wire] = [o.outputs[0].token_ids for o in llms[wire].generate(prompts, greedy)]
        seqs = [p + list(g) for p, g in zip(prompts, ids["auto"])]
        for wire, llm in llms.items():  # each position's top token on the bf16 deployment's sequences
            top[wire] = [[next(t for t, lp in pos.items() if lp.rank == 1) for pos in o.prompt_logprobs[16:]]
                         for o in llm.generate(seqs, scored)]
        # at each first difference: the bf16 deployment's margin between its token and fp8's
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ids["auto"], ids["fp8"])]
        differ = [(p, i) for p, i in enumerate(firsts) if i is not None]
        probes = [prompts[p] + list(ids["auto"][p][:i]) + [ids["fp8"][p][i]] for p, i in differ]
        margins, unscored = [], 0
        ranked = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=MARGIN_TOP)
        for o, (p, i) in zip(llms["auto"].generate(probes, ranked) if probes else [], differ):
            last = o.prompt_logprobs[-1]  # the probe's last position: its own (fp8's) token and the top ones
            mine = last.get(ids["auto"][p][i])
            if mine is None:  # (the bf16 deployment's decode-time token outside its prefill's top MARGIN_TOP)
                unscored += 1
                continue
            margins.append(mine.logprob - last[ids["fp8"][p][i]].logprob)
    finally:
        for llm in llms.values():
            llm.shutdown()
    same = sum(a == b for x, y in zip(top["auto"], top["fp8"]) for a, b in zip(x, y))
    positions = sum(len(x) for x in top["auto"])
    before = [args.tokens if i is None else i for i in firsts]
    return {"prompts": len(prompts), "top_token_agreement": same / positions, "positions": positions,
            "identical_share": firsts.count(None) / len(prompts),
            "tokens_before_first_difference_share": sum(before) / (len(prompts) * args.tokens),
            "first_differences": len(differ), "unscored": unscored, "margins_nats": margins,
            "near_ties": sum(m < args.near_tie for m in margins),
            "median_margin_nats": statistics.median(margins) if margins else None,
            "max_margin_nats": max(margins) if margins else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per checkpoint (100; --quick 20)")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per prompt (32; --quick 16)")
    ap.add_argument("--expert-workers", type=int, default=1)
    ap.add_argument("--near-tie", type=float, default=0.1, help="nats")
    args = ap.parse_args()
    args.prompts = args.prompts or (20 if args.quick else 100)
    args.tokens = args.tokens or (16 if args.quick else 32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {"builtin": None, **odd_checkpoints(Path(tmp))}
        for name, ckpt in ckpts.items():
            got = compare(ckpt, prompts_for(name, ckpt, args.prompts), args)
            rows.append({"checkpoint": name, **got})
            print(rows[-1]["checkpoint"], {k: v for k, v in got.items() if k != "margins_nats"}, flush=True)
    print_table(rows, ["checkpoint", "prompts", "top_token_agreement", "identical_share",
                       "tokens_before_first_difference_share", "first_differences", "unscored", "near_ties",
                       "median_margin_nats",
                       "max_margin_nats"])
    path = save("m2n_fp8_agreement_quick" if args.quick else "m2n_fp8_agreement",
                {"config": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
