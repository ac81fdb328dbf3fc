"""The training module: losses and gradients equal transformers', saved checkpoints serve the same
logits, expert parallelism over 2 ranks equals 1 rank, a killed rank resumes the loss curve under
torchrun --max-restarts, the data stream is deterministic and resumable, checkpoints are atomic.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.kv_cache import AttentionBatch, DenseKVCache, make_paged_cache
from models.loader import load_model
from tests.conftest import hf_model
from training.checkpoint import latest_checkpoint, load_trainer_state
from training.cli import add_parser, config_from_args
from training.config import TrainConfig, new_model_config
from training.data import BatchLayout, PackedSamples, ShuffledLoader, read_documents, tokenize_files
from training.losses import IGNORE, lm_loss, load_balancing_loss, router_z_loss
from training.metrics import active_params, find_stragglers, read_log, train_flops_per_token
from training.model import RouterLogits, Shard, build_model, forward_logits
from training.parallel import ParallelContext
from training.trainer import Trainer, train

ROOT = Path(__file__).resolve().parents[1]
COEF = 0.02


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The Python documentation's topics, one JSONL document each."""
    from models.builtin import corpus

    path = tmp_path_factory.mktemp("data") / "topics.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus()))
    return path


def _batch(vocab: int, B: int = 3, L: int = 19, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, vocab, (B, L), generator=torch.Generator().manual_seed(seed))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), IGNORE)], dim=1)  # labels = inputs shifted
    return ids, labels


def _ours_and_ref(ckpt: Path):
    cfg = ModelConfig.from_pretrained(ckpt)
    ours = build_model(cfg, Shard(tuple(range(cfg.num_experts))), torch.device("cpu"), init_from=ckpt)
    ref = hf_model(ckpt).train()
    ref.config.router_aux_loss_coef = ref.router_aux_loss_coef = COEF
    return cfg, ours, ref


def _our_losses(model, cfg: ModelConfig, ids, labels) -> tuple[torch.Tensor, torch.Tensor]:
    router = RouterLogits(model)
    lm = lm_loss(forward_logits(model, ids), labels.reshape(-1))
    aux = load_balancing_loss(router.take(), cfg.num_experts, cfg.top_k)
    router.remove()
    return lm, aux


# every family the server loads, and tied input/output embeddings
CASES = [("mixtral", {}), ("qwen2_moe", {}), ("qwen3_moe", {}), ("olmoe", {}),
         ("mixtral", {"tie_word_embeddings": True})]
CASE_IDS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral-tied"]


@pytest.mark.parametrize("family,overrides", CASES, ids=CASE_IDS)
def test_loss_equals_transformers(make_checkpoint, family, overrides):
    cfg, ours, ref = _ours_and_ref(make_checkpoint(family, **overrides))
    ids, labels = _batch(cfg.vocab_size)
    with torch.no_grad():
        lm, aux = _our_losses(ours, cfg, ids, labels)
        plain = ref(ids, labels=ids).loss  # transformers shifts the labels itself
        with_aux = ref(ids, labels=ids, output_router_logits=True)
    assert abs(lm.item() - plain.item()) < 1e-5 * plain.item()
    assert abs(aux.item() - with_aux.aux_loss.item()) < 1e-5 * with_aux.aux_loss.item()
    assert abs((lm + COEF * aux).item() - with_aux.loss.item()) < 1e-5 * with_aux.loss.item()


@pytest.mark.parametrize("family,overrides", CASES, ids=CASE_IDS)
def test_gradients_equal_transformers(make_checkpoint, family, overrides):
    cfg, ours, ref = _ours_and_ref(make_checkpoint(family, **overrides))
    assert cfg.tie_word_embeddings == bool(overrides)
    ids, labels = _batch(cfg.vocab_size, seed=1)
    lm, aux = _our_losses(ours, cfg, ids, labels)
    (lm + COEF * aux).backward()
    ref(ids, labels=ids, output_router_logits=True).loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    in_memory = {"experts.gate_up_proj": "experts.w13", "experts.down_proj": "experts.w2"}  # transformers 5 fuses
    checked = 0
    for name, p in ref.named_parameters():
        mine = name
        for theirs, ours_name in in_memory.items():
            mine = mine.replace(theirs, ours_name)
        rel = ((grads[mine] - p.grad).norm() / p.grad.norm()).item()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"
        checked += 1
    assert checked == len(grads)


