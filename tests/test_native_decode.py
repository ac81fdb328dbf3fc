"""The native decode step (models/native_decode.py, kernels/csrc/decode_step.c) against the eager
step it replays, and the native softmax routing both of them call."""
import random
from types import SimpleNamespace

import pytest
import torch

import kernels.native as native
from kernels.routing import topk_route
from models.kv_cache import make_paged_cache
from models.native_decode import why_not
from server import LLM, SamplingParams
from server.cli import build_parser

NEEDS_AVX512_BF16 = pytest.mark.skipif(not native.avx512_bf16(), reason="needs AVX-512 BF16 and the native kernels")


def torch_route(logits, top_k, renormalize, scaling):
    """kernels/routing.topk_route's torch ops (what the native call replaces)."""
    scores = torch.softmax(logits.float(), dim=-1)
    ids = torch.topk(scores, top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * scaling if scaling != 1.0 else w, ids


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("E,K,renormalize,scaling", [(8, 2, True, 1.0), (8, 1, False, 1.0), (60, 4, False, 1.0),
                                                      (64, 8, True, 2.5), (128, 8, False, 1.0), (5, 5, True, 1.0)])
def test_native_softmax_routing_equals_the_torch_ops(dtype, E, K, renormalize, scaling):
    """The same experts (where no two scores tie) and weights within a few float32 ulps (the exp and
    the order of the sums differ)."""
    torch.manual_seed(E * K)
    logits = (torch.randn(300, E) * 2).to(dtype)
    w, ids = topk_route(logits, K, "softmax", renormalize, scaling=scaling)
    w_ref, ids_ref = torch_route(logits, K, renormalize, scaling)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == ids.shape == (300, K)
    scores = torch.softmax(logits.float(), -1)
    kth, nxt = scores.sort(-1, descending=True).values[:, K - 1:K + 1].unbind(-1) if K < E else (None, None)
    untied = torch.ones(300, dtype=torch.bool) if K == E else kth != nxt
    assert torch.equal(ids.sort(-1).values[untied], ids_ref.sort(-1).values[untied])
    assert untied.float().mean() > 0.9
    # the weights in the order of their ids (ties among the chosen may come in another order)
    got = w.gather(1, ids.argsort(-1))[untied]
    ref = w_ref.gather(1, ids_ref.argsort(-1))[untied]
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-9)
    # ties go to the lowest id, as the Triton kernel's
    w_tie, ids_tie = topk_route(torch.zeros(2, E, dtype=dtype), K, "softmax", renormalize)
    assert ids_tie.tolist() == [list(range(K))] * 2


def _checkpoint(make_checkpoint, family):
    overrides = {"mixtral": dict(sliding_window=7), "qwen3_moe": dict(norm_topk_prob=True), "olmoe": {}}[family]
    return make_checkpoint(family, dtype="bfloat16", **overrides)


@NEEDS_AVX512_BF16
@pytest.mark.parametrize("layer_by_layer", [False, True], ids=["whole-step", "layer-by-layer"])
@pytest.mark.parametrize("family,quantization", [("mixtral", None), ("qwen3_moe", None), ("olmoe", None),
                                                 ("mixtral", "int8"), ("mixtral", "fp8"), ("mixtral", "int8 linears"),
                                                 ("mixtral", "int8 vnni"),
                                                 ("qwen3_moe", "fp8 linears"), ("olmoe", "mxfp4")])
