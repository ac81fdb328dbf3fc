"""Training an MTP layer (`shuttle train --mtp-layers 1`, training/trainer.py): with the model, its loss
(weight x the cross entropy of the token after next) falls and the saved checkpoint serves speculative
method mtp with the greedy ids of plain decoding (and transformers still loads it); alone on a frozen
checkpoint (--train-only mtp) every other tensor comes out bitwise unchanged; the built-in model's MTP
head drafts without changing its greedy output."""
import json

import pytest
import torch
from safetensors.torch import load_file

from models.config import ModelConfig
from server import LLM, SamplingParams
from tests.conftest import PROMPTS, hf_model
from training.config import TrainConfig
from training.metrics import read_log
from training.model import forward_logits
from training.parallel import ParallelContext
from training.trainer import Trainer

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from models.builtin import corpus

    path = tmp_path_factory.mktemp("data") / "topics.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus()[:120]))
    return path


def _tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _mtp_losses(out) -> list[float]:
    return [s["mtp_loss"] for s in read_log(out / "train_log.jsonl")]


def _greedy(d, **kw) -> tuple[list[list[int]], dict]:
    llm = LLM(d, **kw)
    try:
        ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return ids, llm.engine.stats().get("spec_decode") or {}
    finally:
        llm.shutdown()


def test_mtp_layer_trains_with_the_model_and_its_checkpoint_serves(make_checkpoint, corpus, tmp_path):
    ckpt, out = make_checkpoint("mixtral"), tmp_path / "run"
    cfg = TrainConfig(out=out, data=(str(corpus),), eval_data=(str(corpus),), init_from=str(ckpt), seq_len=32,
                      micro_batch_size=4, max_steps=30, lr=3e-3, warmup_steps=2, log_every=10, eval_batches=1,
                      progress=False, mtp_layers=1, mtp_loss_weight=0.3)
    trainer = Trainer(cfg, ParallelContext())
    summary = trainer.run()
    steps = read_log(out / "train_log.jsonl")
    mtp = _mtp_losses(out)
    assert sum(mtp[-5:]) / 5 < sum(mtp[:5]) / 5 - 0.5, mtp
    assert all(abs(s["loss"] - (s["lm_loss"] + 0.3 * s["mtp_loss"])) < 1e-4 for s in steps)
    assert summary["eval_mtp_loss"] is not None
    raw = json.loads((out / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1 and ModelConfig.from_pretrained(out).num_mtp_layers == 1
    names = set(_tensors(out))
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.block_sparse_moe.experts.7.w2.weight"} <= names
    # transformers ignores the key and the extra tensors: its logits are the trained model's
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = forward_logits(trainer.model, ids)
        got = hf_model(out)(ids).logits[0]
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    plain, _ = _greedy(out, dtype="float32")
    spec_ids, stats = _greedy(out, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert spec_ids == plain and stats["num_draft_tokens"] > 0


def test_train_only_mtp_leaves_the_model_bitwise_unchanged(make_checkpoint, corpus, tmp_path):
    from training.cli import main

    ckpt, out = make_checkpoint("mixtral", dtype="bfloat16"), tmp_path / "mtp"
    code = main(["--init-from", str(ckpt), "--data", str(corpus), "--out", str(out), "--mtp-layers", "1",
                 "--train-only", "mtp", "--mtp-dense", "--mtp-distill", "--max-steps", "20", "--seq-len", "32",
                 "--micro-batch-size", "4", "--lr", "1e-2", "--warmup-steps", "2", "--aux-loss-coef", "0.01",
                 "--no-progress"])
    assert code == 0
    before, after = _tensors(ckpt), _tensors(out)
    prefix = "model.layers.2."
    assert set(after) - {n for n in after if n.startswith(prefix)} == set(before)
    for name, t in before.items():
        assert after[name].dtype == t.dtype == torch.bfloat16
        assert torch.equal(after[name].view(torch.int16), t.view(torch.int16)), name
    mtp = {n[len(prefix):] for n in after if n.startswith(prefix)}
    assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
            "mlp.gate_proj.weight", "self_attn.q_proj.weight"} <= mtp and not any("experts" in n for n in mtp)
    steps = read_log(out / "train_log.jsonl")
    losses = [s["mtp_distill_loss"] for s in steps]  # (--mtp-distill: against the model's own distribution)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2, losses
    assert len({round(s["lm_loss"], 3) for s in steps}) > 1  # (different batches) ...
    assert all(abs(s["loss"] - 0.3 * s["mtp_distill_loss"]) < 1e-4 for s in steps)  # ... only the MTP loss trains


def test_mtp_distillation_loss_and_agreement():
    """--mtp-distill's loss is the cross entropy against the model's distribution one position on
    (a one-hot teacher gives plain cross entropy, IGNORE positions left out) and its gradient is
    softmax(student) - teacher; agreement counts top tokens equal to the teacher's."""
    from training.losses import IGNORE, mtp_agreement, mtp_distill_loss
    from training.model import next_position

    g = torch.Generator().manual_seed(0)
    B, L, V = 2, 5, 11
    target_TV = torch.randn(B * L, V, generator=g)
    next_TV = next_position(target_TV, B, L)
    assert torch.equal(next_TV[L - 1], target_TV[L + 1])  # row 1's first MTP position: the target's position 1
    labels_T = torch.randint(0, V, (B * (L - 1),), generator=g)
    labels_T[3] = IGNORE
    student_TV = torch.randn(B * (L - 1), V, generator=g, requires_grad=True)
    one_hot_TV = 60.0 * torch.nn.functional.one_hot(next_TV.argmax(-1), V).float()
    ce = torch.nn.functional.cross_entropy(student_TV, torch.where(labels_T == IGNORE, IGNORE, next_TV.argmax(-1)),
                                           ignore_index=IGNORE)
    assert torch.allclose(mtp_distill_loss(student_TV, one_hot_TV, labels_T), ce, atol=1e-5)
    loss = mtp_distill_loss(student_TV, next_TV, labels_T)
    loss.backward()
    keep = labels_T != IGNORE
    want = (torch.softmax(student_TV.detach(), -1) - torch.softmax(next_TV, -1)) / int(keep.sum())
    assert torch.allclose(student_TV.grad, torch.where(keep[:, None], want, 0.0), atol=1e-6)
    same = (student_TV.argmax(-1) == next_TV.argmax(-1))[keep].float().mean()
    assert mtp_agreement(student_TV, next_TV, labels_T) == same
    assert mtp_agreement(next_TV, next_TV, labels_T) == 1.0


def test_mtp_flags_are_checked(tmp_path):
    base = dict(out=tmp_path, data=("x",), max_steps=1)
    with pytest.raises(ValueError, match="--mtp-layers must be 0 or 1"):
        TrainConfig(family="mixtral", mtp_layers=2, **base)
    with pytest.raises(ValueError, match="--train-only mtp needs --mtp-layers 1"):
        TrainConfig(init_from="a", train_only="mtp", **base)
    with pytest.raises(ValueError, match="--train-only mtp trains an MTP layer for an existing model"):
        TrainConfig(family="mixtral", mtp_layers=1, train_only="mtp", **base)
    with pytest.raises(ValueError, match="--mtp-distill needs --mtp-layers 1"):
        TrainConfig(family="mixtral", mtp_distill=True, **base)
    with pytest.raises(ValueError, match="--mtp-depth needs --mtp-layers 1"):
        TrainConfig(family="mixtral", mtp_depth=2, **base)
    with pytest.raises(ValueError, match="--mtp-depth must be a positive integer"):
        TrainConfig(family="mixtral", mtp_layers=1, mtp_depth=0, **base)


def test_write_generations_continues_training_prompts(tmp_path):
    """The MTP head's self-distillation data: the model's continuations of prompts cut from the training
    split (half greedy, half sampled with per-request seeds), one JSON line each without a final EOS's
    text (the data pipeline ends each document), the same again from the same seed."""
    import json

    from models.builtin import builtin_model_dir
    from training.builtin import documents, is_held_out, write_generations

    path = write_generations(builtin_model_dir(), tmp_path / "gen.jsonl", 4, seed=3, prompt_tokens=8, new_tokens=5)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["name"] for d in lines] == [f"gen3:{i}" for i in range(4)]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(builtin_model_dir() / "tokenizer.json"))
    train = "".join(t for name, t in documents() if not is_held_out(name))
    for d in lines:
        ids = tok.encode(d["text"]).ids
        assert 8 < len(ids) <= 8 + 5 + 2, d  # (re-encoding may merge a token at the seam)
        assert tok.decode(ids[:6]) in train  # the prompt: a piece of a training document
        assert not d["text"].endswith("<|endoftext|>")
    assert write_generations(builtin_model_dir(), tmp_path / "again.jsonl", 4, seed=3, prompt_tokens=8,
                             new_tokens=5).read_text() == path.read_text()


