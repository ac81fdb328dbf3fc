"""The continuous-batching engine: greedy equality with transformers while requests join and leave,
preemption, chunked prefill, prefix caching, aborts, and block accounting."""
import random

import pytest
import torch

from attention_nodes.config import CacheConfig, EngineConfig, SchedulerConfig
from attention_nodes.engine import LLMEngine, validate_request
from attention_nodes.sampling_params import SamplingParams
from tests.conftest import hf_model

GREEDY = dict(temperature=0, ignore_eos=True)


def make_engine(ckpt, max_num_seqs=16, max_num_batched_tokens=256, block_size=4, num_blocks=256,
                prefix=True, chunked=True) -> LLMEngine:
    return LLMEngine(EngineConfig(str(ckpt), device="cpu",
                                  scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked),
                                  cache=CacheConfig(block_size, num_blocks, None, prefix)))


def run_staggered(engine: LLMEngine, requests: list[tuple[int, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """requests: (step at which it arrives, prompt, params). Returns request id -> generated ids."""
    out: dict[str, list[int]] = {}
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
            out[f"r{i}"] = []
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
        step += 1
    return out


def hf_greedy(ckpt, prompt: list[int], n: int) -> list[int]:
    ref = hf_greedy.cache.get(ckpt) or hf_greedy.cache.setdefault(ckpt, hf_model(ckpt))
    ref.generation_config.eos_token_id = None
    return ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=1)[0, len(prompt):].tolist()


hf_greedy.cache = {}


def prompts(n: int, seed: int, lo: int = 1, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_staggered_arrivals_equal_transformers(make_checkpoint, family):
    ckpt = make_checkpoint(family)
    rng = random.Random(1)
    reqs = [(rng.randint(0, 12), p, SamplingParams(max_tokens=rng.randint(1, 14), **GREEDY))
            for p in prompts(8, seed=2)]
    got = run_staggered(make_engine(ckpt, max_num_seqs=5), reqs)
    for i, (_, p, sp) in enumerate(reqs):
        assert got[f"r{i}"] == hf_greedy(ckpt, p, sp.max_tokens), f"request {i} (prompt of {len(p)})"


def test_preemption_with_a_small_kv_pool_keeps_outputs_exact(make_checkpoint):
    ckpt = make_checkpoint("mixtral")
    reqs = [(0, p, SamplingParams(max_tokens=16, **GREEDY)) for p in prompts(6, seed=3, lo=10, hi=20)]
    engine = make_engine(ckpt, block_size=4, num_blocks=20)  # 80 token slots for 6 x (up to 36) tokens
    got = run_staggered(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for i, (_, p, sp) in enumerate(reqs):
        assert got[f"r{i}"] == hf_greedy(ckpt, p, 16), f"request {i}"
    assert engine.blocks.num_free_blocks == 20


def test_chunked_prefill_and_budget(make_checkpoint):
    ckpt = make_checkpoint("qwen3_moe")
    reqs = [(0, p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts(4, seed=4, lo=20, hi=45)]
    engine = make_engine(ckpt, max_num_batched_tokens=7)  # every prompt is split over several steps
    got = run_staggered(engine, reqs)
    for i, (_, p, sp) in enumerate(reqs):
        assert got[f"r{i}"] == hf_greedy(ckpt, p, 6)


def test_unchunked_prefill_needs_a_context_sized_budget_and_waits_for_room(make_checkpoint):
    ckpt = make_checkpoint("mixtral")  # context 512
    with pytest.raises(ValueError, match="chunked prefill"):
        make_engine(ckpt, max_num_batched_tokens=16, chunked=False)  # a 28-token prompt could never run
    engine = make_engine(ckpt, max_num_batched_tokens=512, chunked=False, block_size=16, num_blocks=64)
    long = prompts(2, seed=9, lo=300, hi=300)
    for i, p in enumerate(long):
        engine.add_request(f"l{i}", p, SamplingParams(max_tokens=2, **GREEDY))
    engine.step()  # only the first 300-token prompt fits this step's 512 tokens whole
    assert [s.request_id for s in engine.scheduler.running] == ["l0"] and len(engine.scheduler.waiting) == 1
    out = {"l0": [], "l1": []}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out[d.request_id] += d.new_token_ids
    assert out["l1"] == hf_greedy(ckpt, long[1], 2)


def test_prefix_cache_hit_equals_miss_and_counts_skipped_tokens(make_checkpoint):
    ckpt = make_checkpoint("olmoe")
    shared = prompts(1, seed=5, lo=30, hi=30)[0]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    cached = make_engine(ckpt, block_size=4)
    run_staggered(cached, [(0, first, SamplingParams(max_tokens=5, **GREEDY))])
    hits_before = cached.blocks.prefix_hits
    engine_out = []
    cached.add_request("b", second, SamplingParams(max_tokens=8, **GREEDY))
    cached_tokens = None
    while cached.has_unfinished_requests():
        for d in cached.step():
            engine_out += d.new_token_ids
            cached_tokens = d.num_cached_tokens
    assert cached_tokens == 28 and cached.blocks.prefix_hits - hits_before == 28  # 7 full blocks of 4
    fresh = run_staggered(make_engine(ckpt, block_size=4, prefix=False), [(0, second, SamplingParams(max_tokens=8, **GREEDY))])
    assert engine_out == fresh["r0"] == hf_greedy(ckpt, second, 8)


def test_identical_prompts_in_one_batch_share_blocks(make_checkpoint):
    engine = make_engine(make_checkpoint("mixtral"), block_size=4)
    p = prompts(1, seed=6, lo=17, hi=17)[0]
    engine.add_request("a", p, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()  # a's prompt is computed and its 4 full blocks registered
    engine.add_request("b", p, SamplingParams(max_tokens=3, **GREEDY))
    engine.step()
    a, b = engine.requests["a"][0], engine.requests["b"][0]
    assert a.block_table[:4] == b.block_table[:4] and b.num_cached_prompt_tokens == 16
    assert all(engine.blocks.blocks[i].ref_count == 2 for i in a.block_table[:4])


def test_thousand_requests_with_random_aborts_free_every_block(make_checkpoint):
    engine = make_engine(make_checkpoint("qwen3_moe"), max_num_seqs=32, block_size=4, num_blocks=96)
    rng = random.Random(7)
    live: list[str] = []
    added = finished = aborted = 0
    while added < 1000 or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 12)):
            if added < 1000:
                p = [rng.randrange(2, 500) for _ in range(rng.randint(1, 12))]
                sp = SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0, 1.0]), ignore_eos=True,
                                    n=rng.choice([1, 1, 2]))
                engine.add_request(f"q{added}", p, sp)
                live.append(f"q{added}")
                added += 1
        for _ in range(rng.randint(0, 3)):
            if live:
                rid = live.pop(rng.randrange(len(live)))
                aborted += bool(engine.abort_request(rid))
        for d in engine.step():
            finished += d.finish_reason not in (None, "abort")
        live = [r for r in live if r in engine.requests]
    assert aborted > 50 and finished > 500
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks == 96
    assert all(b.ref_count == 0 for b in engine.blocks.blocks)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


def test_request_validation(make_checkpoint):
    """The front's checks (validate_request) and the engine's own: an id in use, a request the KV
    cache could never hold."""
    engine = make_engine(make_checkpoint("mixtral"), block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="vocabulary"):
        validate_request([1, 99999], SamplingParams(), engine.model_cfg)
    with pytest.raises(ValueError, match="empty"):
        validate_request([], SamplingParams(), engine.model_cfg)
    with pytest.raises(ValueError, match="logit_bias"):
        validate_request([5], SamplingParams(logit_bias={99999: 1.0}), engine.model_cfg)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("x", list(range(2, 30)), SamplingParams(max_tokens=10))
    engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=2))
    assert engine.blocks.num_free_blocks == 8