MLA_CASES = [("deepseek_v3", {}), ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 3,
                                                  "topk_group": 2, "q_lora_rank": 16})]


@pytest.mark.parametrize("family,overrides", MLA_CASES, ids=["deepseek_v3", "deepseek_v2"])
def test_deepseek_loss_and_gradients_equal_transformers(make_checkpoint, family, overrides):
    """MLA, grouped routing with the correction bias, ungated shared experts, a dense first layer.
    transformers' DeepSeek models have no auxiliary loss: the language-model loss is compared."""
    cfg, ours, ref = _ours_and_ref(make_checkpoint(family, **overrides))
    ids, labels = _batch(cfg.vocab_size, seed=2)
    lm = lm_loss(forward_logits(ours, ids), labels.reshape(-1))
    theirs = ref(ids, labels=ids).loss
    assert abs(lm.item() - theirs.item()) < 1e-5 * theirs.item()
    lm.backward()
    theirs.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    checked = 0
    for name, p in ref.named_parameters():
        mine = name.replace("mlp.experts.gate_up_proj", "mlp.experts.w13").replace("mlp.experts.down_proj", "mlp.experts.w2")
        rel = ((grads[mine] - p.grad).norm() / p.grad.norm()).item()
        assert rel < 1e-4, f"{name}: relative gradient error {rel:.2e}"
        checked += 1
    assert checked == len(grads)