def test_native_decode_step_gives_the_eager_steps_bits(family, quantization, layer_by_layer, make_checkpoint,
                                                        monkeypatch):
    """Every decode step of a generation (batches that shrink as requests end, contexts across page
    boundaries, Mixtral with a sliding window of 7, Qwen3-MoE's per-head and OLMoE's whole-projection
    q/k norm, int8, FP8 and MXFP4 experts, int8 experts of 2 rows or more on VNNI (the measured int8 x int8
    choice), and q/k/v and o int8 or FP8 too: quantize_linears) computes the same
    hidden states natively as the eager layers, and the experts' load counts are the same: the whole
    step in one call, and each layer's attention side in one call with the experts dispatched (as an
    attention worker runs it)."""
    from kernels import int8

    ckpt = _checkpoint(make_checkpoint, family)
    quantization, _, extra = (quantization or "").partition(" ")
    linears = extra == "linears"
    if extra == "vnni" and int8.VNNI not in int8.kernels():
        pytest.skip("no AVX-512 VNNI here")
    llm = LLM(ckpt, device="cpu", num_kv_blocks=32, block_size=4, quantization=quantization or None,
              quantize_linears=linears)
    try:
        model = llm.engine.runner.model
        nd = model.native_decode
        assert nd is not None, why_not(model, llm.engine.runner.cache)
        if extra == "vnni":  # (as if measured: experts with 2 rows or more take VNNI, eagerly and natively)
            monkeypatch.setattr(int8, "_moe_vnni", [2])
            nd.int8_kernels = (*nd.int8_kernels[:3], 2)
        assert nd.linears == ("bf16" if not linears else "int8" if quantization == "int8" else ("fp8", 128))
        if linears and quantization == "fp8":  # FP8 linears take the table measured on FP8, whatever int8's holds:
            fp8_big = int8._moe_big["fp8"]  # int8's made to differ (the FMA kernel, or BF16DOT from one row)
            monkeypatch.setitem(int8._moe_big, "int8", None if fp8_big and fp8_big[0] == int8.BF16DOT else (int8.BF16DOT, 1))
        nd.layer_by_layer = layer_by_layer
        calls = []
        for name in ("decode_step", "decode_attention"):
            monkeypatch.setattr(native, name, lambda *a, _f=getattr(native, name), _n=name: calls.append(_n) or _f(*a))
        forward, counts, steps = model.forward_micro_batches, [], []
        # every decode step twice: eagerly (the cache row it writes is rewritten with the same bits)
        # and natively; counted separately

        def both(inputs, cache, head=None):
            if len(inputs) != 1 or inputs[0] is None or inputs[0][1].max_q_len != 1:
                return forward(inputs, cache, head)
            dispatcher = model.dispatcher
            before = dispatcher.expert_tokens_E.clone()
            model.native_decode = None
            ref = forward(inputs, cache)[0].clone()
            dispatcher.end_step()
            eager = dispatcher.expert_tokens_E - before
            model.native_decode = nd
            got = forward(inputs, cache)[0]
            dispatcher.end_step()
            counts.append(torch.equal(dispatcher.expert_tokens_E - before - eager, eager))
            steps.append((ref.shape[0], torch.equal(ref, got)))
            return [got if head is None else head(0, got)]

        monkeypatch.setattr(model, "forward_micro_batches", both)
        rng = random.Random(0)
        prompts = [[rng.randrange(2, 500) for _ in range(n)] for n in (3, 9, 14, 5)]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 6, 9, 3)]
        llm.generate(prompts, params)
        assert len(steps) >= 8 and {b for b, _ in steps} >= {1, 2, 4}
        assert all(same for _, same in steps), steps
        assert all(counts)
        assert set(calls) == {"decode_attention" if layer_by_layer else "decode_step"}
    finally:
        llm.shutdown()


