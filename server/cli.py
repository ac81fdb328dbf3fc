"""The `shuttle` command.

    shuttle generate --model DIR --prompt TEXT [--prompt TEXT ...] [--max-tokens N] [--json]
"""
import argparse
import json
import logging
import sys

from attention_nodes.sampling_params import SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from server.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
        outputs = llm.generate(args.prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"shuttle generate: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                              "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}))
        else:
            print(f"{out.prompt}{c.text}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shuttle", description="Shuttle: MoE serving with disaggregated experts")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts offline and print the results")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string; repeat for several")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