def test_bfloat16_autocast_loss_close_to_float32(make_checkpoint):
    cfg, ours, _ = _ours_and_ref(make_checkpoint("mixtral"))
    ids, labels = _batch(cfg.vocab_size)
    with torch.no_grad():
        full = lm_loss(forward_logits(ours, ids), labels.reshape(-1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = lm_loss(forward_logits(ours, ids), labels.reshape(-1))
    assert abs(low.item() - full.item()) < 2e-2 * full.item()


def test_cacheless_attention_equals_dense_cache_forward(make_checkpoint):
    """Rows of different lengths (the general path) and full rows both equal the serving forward."""
    ckpt = make_checkpoint("qwen2_moe", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    cfg = ModelConfig.from_pretrained(ckpt)
    served = load_model(ckpt)
    trained = build_model(cfg, Shard(tuple(range(cfg.num_experts))), torch.device("cpu"), init_from=ckpt)
    from training.model import CausalAttention
    for lens in ([7, 3, 5], [6, 6]):
        ids = torch.randint(2, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(3))
        batch = AttentionBatch.build(lens, [0] * len(lens), list(range(len(lens))))
        cache = DenseKVCache(cfg.num_layers, len(lens), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        with torch.no_grad():
            want = served.logits(served(ids, batch, cache))
            got = trained.logits(trained(ids, batch, CausalAttention()))
        assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_z_loss_and_distributed_balance_loss():
    logits = [torch.randn(10, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    z = torch.cat([torch.logsumexp(t, -1) for t in logits]).pow(2).mean()
    assert torch.allclose(router_z_loss(logits), z)
    # two "ranks" of 5 rows each: each sums its counts with the other's; the mean of their losses is the whole batch's
    whole = load_balancing_loss(logits, 4, 2)
    halves = [[t[:5] for t in logits], [t[5:] for t in logits]]
    totals = _counts(halves[0]) + _counts(halves[1])

    def all_reduce_of(half):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            assert torch.equal(t, _counts(half))  # this rank's expert counts and rows
            return totals
        return reduce

    per_rank = [load_balancing_loss(h, 4, 2, all_reduce_of(h)) for h in halves]
    assert torch.allclose(sum(per_rank) / 2, whole, atol=1e-6)


def _counts(logits: list[torch.Tensor]) -> torch.Tensor:
    counts = torch.zeros(4)
    for t in logits:
        counts += torch.bincount(torch.topk(t.softmax(-1), 2).indices.reshape(-1), minlength=4).float()
    return torch.cat([counts, torch.tensor([float(sum(t.shape[0] for t in logits))])])


def test_init_is_independent_of_expert_sharding():
    raw = new_model_config("mixtral", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 1, "expert_intermediate_size": 16, "num_experts": 4,
                                       "vocab_size": 64, "initializer_range": 0.05})
    cfg = ModelConfig.from_dict(raw)
    full = build_model(cfg, Shard((0, 1, 2, 3)), torch.device("cpu"), seed=3, initializer_range=0.05)
    half = build_model(cfg, Shard((2, 3)), torch.device("cpu"), seed=3, initializer_range=0.05)
    w = full.model.layers[0].mlp.experts.w13
    assert torch.equal(w[2:], half.model.layers[0].mlp.experts.w13)
    assert abs(w.std().item() - 0.05) < 0.005
    assert torch.equal(full.model.norm.weight, torch.ones(32))


def test_flops_count_only_active_experts():
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "expert_intermediate_size": 32, "num_experts_per_tok": 2, "vocab_size": 100}
    few, many = (ModelConfig.from_dict(new_model_config("mixtral", {**base, "num_experts": e})) for e in (4, 64))
    assert active_params(many) - active_params(few) == 2 * 64 * 60  # only the routers grow
    attn = 64 * 64 * 2 + 2 * 64 * 32
    assert active_params(few) == 100 * 64 + 2 * (attn + 64 * 4 + 2 * 3 * 64 * 32)
    assert train_flops_per_token(few, 128) == 6 * active_params(few) + 12 * 2 * 64 * 128


def test_stragglers_are_ranks_slower_than_the_median():
    assert find_stragglers([1.0, 1.1, 0.9, 2.0], 1.5) == [3]
    assert find_stragglers([1.0, 1.0], 1.5) == []


# ---- data ----------------------------------------------------------------------------------------

def test_loader_is_deterministic_by_seed_and_resumes_at_the_exact_sample():
    import numpy as np

    samples = PackedSamples(np.arange(1000, dtype=np.int64), seq_len=9)  # 111 samples
    layout = BatchLayout(micro_batch=4, grad_accum=2)

    def run(seed: int, steps: int, loader=None):
        loader = loader or ShuffledLoader(samples, layout, seed)
        return [torch.cat([x for x, _ in loader.next_step()]) for _ in range(steps)], loader

    a, _ = run(0, 30)  # crosses epochs (8 samples per step)
    assert all(torch.equal(x, y) for x, y in zip(a, run(0, 30)[0]))
    assert not torch.equal(a[0], run(1, 1)[0][0])
    _, first = run(0, 17)
    resumed = ShuffledLoader(samples, layout, 0)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a[17:], run(0, 13, resumed)[0]))
    x, y = ShuffledLoader(samples, layout, 0).next_step()[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one
    # the same global batch whatever the number of ranks
    ranks = [ShuffledLoader(samples, BatchLayout(2, 2, r, 2), 0).next_step() for r in range(2)]
    by_micro = [torch.cat([ranks[r][a][0] for r in range(2)]) for a in range(2)]
    assert torch.equal(torch.cat(by_micro), a[0])
    other = ShuffledLoader(PackedSamples(np.arange(900), 9), layout, 0)
    with pytest.raises(ValueError, match="cannot resume the data stream"):
        other.load_state_dict(first.state_dict())


def test_documents_and_token_cache(tmp_path, tokenizer_dir):
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n\n{"text": "second doc"}\n')
    (tmp_path / "b.txt").write_text("plain text file")
    assert list(read_documents([tmp_path / "a.jsonl", tmp_path / "b.txt"])) == ["hello world", "second doc",
                                                                                "plain text file"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected an object with a string field 'text'"):
        list(read_documents([tmp_path / "bad.jsonl"]))
    path = tokenize_files([tmp_path / "a.jsonl"], tokenizer_dir, 0, tmp_path / "cache")
    import numpy as np
    tokens = np.load(path)
    assert (tokens == 0).sum() == 2 and tokens[-1] == 0  # one eos after each document
    assert tokenize_files([tmp_path / "a.jsonl"], tokenizer_dir, 0, tmp_path / "cache") == path


def test_config_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="exactly one of --init-from, --config, --family"):
        TrainConfig(out=tmp_path, data=("x",), init_from="a", family="mixtral", max_steps=1)
    with pytest.raises(ValueError, match="--seq-len must be >= 1"):
        TrainConfig(out=tmp_path, data=("x",), family="mixtral", max_steps=1, seq_len=0)
    with pytest.raises(ValueError, match="--max-steps or --max-minutes"):
        TrainConfig(out=tmp_path, data=("x",), family="mixtral")
    with pytest.raises(ValueError, match="--family 'llama'"):
        TrainConfig(out=tmp_path, data=("x",), family="llama", max_steps=1)


def test_cli_flags_map_to_the_config(tmp_path):
    import argparse

    parser = argparse.ArgumentParser(prog="shuttle")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--family", "qwen2_moe", "--hidden-size", "64", "--num-experts", "4",
                              "--top-k", "2", "--set", "norm_topk_prob=true", "--data", "a.jsonl", "b.txt",
                              "--out", str(tmp_path), "--max-steps", "5", "--dtype", "bfloat16", "--no-progress"])
    cfg = config_from_args(args)
    assert cfg.model_flags == {"hidden_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}
    assert cfg.data == ("a.jsonl", "b.txt") and cfg.dtype == "bfloat16" and not cfg.progress and cfg.resume
    assert args.func.__name__ == "run_from_args"
    raw = new_model_config("qwen2_moe", cfg.model_flags)
    assert raw["num_experts"] == 4 and raw["architectures"] == ["Qwen2MoeForCausalLM"] and raw["norm_topk_prob"]


def test_set_and_shape_flag_errors():
    from training.cli import parse_set

    assert parse_set(["rope_theta=10000", 'hidden_act="silu"']) == {"rope_theta": 10000, "hidden_act": "silu"}
    with pytest.raises(ValueError, match="--set 'hidden_act=silu': 'silu' is not valid JSON"):
        parse_set(["hidden_act=silu"])
    with pytest.raises(ValueError, match="expected FIELD=JSON"):
        parse_set(["rope_theta"])
    with pytest.raises(ValueError, match="--shared-expert-intermediate-size does not apply to --family mixtral"):
        new_model_config("mixtral", {"shared_expert_intermediate_size": 16})
    with pytest.raises(ValueError, match="--intermediate-size: olmoe sizes its experts"):
        new_model_config("olmoe", {"intermediate_size": 16})
    assert new_model_config("qwen3_moe", {"head_dim": 24})["head_dim"] == 24


# ---- runs ----------------------------------------------------------------------------------------

def _cfg(out: Path, data: Path, **kw) -> TrainConfig:
    base = dict(out=out, data=(str(data),), seq_len=32, micro_batch_size=4, max_steps=4, lr=3e-3, warmup_steps=2,
                log_every=2, progress=False)
    return TrainConfig(**{**base, **kw})


def test_saved_checkpoint_serves_the_training_models_logits(make_checkpoint, corpus, tmp_path):
    ckpt = make_checkpoint("mixtral")
    trainer = Trainer(_cfg(tmp_path / "run", corpus, init_from=str(ckpt), eval_data=(str(corpus),),
                           aux_loss_coef=0.01), ParallelContext())
    summary = trainer.run()
    assert summary["step"] == 4 and summary["eval_loss"] is not None and summary["tokens_per_s"] > 0
    ids, _ = _batch(512, B=2, L=11, seed=5)
    with torch.no_grad():
        want = forward_logits(trainer.model, ids)
    for d in (tmp_path / "run", latest_checkpoint(tmp_path / "run")):
        for f in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
            assert (d / f).is_file(), f
        served = load_model(d)
        cfg = served.cfg
        cache = DenseKVCache(cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        with torch.no_grad():
            got = served.logits(served(ids.reshape(-1), AttentionBatch.build([11, 11], [0, 0], [0, 1]), cache))
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
    ref = hf_model(tmp_path / "run")  # transformers reads the saved config.json and tensors as its own
    with torch.no_grad():
        assert (ref(ids).logits.reshape(-1, 512) - want).abs().max() < 1e-4 * want.abs().max()
    from server import LLM, SamplingParams
    out = LLM(tmp_path / "run").generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    with torch.no_grad():
        first = forward_logits(trainer.model, torch.tensor([[5, 6, 7]]))[-1].argmax().item()
    assert out[0].outputs[0].token_ids[0] == first


def test_trained_deepseek_checkpoint_serves_the_training_models_logits(make_checkpoint, corpus, tmp_path):
    ckpt = make_checkpoint("deepseek_v3")
    trainer = Trainer(_cfg(tmp_path / "run", corpus, init_from=str(ckpt), max_steps=2), ParallelContext())
    trainer.run()
    ids, _ = _batch(512, B=2, L=11, seed=5)
    with torch.no_grad():
        want = forward_logits(trainer.model, ids)
        served = load_model(tmp_path / "run")
        cache = make_paged_cache(served.cfg, 6, 4, torch.float32, "cpu", served.ops)
        batch = AttentionBatch.build_paged([11, 11], [0, 0], [[0, 1, 2], [3, 4, 5]], 4)
        got = served.logits(served(ids.reshape(-1), batch, cache))
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
        ref = hf_model(tmp_path / "run")
        assert (ref(ids).logits.reshape(-1, 512) - want).abs().max() < 1e-4 * want.abs().max()
    bias = served.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # kept (not trained by gradients)


def test_new_model_with_trained_tokenizer_and_bfloat16_files(corpus, tmp_path):
    cfg = _cfg(tmp_path / "run", corpus, family="qwen2_moe", max_steps=2, dtype="bfloat16", save_dtype="bfloat16",
               model_flags={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "expert_intermediate_size": 16, "intermediate_size": 32,
                            "shared_expert_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
                            "vocab_size": 300})
    train(cfg)
    served = load_model(tmp_path / "run")
    assert served.lm_head.weight.dtype == torch.bfloat16
    raw = json.loads((tmp_path / "run" / "config.json").read_text())
    assert raw["dtype"] == "bfloat16" and raw["model_type"] == "qwen2_moe" and raw["vocab_size"] == 300
    tok = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert raw["eos_token_id"] == 0 and tok["eos_token"] == "<|endoftext|>"
    master = latest_checkpoint(tmp_path / "run") / "trainer" / "master" / "model.safetensors"
    assert master.is_file()  # float32 weights for exact resumption


def test_float16_files_and_the_tokenizer_outlive_pruned_checkpoints(make_checkpoint, corpus, tmp_path):
    """A resumed run's tokenizer came from a checkpoint that pruning deletes: later checkpoints and
    the exported model still carry it (OUT/tokenizer)."""
    out = tmp_path / "run"
    kw = dict(init_from=str(make_checkpoint("mixtral")), save_every=1, keep_checkpoints=1, save_dtype="float16")
    train(_cfg(out, corpus, max_steps=2, **kw))
    train(_cfg(out, corpus, max_steps=5, **kw))  # resumes at 2; step-2 (its tokenizer's source) is pruned
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == ["step-00000005"]
    for d in (out, latest_checkpoint(out)):
        assert (d / "tokenizer.json").read_bytes() == (make_checkpoint("mixtral") / "tokenizer.json").read_bytes()
        assert load_model(d).lm_head.weight.dtype == torch.float16
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"


def test_new_model_needs_a_tokenizer_with_eos(corpus, tmp_path, tokenizer_dir):
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    tok_cfg = json.loads((tok / "tokenizer_config.json").read_text())
    tok_cfg.pop("eos_token")
    (tok / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = _cfg(tmp_path / "run", corpus, family="mixtral", tokenizer=str(tok), max_steps=1,
               model_flags={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                            "num_key_value_heads": 1, "expert_intermediate_size": 16, "num_experts": 2,
                            "num_experts_per_tok": 1, "vocab_size": 512})
    with pytest.raises(ValueError, match=f"the tokenizer in {tok} defines no eos_token"):
        train(cfg)


def test_a_step_with_a_non_finite_gradient_is_skipped(make_checkpoint, corpus, tmp_path):
    trainer = Trainer(_cfg(tmp_path / "run", corpus, init_from=str(make_checkpoint("mixtral"))), ParallelContext())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    param = next(trainer.model.parameters())
    hook = param.register_hook(lambda g: g * float("inf"))  # an overflow somewhere in backward
    stats = trainer.train_step(trainer.loader.next_step())
    hook.remove()
    assert stats["skipped"] and not torch.isfinite(torch.tensor(stats["grad_norm"]))
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert not trainer.optimizer.state and trainer.step == 1 and trainer.skipped_steps == 1
    stats = trainer.train_step(trainer.loader.next_step())  # the next step trains as usual
    assert not stats["skipped"] and trainer.step == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_crash_mid_write_leaves_latest_valid(make_checkpoint, corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_cfg(out, corpus, init_from=str(make_checkpoint("mixtral")), max_steps=2))
    assert latest_checkpoint(out).name == "step-00000002"
    import training.checkpoint as ck

    def crash(*a, **k):
        raise OSError("disk died mid-write")

    monkeypatch.setattr(ck.torch, "save", crash)  # model files written, trainer state not
    with pytest.raises(OSError, match="disk died"):
        train(_cfg(out, corpus, init_from=str(make_checkpoint("mixtral")), max_steps=4))
    monkeypatch.undo()
    assert (out / "checkpoints" / ".tmp-step-00000004").is_dir()
    latest = latest_checkpoint(out)
    assert latest.name == "step-00000002"
    load_model(latest)
    assert load_trainer_state(latest, ParallelContext())["step"] == 2
    summary = train(_cfg(out, corpus, init_from=str(make_checkpoint("mixtral")), max_steps=4))  # resumes at 2
    assert summary["steps_this_run"] == 2 and latest_checkpoint(out).name == "step-00000004"
    assert not (out / "checkpoints" / ".tmp-step-00000004").exists()


# ---- several ranks (torchrun) --------------------------------------------------------------------

RUN_FLAGS = ["--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "12", "--lr", "3e-3", "--warmup-steps",
             "2", "--log-every", "2", "--save-every", "4", "--aux-loss-coef", "0.01", "--no-progress"]


def _torchrun(ckpt: Path, data: Path, out: Path, *extra: str, restarts: int = 0) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), "-m", "training", "--init-from", str(ckpt), "--data", str(data),
           "--out", str(out), *RUN_FLAGS, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def two_rank_run(make_checkpoint, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep2")
    proc = _torchrun(make_checkpoint("mixtral"), corpus, out)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    return out


def _losses(out: Path) -> list[tuple[float, float]]:
    return [(r["lm_loss"], r["loss"]) for r in read_log(out / "train_log.jsonl")]


@pytest.fixture(scope="module")
def one_rank_run(make_checkpoint, corpus, tmp_path_factory) -> Path:
    one = tmp_path_factory.mktemp("one")
    flags = dict(seq_len=32, micro_batch_size=4, max_steps=12, lr=3e-3, warmup_steps=2, log_every=2, save_every=4,
                 aux_loss_coef=0.01, progress=False)
    train(TrainConfig(out=one, data=(str(corpus),), init_from=str(make_checkpoint("mixtral")), **flags))
    return one


@pytest.mark.slow
def test_expert_parallel_two_ranks_equals_one(one_rank_run, two_rank_run):
    one = one_rank_run
    meta = json.loads((latest_checkpoint(two_rank_run) / "trainer" / "meta.json").read_text())
    assert (meta["world_size"], meta["ep_size"]) == (2, 2)
    index = json.loads((two_rank_run / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == "model-00002-of-00002.safetensors"
    a, b = _losses(one), _losses(two_rank_run)
    assert len(a) == len(b) == 12
    for step, ((lm1, tot1), (lm2, tot2)) in enumerate(zip(a, b), 1):
        assert abs(lm1 - lm2) < 1e-4 * lm1 and abs(tot1 - tot2) < 1e-4 * tot1, f"step {step}: {a[step - 1]} vs {b[step - 1]}"
    assert a[-1][0] < a[0][0] - 0.1  # it learns
    ours, theirs = load_model(one), load_model(two_rank_run)  # the sharded checkpoint loads as one model
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert (p - q).abs().max() < 1e-3, n


def _read_json(path: Path, tries: int = 100) -> dict:
    for _ in range(tries):  # replaced atomically, but read while the writer may still be creating it
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.02)
    raise AssertionError(f"{path} unreadable")


@pytest.mark.slow
def test_data_parallel_two_ranks_equals_one(make_checkpoint, corpus, tmp_path, one_rank_run):
    """--expert-parallel 1: every rank holds every expert; gradients are averaged over both."""
    proc = _torchrun(make_checkpoint("mixtral"), corpus, tmp_path, "--expert-parallel", "1", "--max-steps", "4")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "model.safetensors").is_file()  # one copy of the experts: one file
    a, b = _losses(one_rank_run)[:4], _losses(tmp_path)
    assert len(b) == 4 and all(abs(x[1] - y[1]) < 1e-4 * x[1] for x, y in zip(a, b)), (a, b)


@pytest.mark.slow
def test_builtin_recipe_runs_and_writes_a_model_card(tmp_path):
    from training.builtin import MODEL
    from training.cli import main
    from training.metrics import active_params

    out = tmp_path / "builtin"
    # the recipe's corpus, tokenizer and data pipeline with a much smaller model, two steps
    code = main(["--recipe", "builtin", "--out", str(out), "--max-steps", "2", "--seq-len", "64",
                 "--micro-batch-size", "2", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2",
                 "--num-kv-heads", "1", "--expert-intermediate-size", "32", "--vocab-size", "512",
                 "--eval-batches", "1", "--no-progress"])
    assert code == 0
    card = (out / "README.md").read_text()
    assert "held-out loss" in card and "docstrings" in card and "--max-steps 2" in card
    lines = (out / "data" / "train.jsonl").read_text().splitlines()
    names = {json.loads(line)["name"] for line in lines}
    assert "module:json.decoder" in names or "module:json.decoder" in (out / "data" / "eval.jsonl").read_text()
    assert any(n.startswith("topic:") for n in names)
    test_parts = {"test", "tests", "idle_test"}  # no test package's docstrings (builtin._SKIP_DIRS)
    assert not any(test_parts & set(n.removeprefix("module:").split(".")) for n in names if n.startswith("module:"))
    assert 0 < len((out / "data" / "eval.jsonl").read_text().splitlines()) < len(lines) / 20
    load_model(out)
    full = ModelConfig.from_dict(new_model_config("mixtral", MODEL))
    n_params = sum(p.numel() for p in _meta_model(full).parameters())
    assert 2 * n_params < 50e6  # the real recipe's bfloat16 checkpoint stays under 50 MB
    assert active_params(full) < n_params / 2


def _meta_model(cfg: ModelConfig):
    from models.moe_decoder import MoEForCausalLM
    with torch.device("meta"):
        return MoEForCausalLM(cfg)


@pytest.mark.slow
def test_killed_rank_resumes_the_loss_curve(make_checkpoint, corpus, tmp_path, two_rank_run):
    out = tmp_path / "killed"
    proc = _torchrun(make_checkpoint("mixtral"), corpus, out, "--debug-delay", "0:0.25", restarts=1)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            pointer = out / "checkpoints" / "latest"
            if pointer.is_file() and pointer.read_text().strip() >= "step-00000004":
                break
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        beat = _read_json(out / "heartbeat" / "rank-1.json")
        killed_at = beat["step"]
        os.kill(beat["pid"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    events = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["restart"] == 1 and 4 <= resumes[0]["step"] <= killed_at
    assert any(e["event"] == "straggler" and e["rank"] == 0 for e in events)  # rank 0 sleeps every step
    want, got = _losses(two_rank_run), _losses(out)
    assert len(got) == 12
    for step, (w, g) in enumerate(zip(want, got), 1):
        assert abs(w[0] - g[0]) < 1e-6 * w[0], f"step {step}: {g} vs uninterrupted {w}"
    assert (out / "tokenizer.json").is_file() and (latest_checkpoint(out) / "tokenizer.json").is_file()
    resumed, uninterrupted = load_model(out), load_model(two_rank_run)  # the final weights too
    for (n, p), q in zip(resumed.named_parameters(), uninterrupted.parameters()):
        assert (p - q).abs().max() < 1e-5, n
