"""Training data: documents from local files, tokenized once (the token array is cached), packed into
fixed-length samples and read in a seeded, shuffled order that resumes at the exact sample.

Legend: B rows of a micro-batch, L sequence length (a sample holds L+1 tokens: the inputs, and the
labels shifted by one), G samples per step over all ranks (the global batch).
"""
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def read_documents(paths: list[str | Path], text_field: str = "text") -> Iterator[str]:
    """Each line of a .jsonl file is a JSON object whose `text_field` is one document; any other file
    is one plain-text (UTF-8) document."""
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"data file {path}: not found")
        if path.suffix != ".jsonl":
            yield path.read_text(encoding="utf-8", errors="replace")
            continue
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{path}:{n}: expected an object with a string field {text_field!r}")
                yield record[text_field]


def load_tokenizer(tokenizer_dir: str | Path):
    """The `tokenizers.Tokenizer` of a Hugging Face tokenizer directory (its tokenizer.json)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (a tokenizer directory needs tokenizer.json)")
    return Tokenizer.from_file(str(path))


def train_new_tokenizer(paths: list[str | Path], out_dir: Path, vocab_size: int, text_field: str = "text") -> None:
    """Byte-level BPE trained on the data (models.builtin's recipe and special tokens), saved in out_dir."""
    from models.builtin import train_tokenizer

    train_tokenizer(out_dir, vocab_size=vocab_size, texts=read_documents(paths, text_field))


def tokenize_files(paths: list[str | Path], tokenizer_dir: Path, eos_id: int, cache_dir: Path,
                   text_field: str = "text") -> Path:
    """Tokenize every document, append eos_id to each, concatenate; saved once as .npy in cache_dir
    under a key of the files (path, size, mtime), the tokenizer and eos_id. Returns the .npy path."""
    h = hashlib.sha1()
    for p in paths:
        st = Path(p).stat()
        h.update(f"{Path(p).resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update((Path(tokenizer_dir) / "tokenizer.json").read_bytes())
    h.update(f"{eos_id}:{text_field}".encode())
    out = Path(cache_dir) / f"tokens-{h.hexdigest()[:16]}.npy"
    if out.is_file():
        return out
    tok = load_tokenizer(tokenizer_dir)
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max else np.int32
    chunks, docs = [], []

    def flush() -> None:
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            chunks.append(np.array(enc.ids + [eos_id], dtype=dtype))
        docs.clear()

    for text in read_documents(paths, text_field):
        docs.append(text)
        if len(docs) == 512:
            flush()
    flush()
    if not chunks:
        raise ValueError(f"data files {[str(p) for p in paths]}: no documents")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, np.concatenate(chunks))
    os.replace(tmp, out)
    return out


class PackedSamples:
    """Sample i is tokens[i*L : i*L + L + 1]: consecutive samples share one token, so every token
    but the first is a label exactly once. tokens: a 1-D integer array (may be memory-mapped)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.num_samples

    def rows(self, indices: list[int]) -> torch.Tensor:
        """(B, L+1) int64 samples."""
        L = self.seq_len
        return torch.from_numpy(np.stack([np.asarray(self.tokens[i * L:i * L + L + 1], dtype=np.int64)
                                          for i in indices]))


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch splits: micro_batch rows per rank and micro-step, grad_accum micro-steps,
    world ranks. Row i of rank r's micro-step a is position a*world*micro_batch + r*micro_batch + i of
    the global batch, so the data of a step does not depend on the number of ranks."""

    micro_batch: int
    grad_accum: int
    rank: int = 0
    world: int = 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world

    def positions(self, start: int, micro_step: int) -> range:
        """Stream positions of this rank's rows in micro-step `micro_step` of the step starting at `start`."""
        first = start + micro_step * self.world * self.micro_batch + self.rank * self.micro_batch
        return range(first, first + self.micro_batch)


def split_inputs_labels(rows_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L+1) samples -> (inputs_BL, labels_BL): labels are the inputs shifted by one."""
    return rows_BS[:, :-1], rows_BS[:, 1:]


class ShuffledLoader:
    """An endless stream of samples: epoch k is a permutation of all samples drawn from seed + k.
    Step s reads stream positions [s*G, (s+1)*G). `position` (in state_dict) is the next unread one."""

    def __init__(self, samples: PackedSamples, layout: BatchLayout, seed: int, position: int = 0):
        if len(samples) < layout.global_batch:
            raise ValueError(f"the data holds {len(samples)} samples of {samples.seq_len + 1} tokens, fewer than "
                             f"one global batch ({layout.global_batch}); add data or lower the batch size")
        self.samples, self.layout, self.seed, self.position = samples, layout, seed, position
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def sample_index(self, position: int) -> int:
        """Which sample sits at a stream position."""
        n = len(self.samples)
        epoch = position // n
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        return int(self._perm[position % n])

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's grad_accum micro-batches (inputs_BL, labels_BL) of the next step."""
        out = []
        for a in range(self.layout.grad_accum):
            idx = [self.sample_index(p) for p in self.layout.positions(self.position, a)]
            out.append(split_inputs_labels(self.samples.rows(idx)))
        self.position += self.layout.global_batch
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_samples"] != len(self.samples):
            raise ValueError(f"cannot resume the data stream: it was {state['num_samples']} samples with seed "
                             f"{state['seed']}, now {len(self.samples)} with seed {self.seed} (data or --seq-len changed)")
        self.position = state["position"]

    @property
    def epoch(self) -> float:
        """Passes over the training samples so far (fractional)."""
        return self.position / len(self.samples)


def eval_batches(samples: PackedSamples, layout: BatchLayout, num_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the first num_steps global batches of a held-out set, in order
    (fewer when the set is smaller)."""
    num_steps = min(num_steps, len(samples) // layout.global_batch)
    return [split_inputs_labels(samples.rows(list(layout.positions(s * layout.global_batch, a))))
            for s in range(num_steps) for a in range(layout.grad_accum)]
