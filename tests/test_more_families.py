"""GLM-4.5, MiniMax-M2, gpt-oss (with MXFP4 experts), Llama 4 and MiMo-V2-Flash against transformers:
logits, greedy tokens through LLM, the engine (preemption, chunked prefill, prefix hits) and pools,
training, and the chat templates of the first three (tests/test_llama4_mimo.py: the last two's own checks)."""
import pytest
import torch

from models.config import ModelConfig
from models.kv_cache import AttentionBatch, make_paged_cache
from models.loader import load_model
from tests.conftest import PROMPTS, assert_close_to_transformers, hf_model, our_logits, transformers_greedy

VARIANTS = [
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
                  "num_attention_heads": 3, "num_key_value_heads": 1, "partial_rotary_factor": 1.0}),
    ("minimax_m2", {}),
    ("gpt_oss", {}),
    # no shared experts (transformers saves zero-width ones), MoE from layer 0, 4 of 20 dims roped,
    # and scoring_func / topk_method, which transformers' GLM ignores
    ("glm4_moe", {"n_shared_experts": 0, "first_k_dense_replace": 0, "partial_rotary_factor": 0.2,
                  "scoring_func": "softmax", "topk_method": "greedy"}),
    # every layer sliding with a window of 2, yarn with truncation and its betas, 7 experts top-1
    ("gpt_oss", {"layer_types": ["sliding_attention"] * 3, "sliding_window": 2, "num_local_experts": 7,
                 "num_experts_per_tok": 1, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0,
                                                               "beta_slow": 2.0, "truncate": True, "rope_theta": 1000.0,
                                                               "original_max_position_embeddings": 64}}),
    ("llama4", {}),
    # chunks of 5 (not whole pages: the gathered path), no q/k norm, no temperature, explicit
    # moe_layers and no_rope_layers, 3 heads over 1 kv head, tied embeddings, default rope
    ("llama4", {"attention_chunk_size": 5, "use_qk_norm": False, "attn_temperature_tuning": False,
                "moe_layers": [0, 3], "no_rope_layers": [0, 1, 1, 0], "num_attention_heads": 3,
                "num_key_value_heads": 1, "tie_word_embeddings": True, "rope_parameters": None}),
    ("mimo_v2_flash", {}),
    # every layer MoE, the default layer pattern (layer 0 full, then sliding), one group, scaled routing,
    # no value scale, q/k/v biases, sliding_window_size (the window without the query)
    ("mimo_v2_flash", {"mlp_layer_types": ["sparse"] * 4, "layer_types": None, "n_group": 1, "topk_group": 1,
                       "routed_scaling_factor": 2.5, "norm_topk_prob": False, "attention_value_scale": None,
                       "attention_bias": True, "sliding_window_size": 3}),
]
IDS = ["glm", "glm-plain-gqa3", "minimax", "gpt-oss", "glm-no-shared", "gpt-oss-all-sliding-yarn", "llama4",
       "llama4-chunk5-plain", "mimo", "mimo-plain"]


@pytest.mark.parametrize("family,overrides", VARIANTS, ids=IDS)
def test_logits_equal_transformers(make_checkpoint, family, overrides):
    d = make_checkpoint(family, **overrides)
    model = load_model(d, kernels="torch")
    assert_close_to_transformers(our_logits(model, PROMPTS), hf_model(d), PROMPTS)


# --- Triton (interpreted on the CPU) equals the torch references for the new options ---

