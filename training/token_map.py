"""Token maps for the MTP drafter (speculative decoding, --speculative-config '{"method": "mtp", ...,
"token_map": PATH}'; models/mtp.load_token_map reads them): the N most frequent tokens of a corpus in a
model's tokenizer, as a JSON list, most frequent first. The drafter's head keeps only those rows (the
FR-Spec idea, SGLang's --speculative-token-map), so each draft reads a fraction of the head's bytes;
verification still scores the whole vocabulary, so outputs do not change, only which drafts are made.

    python -m training.token_map --model DIR --data FILE [FILE ...] [--text-field text] --size N --out PATH
    python -m training.token_map --builtin --size N --out PATH   # the built-in model's training split

--data: .jsonl files (one document per line, in --text-field) or plain-text files, as `shuttle train`
reads them. models/builtin/mtp_token_map.json is `--builtin --size 1024`.
"""
import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Iterable


def frequent_tokens(token_lists: Iterable[Iterable[int]], size: int) -> list[int]:
    """The `size` most frequent ids over token_lists, most frequent first (ties: the lower id first)."""
    counts = Counter()
    for ids in token_lists:
        counts.update(ids)
    return sorted(counts, key=lambda t: (-counts[t], t))[:size]


def write_token_map(texts: Iterable[str], tokenizer, size: int, out: str | Path) -> list[int]:
    """frequent_tokens of the texts in `tokenizer` (a `tokenizers.Tokenizer`), written to `out`."""
    if size < 1:
        raise ValueError(f"a token map needs a positive size, got {size}")
    ids = frequent_tokens((tokenizer.encode(t).ids for t in texts), size)
    if not ids:
        raise ValueError("no tokens in the given texts")
    Path(out).write_text(json.dumps(ids) + "\n")
    return ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", nargs="+", help=".jsonl or text files of documents")
    src.add_argument("--builtin", action="store_true", help="the built-in model's training split (its tokenizer)")
    p.add_argument("--model", help="the model directory whose tokenizer.json tokenizes --data")
    p.add_argument("--text-field", default="text")
    p.add_argument("--size", type=int, required=True, help="tokens in the map")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from training.data import load_tokenizer, read_documents

    if args.builtin:
        from models.builtin import builtin_model_dir
        from training.builtin import documents, is_held_out

        texts = [text for name, text in documents() if not is_held_out(name)]
        tokenizer = load_tokenizer(args.model or builtin_model_dir())
    else:
        if args.model is None:
            p.error("--data needs --model (the tokenizer's directory)")
        texts, tokenizer = read_documents(args.data, args.text_field), load_tokenizer(args.model)
    ids = write_token_map(texts, tokenizer, args.size, args.out)
    print(f"wrote {len(ids)} token ids to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