def test_the_builtin_models_mtp_head_keeps_greedy_ids():
    from models.builtin import builtin_model_dir

    d = builtin_model_dir()
    assert ModelConfig.from_pretrained(d).num_mtp_layers == 1
    llm = LLM(dtype="float32")
    try:
        prompts = [llm.tokenizer.encode(t) for t in ("The for statement is used to", "A tuple is",
                                                     "Return the number of items in")]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()
    llm = LLM(dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()["spec_decode"]
    finally:
        llm.shutdown()
    assert spec == plain
    assert stats["num_accepted_tokens"] > 0.2 * stats["num_draft_tokens"], stats


@pytest.mark.slow
def test_expert_parallel_training_with_an_mtp_layer_equals_one_rank(make_checkpoint, corpus, tmp_path):
    """--expert-parallel 2 with an MTP layer (MoE, its experts sharded like the model's): the same
    losses, the MTP loss included, as one rank at the same global batch, and the same checkpoint."""
    from models.loader import load_model
    from tests.test_training import _torchrun
    from training.checkpoint import latest_checkpoint

    ckpt, flags = make_checkpoint("mixtral"), ["--mtp-layers", "1", "--mtp-loss-weight", "0.3"]
    proc = _torchrun(ckpt, corpus, tmp_path / "ep2", "--expert-parallel", "2", *flags)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    one = tmp_path / "one"
    Trainer(TrainConfig(out=one, data=(str(corpus),), init_from=str(ckpt), seq_len=32, micro_batch_size=4,
                        max_steps=12, lr=3e-3, warmup_steps=2, log_every=2, save_every=4, aux_loss_coef=0.01,
                        progress=False, mtp_layers=1, mtp_loss_weight=0.3), ParallelContext()).run()
    a, b = read_log(one / "train_log.jsonl"), read_log(tmp_path / "ep2" / "train_log.jsonl")
    assert len(a) == len(b) == 12
    for x, y in zip(a, b):
        for key in ("lm_loss", "mtp_loss", "loss"):
            assert abs(x[key] - y[key]) < 1e-4 * x[key], (key, x, y)
    assert _mtp_losses(one)[-1] < _mtp_losses(one)[0]
    ours, theirs = _tensors(one), _tensors(tmp_path / "ep2")
    assert ours.keys() == theirs.keys() and any(".layers.2." in n and "experts" in n for n in ours)
    for n, t in ours.items():
        assert (t.float() - theirs[n].float()).abs().max() < 1e-3, n
    load_model(latest_checkpoint(tmp_path / "ep2"))