@pytest.mark.gpu
@pytest.mark.parametrize("window,num_splits", [(None, 1), (5, 1), (None, 3), (7, 2)])
def test_triton_decode_attention_with_sinks(poison, window, num_splits):
    from kernels.attention import paged_decode_attention as reference
    from kernels.attention_triton import paged_decode_attention
    from tests.test_triton_attention import paged_inputs

    torch.manual_seed(window or 0)
    inputs = paged_inputs([1, 4, 5, 23, 9], N=6, K=2, H=20, S=4)
    sinks = torch.randn(6, device=inputs["q_BNH"].device) * 2
    args = {k: v for k, v in inputs.items() if not k.endswith("_clean")}
    got = paged_decode_attention(**args, sliding_window=window, sinks_N=sinks, num_splits=num_splits)
    ref_args = {**args, "k_cache_PSKH": inputs["k_clean"], "v_cache_PSKH": inputs["v_clean"]}
    want = reference(**ref_args, sliding_window=window, sinks_N=sinks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    without = reference(**ref_args, sliding_window=window)
    assert (want - without).abs().max() > 1e-2  # the sinks matter at this scale


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gpt-oss"])
def test_triton_moe_with_biases_and_clamped_swiglu(poison, act):
    from kernels.moe import SILU, SwiGLU, fused_moe as reference
    from kernels.moe_triton import MoEConfig, fused_moe
    from tests.conftest import TRITON_DEVICE as dev

    torch.manual_seed(1)
    T, D, I, E, K = 13, 40, 24, 5, 3
    x = torch.randn(T, D, device=dev)
    w13, w2 = torch.randn(E, 2 * I, D, device=dev) / D ** 0.5, torch.randn(E, D, I, device=dev) / I ** 0.5
    b13, b2 = torch.randn(E, 2 * I, device=dev) * 0.3, torch.randn(E, D, device=dev) * 0.3
    weights, ids = torch.randn(T, E, device=dev).softmax(-1).topk(K, dim=-1)
    f = SILU if act == "silu" else SwiGLU(1.702, 0.7, 1.0)  # a limit that clamps about a third of the values
    kw = dict(b13_EI2=b13, b2_ED=b2, act=f)
    want = reference(x, w13, w2, weights, ids, **kw)
    got = fused_moe(x, w13, w2, weights, ids, **kw, config=MoEConfig(16, 32, 32, GROUP_M=1))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert (want - reference(x, w13, w2, weights, ids)).abs().max() > 1e-2


@pytest.mark.gpu
@torch.inference_mode()
def test_gpt_oss_model_on_triton_ops_matches_torch_ops(make_checkpoint):
    """Prefill then a decode step over the paged cache on both op tables: sinks and windows in
    the decode kernel, the biased router, expert biases and the clamped SwiGLU in the MoE kernel."""
    from tests.conftest import TRITON_DEVICE as dev

    ckpt = make_checkpoint("gpt_oss")
    outs = []
    for backend in ("torch", "triton"):
        model = load_model(ckpt, device=dev, kernels=backend)
        cache = make_paged_cache(model.cfg, 32, 4, torch.float32, dev, model.ops)
        tables = [list(range(8 * b, 8 * b + 8)) for b in range(len(PROMPTS))]
        prompts = PROMPTS[:3]  # 14 tokens pass the window of 5
        lens = [len(p) for p in prompts]
        batch = AttentionBatch.build_paged(lens, [0] * len(prompts), tables[:3], 4, dev)
        got = [model.logits(model(torch.tensor([t for p in prompts for t in p], device=dev), batch, cache))]
        batch = AttentionBatch.build_paged([1] * len(prompts), lens, tables[:3], 4, dev)
        got.append(model.logits(model(torch.tensor([3, 5, 7], device=dev), batch, cache)))
        outs.append(got)
    for want, got in zip(*outs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# --- greedy tokens through LLM, the engine (preemption, prefix hits) and pools ---

_SHARED = [311, 42, 97, 5, 260, 188, 73, 402, 19, 144, 230, 61]  # 3 full blocks of 4 the prompts share
GREEDY_PROMPTS = [_SHARED + [7, 300, 12], _SHARED + [99], _SHARED + [450, 3, 8, 21, 77, 6, 140], [400, 3]]
_EXPECTED: dict = {}


def params(family: str) -> dict:
    """32 greedy tokens; 16 for Llama 4 and MiMo-V2-Flash (their 8-token chunks and 5-token windows
    are passed as well, and transformers' generate is slow for them)."""
    return dict(max_tokens=16 if family in ("llama4", "mimo_v2_flash") else 32, temperature=0, ignore_eos=True)


def expected_greedy(make_checkpoint, family: str) -> tuple:
    """(checkpoint, transformers' greedy tokens (params) for each of GREEDY_PROMPTS), computed once."""
    if family not in _EXPECTED:
        d = make_checkpoint(family)
        _EXPECTED[family] = d, transformers_greedy(d, GREEDY_PROMPTS, params(family)["max_tokens"])
    return _EXPECTED[family]


NEW_FAMILIES = ["glm4_moe", "minimax_m2", "gpt_oss", "llama4", "mimo_v2_flash"]
GREEDY = pytest.mark.parametrize("family", NEW_FAMILIES)


@GREEDY
def test_greedy_through_llm_with_preemption_chunked_prefill_and_prefix_hits(make_checkpoint, family):
    """LLM over an engine with 24 (18) KV blocks of 4 for 4 sequences of up to 51 (35) tokens (preemptions),
    16 tokens per step (Llama 4 and MiMo-V2-Flash: 5, so prefill chunks of 1 to 4 tokens run beside
    decodes) and 12 shared prompt tokens (prefix hits)."""
    from server import LLM, SamplingParams

    d, want = expected_greedy(make_checkpoint, family)
    short = family in ("llama4", "mimo_v2_flash")
    blocks = 18 if short else 24
    llm = LLM(d, num_kv_blocks=blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=5 if short else 16)
    assert [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, SamplingParams(**params(family)))] == want
    eng = llm.engine
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.prefix_hits > 0 and eng.blocks.num_free_blocks == blocks


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_pools_equal_transformers(make_checkpoint, family):
    """Each family on 2 attention workers (gpt-oss: attention with sinks and windows, the biased
    router; GLM: grouped sigmoid routing, dense first layers, shared experts; MiniMax-M2: whole-
    projection q/k norm, the correction bias; Llama 4 on 1: expert inputs scaled before dispatch;
    MiMo-V2-Flash on 1: kv heads per layer, narrower values),
    2 expert workers (gpt-oss: the experts with their biases and the clamped SwiGLU), 2 micro-batches:
    greedy ids equal transformers' generate."""
    from server import LLM, SamplingParams

    d, want = expected_greedy(make_checkpoint, family)
    llm = LLM(d, num_kv_blocks=96, colocated=False, attention_workers=1 if family in ("llama4", "mimo_v2_flash") else 2,
              expert_workers=2, micro_batches=2, torch_threads=1)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, SamplingParams(**params(family)))]
    finally:
        llm.shutdown()
    assert got == want