@NEEDS_AVX512_BF16
def test_native_decode_greedy_ids_and_the_flag(make_checkpoint):
    """Greedy ids with the native step equal those with --no-native-decode (which leaves the model
    without it), a batch runs eagerly where the measured choice picked torch for attention, a norm or
    the routing at its size, and the models it does not take keep the eager step with a reason."""
    ckpt = _checkpoint(make_checkpoint, "mixtral")
    prompts, params = [[5, 9, 14, 3], [7, 7, 2], [1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=8, temperature=0,
                                                                                      ignore_eos=True)
    out = {}
    for on in (True, False):
        llm = LLM(ckpt, device="cpu", num_kv_blocks=16, native_decode=on)
        try:
            assert (llm.engine.runner.model.native_decode is not None) == on
            if on:  # its tables point at the runner's cache: a step over another cache runs eagerly
                runner = llm.engine.runner
                other = make_paged_cache(runner.model_cfg, 4, 16, torch.bfloat16, "cpu", runner.model.ops)
                decode = [(None, SimpleNamespace(max_q_len=1, parts=None, block_table_BM=torch.zeros(1, 1)))]
                with torch.inference_mode():
                    nd, disp = runner.model.native_decode, runner.model.dispatcher
                    assert nd.mode(decode, disp, runner.cache) == "step" and nd.mode(decode, disp, other) is None
                    # where kernels/choice.py picked torch for an op of the step at this batch: eagerly
                    for op in native.NATIVE_OR_TORCH:
                        saved = list(native._NATIVE_ROWS[op])
                        native.set_runs_native(op, [False] + saved[1:])
                        try:
                            assert nd.mode(decode, disp, runner.cache) is None
                        finally:
                            native.set_runs_native(op, saved)
            out[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.shutdown()
    assert out[True] == out[False]
    assert build_parser().parse_args(["serve", "--no-native-decode"]).native_decode is False
    assert build_parser().parse_args(["serve"]).native_decode is True
    for family, dtype, reason in [("qwen2_moe", "bfloat16", "q/k/v"), ("mixtral", "float32", "bf16"),
                                  ("gpt_oss", "bfloat16", "layer 0")]:
        llm = LLM(make_checkpoint(family, dtype=dtype), dtype=dtype, device="cpu", num_kv_blocks=16)
        try:
            assert llm.engine.runner.model.native_decode is None
            assert reason in why_not(llm.engine.runner.model, llm.engine.runner.cache)
        finally:
            llm.shutdown()


@NEEDS_AVX512_BF16
def test_prompt_chunks_run_as_one_token_rows_in_the_native_step(make_checkpoint, monkeypatch):
    """A step's prompt chunks (chunked, from a prefix-cache hit, beside decode rows) run as one-token rows
    in the native decode step while they read at most prompt_rows_key_reads cached keys, and eagerly as
    chunks above it: every step of the generation is one native call, the greedy ids and the prompt
    logprobs are the eager chunks' (other attention kernels: bf16 rounding apart), and the choice
    follows the key reads, the native step's sizes and the model."""
    import attention_nodes.model_runner as mr
    from attention_nodes.scheduler import ScheduledBatch

    ckpt = _checkpoint(make_checkpoint, "mixtral")  # (a sliding window of 7: each row's own window)
    llm = LLM(ckpt, device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    calls = []
    monkeypatch.setattr(native, "decode_step", lambda *a, _f=native.decode_step: calls.append(1) or _f(*a))
    rng = random.Random(1)
    shared = [rng.randrange(2, 500) for _ in range(12)]
    prompts = [shared + [rng.randrange(2, 500) for _ in range(n)] for n in (3, 21, 9)] + [shared[:8]]
    # (prompt logprobs skip the prefix cache: the first and last prompts hit it instead)
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=None if i in (0, 3) else 0)
              for i in range(4)]
    try:
        runner = llm.engine.runner
        out = {}
        for limit in (mr.PROMPT_ROWS_KEY_READS, 0):
            runner.prompt_rows_key_reads = limit
            llm.generate([shared], SamplingParams(max_tokens=1))  # (the shared blocks cached: later prompts hit)
            calls.clear()
            steps = llm.engine.num_steps
            got = llm.generate(prompts, params)
            out[limit] = ([o.outputs[0].token_ids for o in got],
                          [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in got[1:3]])
            if limit:
                assert len(calls) == llm.engine.num_steps - steps  # every step one native call, prompts too
                assert got[0].num_cached_tokens > 0 and got[3].num_cached_tokens > 0
            else:
                assert len(calls) < llm.engine.num_steps - steps  # the prompt steps ran eagerly
        (ids, lps), (ids0, lps0) = out[mr.PROMPT_ROWS_KEY_READS], out[0]
        assert ids == ids0
        for a, b in zip(lps, lps0):
            assert max(abs(x - y) for x, y in zip(a, b)) < 0.25  # (bf16 logits: 0.06 apart at 8 to 16)
        # the choice: by the chunks' key reads (a chunk of n after c reads n c + n (n + 1) / 2), not the
        # verifications', where the native step runs every micro-batch's rows, on models that have it
        seqs = [SimpleNamespace(num_computed_tokens=c, num_draft_tokens=d) for c, d in ((10, 0), (5, 0), (7, 3))]
        batch = ScheduledBatch(seqs, [4, 1, 4], [True] * 3)
        runner.prompt_rows_key_reads = 4 * 10 + 10
        assert runner.prompts_as_rows(batch)
        runner.prompt_rows_key_reads = 4 * 10 + 9
        assert not runner.prompts_as_rows(batch)
        runner.prompt_rows_key_reads = 1 << 20
        assert not runner.prompts_as_rows(ScheduledBatch(seqs[1:], [1, 4], [True] * 2))  # no prompt
        saved = list(native._NATIVE_ROWS["attention"])
        native.set_runs_native("attention", [True] * 4 + [False] * (len(saved) - 4))  # (9 rows: bucket 5-8 up)
        try:
            assert not runner.prompts_as_rows(batch, [range(3)])
            assert runner.prompts_as_rows(batch, [range(1), range(1, 3)])  # 4 and 5 rows
        finally:
            native.set_runs_native("attention", saved)
        monkeypatch.setattr(runner.model, "native_decode", None)
        assert not runner.prompts_as_rows(batch)
    finally:
        llm.shutdown()
