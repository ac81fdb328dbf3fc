"""The built-in model (models/builtin/): committed, small, trained, and the default of LLM and the CLI.

"Trained" is measured, not eyeballed: on English text it never saw (written here), its cross entropy
(4.1 nats per token when committed) is far below a uniform guess over the vocabulary (ln 4096 = 8.3
nats, about what random weights score), and its greedy text is made of English words.
"""
import math

import pytest
import torch

from models.builtin import builtin_model_dir
from models.config import ModelConfig
from models.loader import load_model
from server import LLM, SamplingParams
from training.model import forward_logits

UNSEEN = ("The list is a mutable sequence of objects. You can append an item to the end of the list, and the "
          "length of the list grows by one. A tuple is like a list, but it cannot be changed once it is created.")


def test_the_checkpoint_is_committed_and_small():
    d = builtin_model_dir()
    files = {f.name for f in d.iterdir()}
    assert {"config.json", "README.md", "tokenizer.json", "generation_config.json"} <= files
    weights = list(d.glob("*.safetensors"))
    assert weights and sum(f.stat().st_size for f in weights) < 50 * 2 ** 20
    assert ModelConfig.from_pretrained(d).num_experts == 8
    card = (d / "README.md").read_text()
    assert "shuttle train --recipe builtin" in card and "held-out" in card


def test_it_is_trained():
    d = builtin_model_dir()
    llm = LLM()
    ids = torch.tensor([llm.tokenizer.encode(UNSEEN)])
    model = load_model(d, dtype=torch.float32, kernels="torch").eval()
    with torch.no_grad():
        logits = forward_logits(model, ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]).item()
    assert nll < 5.0 < math.log(model.cfg.vocab_size) - 2, f"cross entropy {nll:.2f} nats per token"
    out = llm.generate("A tuple is", SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    words = [w.strip(".,:;()`'\"") for w in out.text.split()]
    assert sum(w.lower() in {"the", "a", "is", "of", "to", "and", "in", "an", "be", "it"} for w in words) >= 2, out.text


@pytest.mark.slow
def test_the_cli_serves_it_by_default(capsys):
    from server.cli import main

    assert main(["generate", "--prompt", "The for statement", "--max-tokens", "8", "--json"]) == 0
    assert '"finish_reason"' in capsys.readouterr().out