@pytest.mark.parametrize("family", ["llama4", "mimo_v2_flash", "deepseek_v32", "glm_moe_dsa"])
def test_served_stream_equals_transformers(make_checkpoint, family):
    """The server's app (in process; tests/test_qwen3_next.py runs `shuttle serve` itself) streams,
    through the official client, transformers' greedy text: Llama 4's chunked and global layers,
    MiMo-V2-Flash's windows and narrow values, DeepSeek-V3.2's and GLM-5's sparse attention (the
    15-token prompt is past their top-5)."""
    import asyncio

    import httpx
    import openai
    from transformers import AutoTokenizer

    from server.api_server import ServerConfig, build_app
    from server.async_llm import AsyncLLM
    from server.metrics import ServerMetrics

    if family in _EXPECTED:  # (computed for this module's other tests)
        d, want = _EXPECTED[family][0], _EXPECTED[family][1][0][:16]
    else:  # transformers' 16 greedy tokens of the one prompt streamed
        d = make_checkpoint(family)
        want = transformers_greedy(d, GREEDY_PROMPTS[:1], 16)[0]
    metrics = ServerMetrics(family)
    llm = AsyncLLM(d, observer=metrics)

    async def stream() -> str:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(llm, ServerConfig(), metrics)))
        client = openai.AsyncOpenAI(base_url="http://shuttle/v1", api_key="none", http_client=http)
        chunks = await client.completions.create(model="shuttle", prompt=GREEDY_PROMPTS[0], max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    try:
        text = asyncio.run(stream())
    finally:
        llm.shutdown()
    assert text == AutoTokenizer.from_pretrained(d).decode(want)


# --- MXFP4 checkpoints ---

def _write_mxfp4(src, dst) -> dict:
    """Copy a gpt-oss checkpoint with every expert matrix stored as MXFP4 (`_blocks` + `_scales`,
    out-major as published) and quantization_config mxfp4. Returns the dequantised (E, D, O)-layout
    float32 tensors by their plain names."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from kernels.quant import dequantize_mxfp4, quantize_mxfp4

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors, plain = load_file(f), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # (E, O, D/32, 16), (E, O, D/32)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        plain[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(raw))
    return plain


def test_mxfp4_checkpoint_loads_as_its_dequantised_weights(make_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from models.loader import load_experts

    src = make_checkpoint("gpt_oss")  # (its sizes are multiples of MXFP4's 32-value blocks)
    plain = _write_mxfp4(src, tmp_path / "mxfp4")
    q = load_file(tmp_path / "mxfp4" / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    theirs = convert_moe_packed_tensors(q[name + "_blocks"], q[name + "_scales"], dtype=torch.float32)
    assert torch.equal(theirs, plain[name])  # our dequantisation is transformers'
    assert ModelConfig.from_pretrained(tmp_path / "mxfp4").mxfp4
    mx = load_model(tmp_path / "mxfp4")
    deq = tmp_path / "dequantised"
    shutil.copytree(src, deq)
    save_file({**load_file(deq / "model.safetensors"), **plain}, deq / "model.safetensors", metadata={"format": "pt"})
    ref = load_model(deq)
    for (n, a), (_, b) in zip(mx.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n
    assert (dict(load_model(src).named_parameters())["model.layers.1.mlp.experts.w13"]
            - dict(mx.named_parameters())["model.layers.1.mlp.experts.w13"]).abs().max() > 0  # it was quantised
    assert_close_to_transformers(our_logits(mx, PROMPTS), hf_model(deq), PROMPTS)
    mine = load_experts(tmp_path / "mxfp4", [3, 1])  # an expert worker's share
    assert torch.equal(mine[2].w2[0], ref.model.layers[2].mlp.experts.w2[3])


def test_mxfp4_errors_name_the_file_and_tensor(make_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    from models.checkpoint import CheckpointError

    _write_mxfp4(make_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    f = tmp_path / "mxfp4" / "model.safetensors"
    tensors = load_file(f)
    scales = tensors.pop("model.layers.0.mlp.experts.down_proj_scales")
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: MXFP4 tensor 'model\.layers\.0\.mlp\.experts"
                                              r"\.down_proj_blocks' has no 'model\.layers\.0\.mlp\.experts\.down_proj_scales'"):
        load_model(tmp_path / "mxfp4")
    tensors["model.layers.0.mlp.experts.down_proj_scales"] = scales
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name] = tensors[name][:, :, :1].contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.experts"
                                              r"\.gate_up_proj_scales' has shape \[5, 64, 1\] torch\.uint8, "
                                              r"expected uint8 \[5, 64, 2\]"):
        load_model(tmp_path / "mxfp4")


# --- training: the loss equals transformers', the trained checkpoint serves ---

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import json

    from models.builtin import corpus as texts

    path = tmp_path_factory.mktemp("data") / "topics.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts()[:8]))
    return path


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_train_loss_equals_transformers_and_the_result_serves(make_checkpoint, corpus, tmp_path, family):
    import json

    from transformers import AutoTokenizer

    from training.losses import IGNORE, lm_loss
    from training.model import Shard, build_model, forward_logits
    from training.parallel import ParallelContext
    from training.trainer import Trainer
    from training.config import TrainConfig

    ckpt = make_checkpoint(family)
    cfg = ModelConfig.from_pretrained(ckpt)
    ours = build_model(cfg, Shard(tuple(range(cfg.num_experts))), torch.device("cpu"), init_from=ckpt)
    ids = torch.randint(2, cfg.vocab_size, (3, 19), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([ids[:, 1:], torch.full((3, 1), IGNORE)], dim=1)
    with torch.no_grad():
        lm = lm_loss(forward_logits(ours, ids), labels.reshape(-1))
        theirs = hf_model(ckpt).train()(ids, labels=ids).loss
    assert abs(lm.item() - theirs.item()) < 1e-5 * theirs.item()
    text = AutoTokenizer.from_pretrained(ckpt)(json.loads(corpus.read_text().splitlines()[0])["text"])["input_ids"]
    seen = torch.tensor(text[:48]).view(3, 16)  # rows of the training corpus

    def corpus_loss(model) -> float:
        with torch.no_grad():
            return lm_loss(forward_logits(model, seen[:, :-1]), seen[:, 1:].reshape(-1)).item()

    run = tmp_path / "run"  # what `shuttle train --init-from CKPT --data corpus.jsonl ...` runs
    trainer = Trainer(TrainConfig(out=run, data=(str(corpus),), init_from=str(ckpt), seq_len=16, micro_batch_size=2,
                                  max_steps=2, lr=3e-3, warmup_steps=1, log_every=1, progress=False,
                                  peak_tflops=1.0),  # (no matmul benchmark at start)
                      ParallelContext())
    trainer.run()
    assert corpus_loss(trainer.model) < corpus_loss(ours)  # it trained
    with torch.no_grad():
        want = forward_logits(trainer.model, ids)
        served = load_model(run)
        got = our_logits(served, ids.tolist())
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
        ref = hf_model(run)  # transformers reads the saved files as its own
        assert (ref(ids).logits.reshape(got.shape) - want).abs().max() < 1e-4 * want.abs().max()


# --- each family's chat template through /v1/chat/completions ---

# Templates in each family's style (the published ones' markers and variables, on the tiny tokenizer),
# tools and tool turns included: GLM and MiniMax-M2 iterate the call's arguments as an object
TEMPLATES = {
    "glm4_moe": "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
                "{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|observation|>\n"
                "<tool_response>{{ m.content }}</tool_response>{% else %}<|{{ m.role }}|>\n{{ m.content }}"
                "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}\n"
                "{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n<arg_value>"
                "{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
                "{% if not (enable_thinking | default(true)) %}<think></think>{% endif %}{% endif %}",
    "minimax_m2": "]~!b[{% if tools %}]~b]system\n<tools>{% for tool in tools %}"
                  "<tool>{{ tool.function | tojson }}</tool>{% endfor %}</tools>[e~[\n{% endif %}"
                  "{% for m in messages %}]~b]{{ 'ai' if m.role == 'assistant' else m.role }}\n{{ m.content }}"
                  "{% for tc in m.tool_calls or [] %}<minimax:tool_call><invoke name=\"{{ tc.function.name }}\">"
                  "{% for k, v in tc.function.arguments.items() %}<parameter name=\"{{ k }}\">{{ v }}</parameter>"
                  "{% endfor %}</invoke></minimax:tool_call>{% endfor %}[e~[\n{% endfor %}"
                  "{% if add_generation_prompt %}]~b]ai\n<think>\n{% endif %}",
    "gpt_oss": "<|start|>system<|message|>Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}"
               "\n\nReasoning: {{ reasoning_effort | default('medium') }}<|end|>{% if tools %}<|start|>developer"
               "<|message|># Tools\nnamespace functions {\n{% for tool in tools %}type {{ tool.function.name }} = "
               "(_: {{ tool.function.parameters | tojson }}) => any;\n{% endfor %}} // namespace functions<|end|>"
               "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|start|>functions to=assistant"
               "<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>{% elif m.tool_calls %}"
               "{% for tc in m.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>"
               "commentary json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}{% else %}"
               "<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|start|>assistant{% endif %}",
}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a term up.", "parameters": {
    "type": "object", "properties": {"term": {"type": "string"}, "limit": {"type": "integer"}}}}}]
KWARGS = {"glm4_moe": {"enable_thinking": False}, "minimax_m2": {}, "gpt_oss": {"reasoning_effort": "high"}}


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "gpt_oss"])
def test_chat_template_through_chat_completions(make_checkpoint, tmp_path, family):
    """The official openai client against the server's app (in process): the prompt is the
    checkpoint's template rendered with the request's chat_template_kwargs, the reply is the greedy
    continuation of exactly those tokens."""
    import asyncio
    import shutil

    import httpx
    import openai
    from transformers import AutoTokenizer

    from server import SamplingParams
    from server.api_server import ServerConfig, build_app
    from server.async_llm import AsyncLLM
    from server.metrics import ServerMetrics

    d = tmp_path / family
    shutil.copytree(make_checkpoint(family), d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATES[family]
    tok.save_pretrained(d)
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup",
                                                               "arguments": '{"term": "list", "limit": 2}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "an ordered sequence"}]
    # what the template sees: the call's arguments as an object, absent content as ""
    as_template = messages[:2] + [{"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "lookup", "arguments": {"term": "list", "limit": 2}}}]}, {**messages[3]}]
    text = AutoTokenizer.from_pretrained(d).apply_chat_template(as_template, tools=TOOLS, tokenize=False,
                                                                add_generation_prompt=True, **KWARGS[family])
    assert text.endswith({"glm4_moe": "<think></think>", "minimax_m2": "<think>\n",
                          "gpt_oss": "<|start|>assistant"}[family]) and ("high" in text) == (family == "gpt_oss")
    assert "lookup" in text and "ordered sequence" in text and ("Look a term up." in text) == (family != "gpt_oss")
    metrics = ServerMetrics(family)
    llm = AsyncLLM(d, observer=metrics)
    try:
        ids = tok.encode(text, add_special_tokens=False)

        async def ask():
            async for out in llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)):
                want = out
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(llm, ServerConfig(), metrics)))
            client = openai.AsyncOpenAI(base_url="http://shuttle/v1", api_key="none", http_client=http)
            r = await client.chat.completions.create(
                model="shuttle", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True, "chat_template_kwargs": KWARGS[family]})
            return want, r

        want, r = asyncio.run(ask())
    finally:
        llm.shutdown()
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    assert r.choices[0].message.content == want.outputs[0].text and want.outputs[0].text


# --- config.json as the published checkpoints write it (transformers 4 spelling) ---

def test_published_config_json_of_each_family():
    import math

    from models.config import ConfigError

    glm = {"architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
           "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5,
           "intermediate_size": 12288, "max_position_embeddings": 131072, "model_type": "glm4_moe",
           "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1,
           "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
           "num_experts_per_tok": 8, "first_k_dense_replace": 3, "num_hidden_layers": 92, "num_key_value_heads": 8,
           "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
           "torch_dtype": "bfloat16", "use_qk_norm": True, "vocab_size": 151552}
    c = ModelConfig.from_dict(glm)
    assert (c.family, c.rope_dim, c.qk_norm, c.qkv_bias, c.o_bias, c.num_mtp_layers) == ("glm4_moe", 64, "per_head",
                                                                                        True, False, 1)
    assert c.moe_layers[:4] == (False,) * 3 + (True,) and c.shared_expert_intermediate_size == 1536
    assert (c.router.scoring, c.router.correction_bias, c.router.scaling, c.router.renormalize) == ("sigmoid", True,
                                                                                                    2.5, True)
    assert ModelConfig.from_dict({**glm, "partial_rotary_factor": None}).rope_dim == 64  # transformers' default
    minimax = {"architectures": ["MiniMaxM2ForCausalLM"], "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
               "intermediate_size": 1536, "max_position_embeddings": 196608, "model_type": "minimax_m2",
               "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
               "num_local_experts": 256, "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64,
               "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
               "torch_dtype": "bfloat16", "vocab_size": 200064,
               "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                       "weight_block_size": [128, 128]}}
    c = ModelConfig.from_dict(minimax)
    assert (c.family, c.rope_dim, c.qk_norm, c.fp8_block, c.moe_intermediate_size) == ("minimax_m2", 64, "full",
                                                                                      (128, 128), 1536)
    assert (c.router.scoring, c.router.correction_bias, c.router.renormalize, c.router.num_groups) == ("sigmoid", True,
                                                                                                      True, 1)
    # checkpoints without e_score_correction_bias (transformers reads the missing bias as zeros)
    assert not ModelConfig.from_dict({**minimax, "use_routing_bias": False}).router.correction_bias
    oss = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}
    c = ModelConfig.from_dict(oss)
    assert c.mxfp4 and c.fp8_block is None and c.attention_sinks and c.expert_bias and c.o_bias
    assert c.sliding_windows[:3] == (128, None, 128) and c.rope.rope_type == "yarn" and not c.rope.truncate
    assert (c.expert_act.alpha, c.expert_act.limit, c.expert_act.up_offset) == (1.702, 7.0, 1.0)
    assert c.router.bias and c.router.scoring == "softmax" and c.max_model_len == 131072
    assert math.isclose(c.rope.factor, 32.0)
    for raw, match in [({**oss, "layer_types": ["sliding_attention"] * 3}, "layer_types must list"),
                       ({**glm, "partial_rotary_factor": 0.4}, "partial_rotary_factor 0.4 gives 51"),
                       ({**minimax, "architectures": ["MixtralForCausalLM"], "partial_rotary_factor": 0.5},
                        "partial_rotary_factor != 1 is not supported by mixtral"),
                       ({**glm, "quantization_config": {"quant_method": "mxfp4"}}, "mxfp4' is supported for gpt-oss"),
                       ({**glm, "n_group": 160, "topk_group": 8}, r"n_group \(160\) leaves 1 expert per group"),
                       ({**oss, "sliding_window": None}, "sliding_window must be a positive int"),
                       ({**oss, "intermediate_size": 2890}, r"MXFP4 experts need .* intermediate_size \(2890\)")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_dict(raw)


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2", "gpt_oss"])
def test_fields_left_out_of_config_json_default_as_in_transformers(family):
    """A config.json with only the shapes transformers has no default for: every field we read
    defaults as transformers 5's config class fills it (head_dim, kv heads, experts, eps, rope,
    windows), and a transformers-4 file with rope_scaling null keeps gpt-oss's yarn."""
    import transformers

    from models.config import ARCHITECTURES

    arch = next(a for a, f in ARCHITECTURES.items() if f == family)
    minimal = {"architectures": [arch], "model_type": family, "hidden_size": 64, "num_hidden_layers": 3,
               "num_attention_heads": 16, "vocab_size": 512}
    for raw in (minimal, {**minimal, "rope_theta": 1000.0, "rope_scaling": None}):
        theirs = getattr(transformers, hf_config_class(family)).from_dict(dict(raw))
        ours = ModelConfig.from_dict(raw)
        rope = theirs.rope_parameters
        assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 16)
        assert (ours.num_kv_heads, ours.num_experts, ours.top_k, ours.rms_norm_eps, ours.max_position_embeddings) == (
            theirs.num_key_value_heads, theirs.num_local_experts, theirs.num_experts_per_tok, theirs.rms_norm_eps,
            theirs.max_position_embeddings)
        assert (ours.rope.rope_type, ours.rope.theta, ours.rope.factor, ours.rope.beta_fast, ours.rope.truncate,
                ours.rope.original_max_position_embeddings) == (
            rope["rope_type"], rope["rope_theta"], rope.get("factor"), rope.get("beta_fast"),
            rope.get("truncate", True), rope.get("original_max_position_embeddings"))
        assert ours.rope_dim == int(ours.head_dim * rope.get("partial_rotary_factor", 1.0))
        windows = [theirs.sliding_window if t == "sliding_attention" else None
                   for t in getattr(theirs, "layer_types", None) or ["full_attention"] * 3]
        assert list(ours.sliding_windows) == windows


def hf_config_class(family: str) -> str:
    from tests.conftest import FAMILIES

    return FAMILIES[family][0]


def test_regrouped_experts_keep_biases_and_activation(make_checkpoint):
    """EPLB's regroup (expert_nodes/placement.py) of gpt-oss experts, packed for the CPU or stacked,
    equals loading those experts directly."""
    from expert_nodes.placement import regroup
    from models.cpu_inference import PackedExperts
    from models.loader import load_experts

    d = make_checkpoint("gpt_oss")
    every, want = load_experts(d, list(range(5))), load_experts(d, [3, 1])
    x = torch.randn(6, 64)
    ids, weights = torch.tensor([[0, 1]] * 6), torch.full((6, 2), 0.5)
    with torch.no_grad():
        expected = want[1](x, ids, weights)
        for m in (every[1], PackedExperts(every[1])):
            torch.testing.assert_close(regroup([(m, 3), (m, 1)])(x, ids, weights), expected)