@pytest.mark.gpu
def test_engine_on_triton_kernels_equals_torch_kernels(make_checkpoint):
    """The engine with every Triton kernel (paged decode attention included; interpreted on the CPU)."""
    from tests.conftest import TRITON_DEVICE

    ckpt = make_checkpoint("qwen2_moe")
    reqs = [(i, p, SamplingParams(max_tokens=5, **GREEDY)) for i, p in enumerate(prompts(3, seed=8, lo=3, hi=20))]
    outs = []
    for kernels in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(str(ckpt), device=TRITON_DEVICE, kernels=kernels,
                                        cache=CacheConfig(block_size=4, num_blocks=64)))
        assert engine.runner.model.ops.backend == kernels
        outs.append(run_staggered(engine, reqs))
    assert outs[0] == outs[1]


def test_local_dispatcher_counts_each_steps_expert_tokens_once_it_ends():
    """Colocated, the experts' load is counted in the dispatcher: the layers' ids are kept and
    counted together when the step ends (not 5 small ops a layer); empty (-1) slots are skipped, the
    counts add up over steps, and reading them mid-step (the metrics endpoint's thread) changes
    nothing."""
    from models.dispatcher import LocalDispatcher

    disp = LocalDispatcher(num_experts=4)

    def experts(x, ids, w):
        return x

    disp.begin_step()
    disp.dispatch(0, experts, torch.zeros(3, 2), torch.tensor([[0, 1], [1, 2], [3, -1]]), torch.ones(3, 2))
    disp.dispatch(1, experts, torch.zeros(1, 2), torch.tensor([[1, 3]]), torch.ones(1, 2))
    disp.end_step()
    assert disp.expert_tokens_E.tolist() == [1, 3, 1, 2]
    disp.begin_step()
    disp.dispatch(0, experts, torch.zeros(1, 2), torch.tensor([[2, 2]]), torch.ones(1, 2))
    assert disp.expert_tokens_E.tolist() == [1, 3, 1, 2]  # mid-step: the finished steps' counts
    assert disp.expert_tokens_E.tolist() == [1, 3, 1, 2]
    disp.end_step()
    assert disp.expert_tokens_E.tolist() == [1, 3, 3, 2]
    assert LocalDispatcher().expert_tokens_E is None
