"""MTP speculative decoding (models/mtp.py, --speculative-config '{"method": "mtp", ...}') on a tiny
DeepSeek-V3 checkpoint whose MTP layer (model.layers.{L}.*, which transformers does not build) is
added with random values: the layer's logits equal a float64 reference of the published formula;
greedy ids with k = 1 and k = 3 equal the engine's without speculation (also chunked and
preempting); drafts are accepted (counters); the MTP layer's cached keys of every kept position
equal a fresh pass over the final sequence, whatever drafts were rejected on the way; a checkpoint
without MTP layers is refused by name."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attention_nodes.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from attention_nodes.engine import LLMEngine
from kernels import native
from models.config import ModelConfig
from models.kv_cache import AttentionBatch, make_paged_cache
from models.loader import load_model
from models.mtp import load_mtp
from server import LLM, SamplingParams
from server.llm import engine_config
from tests.conftest import PROMPTS, hf_config
from tests.test_speculative import EVERY_BATCH

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
MTP_PROMPTS = [*PROMPTS, [9, 8, 7, 6, 9, 8, 7, 6, 9, 8, 7], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309,
                                                              310, 311, 312, 313, 314, 315, 316, 317, 318]]


def add_mtp_layer(src, dst, seed: int = 0, passthrough: bool = False):
    """A copy of checkpoint src with an MTP layer model.layers.{L}.*: random values (norms near 1), or
    (passthrough) one that copies the target: eh_proj takes hnorm(h) alone, attention and MLP add
    nothing, the shared head is the target's LM head; its drafts are then the target's argmax at
    the previous position (accepted where the greedy output repeats a token)."""
    shutil.copytree(src, dst)
    cfg = ModelConfig.from_pretrained(dst)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(f)
    L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    new = {}
    for name in [n for n in tensors if n.startswith(f"model.layers.{L - 1}.")]:
        t, mine = tensors[name], name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")
        if name.endswith("norm.weight"):
            new[mine] = torch.ones_like(t) if passthrough else 1 + rand(*t.shape, scale=0.2)
        elif name.endswith("e_score_correction_bias"):
            new[mine] = torch.rand(*t.shape, generator=g) * 0.2
        elif passthrough and (name.endswith("o_proj.weight") or "down_proj" in name):
            new[mine] = torch.zeros_like(t)
        else:
            new[mine] = rand(*t.shape)
    p = f"model.layers.{L}."
    if passthrough:
        new.update({p + "enorm.weight": torch.ones(D), p + "hnorm.weight": torch.ones(D),
                    p + "shared_head.norm.weight": torch.ones(D),
                    p + "eh_proj.weight": torch.cat((torch.zeros(D, D), torch.eye(D)), dim=1)})
    else:
        new.update({p + "enorm.weight": 1 + rand(D, scale=0.2), p + "hnorm.weight": 1 + rand(D, scale=0.2),
                    p + "shared_head.norm.weight": 1 + rand(D, scale=0.2), p + "eh_proj.weight": rand(D, 2 * D),
                    p + "shared_head.head.weight": rand(V, D), p + "embed_tokens.weight": rand(V, D, scale=1.0)})
    tensors.update(new)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def base(make_checkpoint):
    return make_checkpoint("deepseek_v3")


@pytest.fixture(scope="module")
def mtp_ckpt(base, tmp_path_factory):
    return add_mtp_layer(base, tmp_path_factory.mktemp("mtp") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def repeating(base, tmp_path_factory):
    """base with the embedding added to its LM head: its greedy outputs repeat tokens in runs (3 to 13
    long in MTP_PROMPTS' outputs) between other tokens, so a copying MTP layer's drafts are accepted
    whole, in part and not at all."""
    d = tmp_path_factory.mktemp("repeating") / "ckpt"
    shutil.copytree(base, d)
    f = next(d.glob("*.safetensors"))
    t = load_file(f)
    t["lm_head.weight"] = t["lm_head.weight"] + t["model.embed_tokens.weight"]
    save_file(t, f, metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def copy_ckpt(repeating, tmp_path_factory):
    return add_mtp_layer(repeating, tmp_path_factory.mktemp("mtp_copy") / "ckpt", passthrough=True)


SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=2, ignore_eos=True)


def _ids(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(MTP_PROMPTS, params)]


@pytest.fixture(scope="module")
def plain_ids(base, repeating):
    out = {}
    for which, d in (("random", base), ("copy", repeating)):
        llm = LLM(d)
        try:
            out[which] = _ids(llm, GREEDY), _ids(llm, SEEDED)
        finally:
            llm.shutdown()
    return out


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_logits_equal_a_float64_reference_of_the_formula(mtp_ckpt):
    """logits(x_{t+2}) = head(norm(layer(eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))))) with the
    decoder layer at positions t (transformers' DeepseekV3DecoderLayer in float64 on the MTP weights,
    causal over the sequence), against ours through the paged cache's extra layer."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    cfg = ModelConfig.from_pretrained(mtp_ckpt)
    L, eps = cfg.num_layers, cfg.rms_norm_eps
    target = load_model(mtp_ckpt)
    drafter = load_mtp(mtp_ckpt, cfg, target)
    ids = PROMPTS[0]
    T = len(ids) - 1
    cache = make_paged_cache(drafter.cfg, 8, 4, torch.float32, "cpu", target.ops)
    batch = AttentionBatch.build_paged([T], [0], [list(range(8))], 4)
    with torch.no_grad():
        h_TD = target(torch.tensor(ids[:T]), batch, cache)  # the target's hidden states, after its final norm
        got = drafter.logits(drafter.forward(torch.tensor(ids[1:]), h_TD, batch, cache))
    prefix = f"model.layers.{L}."
    W = {n[len(prefix):]: t.double() for n, t in load_file(next(mtp_ckpt.glob("*.safetensors"))).items()
         if n.startswith(prefix)}
    hf = hf_config("deepseek_v3")
    hf._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(hf, layer_idx=L).double().eval()
    state = {n: t for n, t in W.items() if n.startswith(("self_attn.", "input_layernorm", "post_attention_layernorm",
                                                         "mlp.gate.", "mlp.shared_experts."))}
    E = cfg.num_experts
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((W[f"mlp.experts.{e}.gate_proj.weight"],
                                                                W[f"mlp.experts.{e}.up_proj.weight"]))
                                                     for e in range(E)])
    state["mlp.experts.down_proj"] = torch.stack([W[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    layer.load_state_dict(state, strict=True)
    h = h_TD.double()[None]
    e = W["embed_tokens.weight"][torch.tensor(ids[1:])][None]
    x = torch.cat((_rms(e, W["enorm.weight"], eps), _rms(h, W["hnorm.weight"], eps)), dim=-1) @ W["eh_proj.weight"].T
    pos = torch.arange(T)[None]
    rope = DeepseekV3RotaryEmbedding(hf).double()
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos))
    want = (_rms(y, W["shared_head.norm.weight"], eps) @ W["shared_head.head.weight"].T)[0]
    assert (got.double() - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("which,k,kwargs", [("random", 1, {}), ("random", 3, {}), ("copy", 3, {}),
                                            ("copy", 2, {"max_num_batched_tokens": 8, "num_kv_blocks": 6})],
                         ids=["random-k1", "random-k3", "copy-k3", "copy-k2-chunked-preempting"])
def test_greedy_ids_equal_without_speculation(mtp_ckpt, copy_ckpt, plain_ids, which, k, kwargs):
    d = mtp_ckpt if which == "random" else copy_ckpt
    llm = LLM(d, speculative_config={"method": "mtp", "num_speculative_tokens": k, **EVERY_BATCH}, **kwargs)
    try:
        got = _ids(llm, GREEDY)
        stats = llm.engine.stats()
        # seeded samples (n = 2: the second shares the first's prompt blocks) draw as without drafts
        assert _ids(llm, SEEDED) == plain_ids[which][1]
    finally:
        llm.shutdown()
    assert got == plain_ids[which][0]
    spec = stats["spec_decode"]
    assert stats["preemptions"] > 0 if "num_kv_blocks" in kwargs else stats["preemptions"] == 0
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] > spec["num_accepted_tokens"]
    assert len(spec["accepted_per_pos"]) == k
    if which == "copy":  # its drafts repeat the last token: accepted where the greedy output does
        per_pos = spec["accepted_per_pos"]
        assert per_pos[-1] > 0 and per_pos == sorted(per_pos, reverse=True)
        assert sum(per_pos) == spec["num_accepted_tokens"]
    else:  # a random layer's drafts are (almost) never accepted
        assert spec["num_accepted_tokens"] <= 1


def test_unseeded_samples_draft_from_q_and_are_verified_by_rejection(copy_ckpt, plain_ids):
    """An unseeded sampled request's drafts are drawn from q = softmax(MTP logits / T) and carry q
    (rejection sampling verifies them); at a temperature near 0, p and q are one-hot at their argmax
    and the output is the greedy one, with drafts accepted."""
    llm = LLM(copy_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2, **EVERY_BATCH})
    seen, real = [], llm.engine.runner.mtp_draft

    def spy(*args):
        drafts, probs = real(*args)
        seen.extend(q for q in probs if q is not None)
        return drafts, probs

    llm.engine.runner.mtp_draft = spy
    try:
        cold = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1e-4, ignore_eos=True)
        got = _ids(llm, cold)
        accepted = llm.engine.stats()["spec_decode"]["num_accepted_tokens"]
    finally:
        llm.shutdown()
    assert got == plain_ids["copy"][0] and accepted > 0
    assert seen and all(q.dim() == 2 and torch.allclose(q.sum(-1), torch.ones(q.shape[0])) for q in seen)


def test_acceptance_counters_reach_the_metrics(copy_ckpt):
    from server.metrics import _EngineCollector

    llm = LLM(copy_ckpt, speculative_config='{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}')
    try:
        llm.generate(MTP_PROMPTS[4:], GREEDY)
        s = llm.engine.stats()["spec_decode"]
        families = {f.name: f for f in _EngineCollector(llm.engine.stats, "tiny").collect()}
    finally:
        llm.shutdown()
    assert s["num_drafts"] > 0 and 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
    accepted = families["shuttle_spec_decode_num_accepted_tokens"].samples
    assert [x.value for x in accepted if x.name.endswith("_total")] == [s["num_accepted_tokens"]]


@pytest.mark.parametrize("which", ["random", "copy"])
def test_mtp_cache_of_kept_positions_equals_a_fresh_pass(mtp_ckpt, copy_ckpt, which):
    """Drafted positions' MTP keys are overwritten once those positions are kept: after steps that
    rejected (random) or accepted (copy) drafts, the MTP layer's cached rows of every computed
    position equal one pass of the target then the MTP layer over the final tokens."""
    d = mtp_ckpt if which == "random" else copy_ckpt
    engine = LLMEngine(engine_config(d, speculative_config={"method": "mtp", "num_speculative_tokens": 3, **EVERY_BATCH},
                                     block_size=4))
    for i, p in enumerate(MTP_PROMPTS[:3]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(10):
        engine.step()
    engine._mtp_propose(*engine._mtp_pending)  # (the last step's MTP passes: the next step would run them first)
    runner = engine.runner
    L, bs = engine.model_cfg.num_layers, runner.block_size
    assert engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    for seqs in engine.requests.values():
        seq = seqs[0]
        n = seq.num_computed_tokens  # positions 0..n-1 computed; token n is the last sampled
        assert seq.num_tokens == n + 1 and not seq.num_draft_tokens
        blocks = -(-n // bs)
        cache = make_paged_cache(runner.cache_cfg, blocks, bs, runner.dtype, "cpu", runner.model.ops)
        batch = AttentionBatch.build_paged([n], [0], [list(range(blocks))], bs)
        with torch.no_grad():
            h = runner.model(torch.tensor(seq.token_ids[:n]), batch, cache)
            runner.mtp.forward(torch.tensor(seq.token_ids[1:n + 1]), h, batch, cache)
        want = cache.kv[L].view(-1, cache.kv[L].shape[-1])[:n]
        pages = runner.cache.kv[L]
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)])
        got = pages.view(-1, pages.shape[-1])[slots]
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item(), f"request {seq.request_id}"


def _fields(batch: AttentionBatch) -> dict:
    """An AttentionBatch's fields as plain values, to compare two builds."""
    out = {}
    for name in ("seq_idx_T", "tok_idx_T", "positions_T", "slots_B", "kv_lens_B", "block_table_BM", "slot_mapping_T"):
        t = getattr(batch, name)
        out[name] = (t.dtype, t.tolist())
    return {**out, "max_q_len": batch.max_q_len, "max_kv_len": batch.max_kv_len, "first_slot": batch.first_slot,
            "parts": batch.parts, "state_slots_B": batch.state_slots_B}


def test_a_decode_build_lays_out_one_token_per_sequence():
    """build_paged of one-token sequences (its numpy path): each token at its context length, in the
    slot its table gives that position, tables padded with -1, as the general layout has them."""
    tables, ctx, bs = [[7, 2, 9], [4], [5, 1]], [33, 2, 16], 16
    got = AttentionBatch.build_paged([1, 1, 1], ctx, tables, bs)
    assert _fields(got) == {
        "seq_idx_T": (torch.int64, [0, 1, 2]), "tok_idx_T": (torch.int64, [0, 0, 0]),
        "positions_T": (torch.int64, ctx), "slots_B": (torch.int64, [0, 1, 2]), "kv_lens_B": (torch.int64, [34, 3, 17]),
        "block_table_BM": (torch.int32, [[7, 2, 9], [4, -1, -1], [5, 1, -1]]),
        "slot_mapping_T": (torch.int64, [9 * bs + 1, 4 * bs + 2, 1 * bs + 0]),
        "max_q_len": 1, "max_kv_len": 34, "first_slot": 0, "parts": None, "state_slots_B": None}


def test_decode_rows_equal_a_build_of_those_rows():
    """The MTP layer's first pass takes the verify step's rows it keeps (AttentionBatch.decode_rows)
    instead of building them: the same batch as a build of just those rows."""
    tables, ctx, bs = [[3, 8]] * 4 + [[6]] * 2, [14, 15, 16, 17, 5, 6], 16
    step = AttentionBatch.build_paged([1] * 6, ctx, tables, bs)
    rows = [0, 1, 4]
    got = step.decode_rows(torch.tensor(rows), max(ctx[r] for r in rows) + 1)
    want = AttentionBatch.build_paged([1] * 3, [ctx[r] for r in rows], [[3, 8]] * 2 + [[6]], bs)
    assert _fields(got) == _fields(want)


@pytest.mark.skipif(not native.avx512_bf16(), reason="no AVX-512 BF16 here: bf16 decode steps run eagerly")
@pytest.mark.parametrize("which", ["builtin-dense", "builtin-token-map", "mixtral-moe"])
def test_native_mtp_passes_draft_as_the_eager_layer(make_checkpoint, tmp_path_factory, which):
    """In bf16 a greedy step's MTP passes run natively: all of them and the head in one call
    (MTPDrafter.native_drafts: prompt chunks as one-token rows, and passes that only cache keys and values),
    or each one-token pass as a native decode step of the layer alone (a
    dense MLP, the built-in model's, as one expert every token takes; a MoE layer as it is). Both run,
    and every pass drafts what the eager layer drafts, chains cut at a block's end included, so the
    outputs and acceptance counts are the same; with the built-in model's token map, from its tokens only."""
    from models.builtin import BUILTIN_DIR

    spec = {"method": "mtp", "num_speculative_tokens": 3, **EVERY_BATCH}
    if which == "builtin-token-map":
        spec["token_map"] = str(BUILTIN_DIR / "mtp_token_map.json")
    if which.startswith("builtin"):
        d = None
    else:
        d = add_mtp_layer(make_checkpoint("mixtral"), tmp_path_factory.mktemp("mtp_mixtral") / "ckpt", seed=2)
        cfg_file = d / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "num_nextn_predict_layers": 1}))
    runs = {}
    for how in ("one call", "passes", "eager"):
        llm = LLM(d, dtype="bfloat16", block_size=8, speculative_config=spec)
        runner, seen, counts = llm.engine.runner, [], []
        mtp = runner.mtp
        assert mtp.native is not None
        real_chain = mtp.native_drafts

        def chain(h_TD, cache, rows, block_size, real=real_chain, counts=counts):
            got = real(h_TD, cache, rows, block_size)
            counts += [(len(rows.ids), rows.count)] if got is not None else []
            return got

        mtp.native_drafts = chain if how == "one call" else (lambda *args: None)
        if how == "passes":
            mtp.native = _Counting(mtp.native)
        elif how == "eager":
            mtp.native = None
        real = runner.mtp_draft

        def spy(*args, real=real, seen=seen):
            drafts, probs = real(*args)
            seen.append(drafts)
            return drafts, probs

        runner.mtp_draft = spy
        try:
            runs[how] = (_ids(llm, GREEDY), seen, llm.engine.stats()["spec_decode"], counts, mtp.native)
        finally:
            llm.shutdown()
    ids, seen, stats, counts, _ = runs["one call"]
    assert counts and any(len(set(c)) > 1 for _, c in counts)  # (chains of several lengths in one call)
    assert any(rows > 4 for rows, _ in counts) and any(not c for _, c in counts)  # (prompt chunks; no drafts)
    assert runs["passes"][4].calls > 0 and any(any(d) for d in seen)
    for how in ("passes", "eager"):
        assert runs[how][:3] == (ids, seen, stats), how
    if "token_map" in spec:
        allowed = set(json.loads(Path(spec["token_map"]).read_text()))
        drafted = {t for drafts in seen for d in drafts for t in d}
        assert drafted and drafted <= allowed and stats["num_accepted_tokens"] > 0


@pytest.mark.skipif(not native.avx512_bf16(), reason="no AVX-512 BF16 here: bf16 decode steps run eagerly")
def test_native_mtp_draws_sampled_drafts_from_q_with_its_uniforms():
    """In bf16 an unseeded sampled request's MTP drafts come from the one native call too: draft j of a
    chain is where the running sum of its q row (returned for rejection sampling: softmax(logits / T),
    a distribution) first passes the call's uniform j (the global generator's, one a draft), and pass
    0's q peaks where the greedy call over the same rows drafts."""
    from dataclasses import replace

    llm = LLM(dtype="bfloat16", block_size=8, speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                                                  **EVERY_BATCH})
    mtp, calls = llm.engine.runner.mtp, []
    real = mtp.native_drafts

    def spy(h_TD, cache, rows, block_size):
        if not any(t > 0 for t in rows.temperature):
            return real(h_TD, cache, rows, block_size)
        state = torch.get_rng_state()
        got = real(h_TD, cache, rows, block_size)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        u_An = torch.rand(len(rows.pick), max(rows.count))
        torch.set_rng_state(after)
        greedy = real(h_TD, cache, replace(rows, temperature=[0.0] * len(rows.pick)), block_size)
        calls.append((rows, u_An, got, greedy))
        return got

    mtp.native_drafts = spy
    try:
        sampled = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
        outs = llm.generate(PROMPTS[:2], sampled)
        stats = llm.engine.stats()["spec_decode"]
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs) and stats["num_accepted_tokens"] > 0
    assert calls and any(max(rows.count) > 1 for rows, *_ in calls)
    V = llm.engine.model_cfg.vocab_size
    for rows, u_An, (drafts, probs), (greedy, _) in calls:
        for a, (count, t) in enumerate(zip(rows.count, rows.temperature)):
            assert t == pytest.approx(0.8) and probs[a].shape == (count, V) and len(drafts[a]) == count
            for j, (x, q_V) in enumerate(zip(drafts[a], probs[a])):
                cdf_V = q_V.double().cumsum(0)
                target = u_An[a, j].item() * cdf_V[-1].item()
                assert q_V.min() >= 0 and abs(cdf_V[-1].item() - 1) < 1e-4 and q_V[x] > 0
                assert cdf_V[x] > target - 1e-6 and (x == 0 or cdf_V[x - 1] <= target + 1e-6)
            assert int(probs[a][0].argmax()) == greedy[a][0]


def test_seeded_samples_draft_with_the_uniforms_their_next_tokens_draw():
    """A seeded sampled request's MTP drafts are drawn from q with the uniforms its generator gives its
    next tokens (read ahead: the generator is not moved), so a draft is the token that position's draw
    from p gives wherever q and p agree on it; verified as point masses, the outputs are plain
    decoding's (float32, the built-in model and its trained head), and drafts are accepted."""
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    plain = LLM(dtype="float32")
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], seeded)]
    finally:
        plain.shutdown()
    llm = LLM(dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2, **EVERY_BATCH})
    runner, seen = llm.engine.runner, []
    real = runner.mtp_draft

    def spy(batch, starts, wanted, temperatures, uniforms):
        for seq, w, t, u in zip(batch.seqs, wanted, temperatures, uniforms):
            if w > 0:
                state = seq.generator.get_state()
                ahead = torch.rand(w, generator=seq.generator).tolist()
                seq.generator.set_state(state)
                seen.append((t, u, ahead))
        return real(batch, starts, wanted, temperatures, uniforms)

    runner.mtp_draft = spy
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], seeded)]
        stats = llm.engine.stats()["spec_decode"]
    finally:
        llm.shutdown()
    assert got == want and stats["num_accepted_tokens"] > 0
    assert seen and all(t == pytest.approx(0.8) and u == ahead for t, u, ahead in seen)


def test_token_maps_are_read_from_json_and_torch_files_and_bad_ones_are_named(tmp_path):
    from models.mtp import load_token_map

    (tmp_path / "m.json").write_text("[7, 3, 5]")
    assert load_token_map(tmp_path / "m.json", 8).tolist() == [3, 5, 7]  # (ascending: argmax ties as the full head)
    torch.save(torch.tensor([6, 1], dtype=torch.int32), tmp_path / "m.pt")
    assert load_token_map(tmp_path / "m.pt", 8).tolist() == [1, 6]
    for text, match in [("[1, 9]", "token id 9 is outside the model's vocabulary of 8"),
                        ("[2, 4, 2]", "token id 2 appears 2 times"), ("[]", "non-empty list"),
                        ("[1.5]", "integer token ids"), ("[[1, 2]]", "shape \\(1, 2\\)"), ("{nope", "not a JSON list")]:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=f"token_map {tmp_path / 'bad.json'}: .*{match}"):
            load_token_map(tmp_path / "bad.json", 8)
    with pytest.raises(ValueError, match="token_map: no file"):
        load_token_map(tmp_path / "none.json", 8)


def test_a_token_map_keeps_outputs_and_draws_sampled_drafts_inside_it(copy_ckpt, plain_ids, tmp_path):
    """With a token map (float32, eager passes) drafts come only from its tokens: greedy ids are the
    plain ones, and tokens the greedy output repeats but the map leaves out are never drafted, while
    the others still are and get accepted; an unseeded sampled request's q is a distribution over the
    vocabulary that is 0 outside the map."""
    V = ModelConfig.from_pretrained(copy_ckpt).vocab_size
    outs = [t for o in plain_ids["copy"][0] for i in o for t in i]
    left_out = set(sorted(set(outs))[::2])
    (tmp_path / "map.json").write_text(json.dumps([t for t in range(V) if t not in left_out]))
    llm = LLM(copy_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                             "token_map": str(tmp_path / "map.json"), **EVERY_BATCH})
    seen, qs, real = [], [], llm.engine.runner.mtp_draft

    def spy(*args):
        drafts, probs = real(*args)
        seen.extend(t for d in drafts for t in d)
        qs.extend(q for q in probs if q is not None)
        return drafts, probs

    llm.engine.runner.mtp_draft = spy
    try:
        got = _ids(llm, GREEDY)
        accepted = llm.engine.stats()["spec_decode"]["num_accepted_tokens"]
        cold = _ids(llm, SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1e-4, ignore_eos=True))
    finally:
        llm.shutdown()
    assert got == cold == plain_ids["copy"][0] and accepted > 0
    assert seen and not set(seen) & left_out
    out = torch.tensor(sorted(left_out))
    assert qs and all(q.shape[-1] == V and torch.allclose(q.sum(-1), torch.ones(q.shape[0]))
                      and not q[:, out].any() for q in qs)


class _Counting:
    """A NativeDecode that counts its steps."""

    def __init__(self, native_decode):
        self.native_decode, self.calls = native_decode, 0

    def mode(self, *args):
        return self.native_decode.mode(*args)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.native_decode(*args, **kwargs)


def test_a_checkpoint_without_mtp_layers_is_refused(base, make_checkpoint):
    # transformers writes num_nextn_predict_layers = 1 but saves no MTP tensors
    with pytest.raises(ValueError, match=f"{base}.*num_nextn_predict_layers = 1.*model.layers.3.eh_proj.weight"):
        LLM(base, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    mixtral = make_checkpoint("mixtral")
    with pytest.raises(ValueError, match=f"mtp needs multi-token-prediction layers, but {mixtral} has none.*"
                                         f"num_nextn_predict_layers"):
        LLM(mixtral, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    from server.llm import engine_config
    with pytest.raises(ValueError, match=f"mtp needs multi-token-prediction layers, but {mixtral} has none"):
        engine_config(mixtral, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                      colocated=False)  # (pools: refused by the front, before any worker starts)
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}).method == "mtp"
    # (/v1/models' metadata: no prompt lookup bounds for mtp)
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2}).to_dict() == {
        "method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
    with pytest.raises(ValueError, match="draft_model needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})


def test_pools_draft_on_the_attention_worker(copy_ckpt, plain_ids):
    """1 + 1 workers: the attention worker (its target model without experts) runs the MTP layer with
    the layer's own experts; the expert worker sees the 1 + d rows of each verification."""
    import time

    llm = LLM(copy_ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2, **EVERY_BATCH}, colocated=False,
              attention_workers=1, expert_workers=1)
    try:
        want = plain_ids["copy"][0]
        assert _ids(llm, GREEDY) == want
        emitted, deadline = sum(len(i) for o in want for i in o), time.monotonic() + 10
        while llm.engine.stats()["generated_tokens"] < emitted and time.monotonic() < deadline:
            time.sleep(0.05)  # (the worker's Stats arrive apart from its tokens)
        spec = llm.engine.stats()["spec_decode"]
    finally:
        llm.shutdown()
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]


def test_glm_mtp_layer_over_the_per_head_cache(make_checkpoint, tmp_path):
    """GLM-4.5 (per-head keys and values, partial rotary, biases): the MTP layer's keys and values in
    the paged cache's extra layer; greedy ids with k = 2 equal those without speculation."""
    base = make_checkpoint("glm4_moe")
    d = add_mtp_layer(base, tmp_path / "glm", seed=2)
    llm = LLM(base)
    try:
        want = _ids(llm, GREEDY)
    finally:
        llm.shutdown()
    llm = LLM(d, speculative_config={"method": "mtp", "num_speculative_tokens": 2, **EVERY_BATCH}, block_size=4)
    try:
        assert len(llm.engine.runner.cache.k) == ModelConfig.from_pretrained(d).num_layers + 1
        assert _ids(llm, GREEDY) == want
        assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    finally:
        llm.shutdown()


def test_mtp_loss_scores_x_t_plus_2_and_trains_the_layer_and_the_trunk(mtp_ckpt):
    """training: the MTP layer over the target's rows without a cache predicts x_{t+2} from (h_t,
    x_{t+1}); its logits equal serving's over the paged cache, and lambda times its cross entropy
    sends gradients to the layer and to the target's weights below it."""
    import torch.nn.functional as F

    from training.losses import IGNORE, lm_loss, mtp_loss, mtp_targets
    from training.model import forward_mtp

    cfg = ModelConfig.from_pretrained(mtp_ckpt)
    target = load_model(mtp_ckpt, kernels="torch").train()
    drafter = load_mtp(mtp_ckpt, cfg, target, kernels="torch")
    drafter.layer.train()
    rows = [PROMPTS[0][:8], PROMPTS[2] + [IGNORE]]  # (8 tokens each; the second's last is padding)
    ids = torch.tensor([[max(t, 0) for t in r] for r in rows])
    labels = torch.tensor([r[1:] + [IGNORE] for r in rows])
    inputs, targets = mtp_targets(labels)
    assert inputs[1].tolist() == PROMPTS[2][1:] + [0] and targets[1].tolist() == PROMPTS[2][2:] + [IGNORE, IGNORE]
    logits, mtp_logits, mtp_labels = forward_mtp(target, drafter, ids, labels)
    assert mtp_logits.shape == (2 * 7, cfg.vocab_size) and mtp_labels.tolist() == targets.reshape(-1).tolist()
    loss = mtp_loss(mtp_logits, mtp_labels, 0.3)
    keep = mtp_labels != IGNORE
    assert torch.allclose(loss, 0.3 * F.cross_entropy(mtp_logits[keep], mtp_labels[keep]))
    (lm_loss(logits, labels.reshape(-1)) + loss).backward()
    assert drafter.layer.eh_proj.weight.grad.abs().sum() > 0 and drafter.layer.mlp.experts.w13.grad.abs().sum() > 0
    assert target.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.grad.abs().sum() > 0
    with torch.no_grad():  # row 0 as serving computes it: the target, then the MTP layer, over a paged cache
        cache = make_paged_cache(drafter.cfg, 2, 4, torch.float32, "cpu", target.ops)
        batch = AttentionBatch.build_paged([7], [0], [[0, 1]], 4)
        h = target(ids[0, :7], batch, cache)
        served = drafter.logits(drafter.forward(inputs[0], h, batch, cache))
    assert (served - mtp_logits[:7].detach()).abs().max() < 1e-4 * served.abs().max()


def test_mtp_depth_two_trains_the_layer_chained_on_its_own_outputs(mtp_ckpt):
    """--mtp-depth 2: after depth 1's rows, the layer runs again on depth 1's outputs (before the head's
    norm) and the tokens they predict, as a chained draft does, and predicts the token after: x_{t+3}
    at row t, IGNORE where a token the chain read is unknown; the teacher rows line up (position t + 2)."""
    from training.losses import IGNORE, mtp_targets
    from training.model import forward_mtp, next_position

    cfg = ModelConfig.from_pretrained(mtp_ckpt)
    target = load_model(mtp_ckpt, kernels="torch")
    drafter = load_mtp(mtp_ckpt, cfg, target, kernels="torch")
    rows = [PROMPTS[0][:8], PROMPTS[2] + [IGNORE]]
    ids = torch.tensor([[max(t, 0) for t in r] for r in rows])
    labels = torch.tensor([r[1:] + [IGNORE] for r in rows])
    with torch.no_grad():
        logits1, mtp1, labels1 = forward_mtp(target, drafter, ids, labels)
        logits, mtp2, labels2 = forward_mtp(target, drafter, ids, labels, depth=2)
        assert mtp2.shape == (2 * 7 + 2 * 6, cfg.vocab_size) and torch.equal(mtp2[:14], mtp1)
        assert torch.equal(labels2[:14], labels1)
        assert labels2[14:20].tolist() == PROMPTS[0][3:8] + [IGNORE]
        assert labels2[20:].tolist() == PROMPTS[2][3:] + [IGNORE] * 2
        holed = labels.clone()
        holed[0, 2] = IGNORE  # (a token mid-row unknown: no depth-2 row whose chain read it is scored)
        _, _, holed2 = forward_mtp(target, drafter, ids, holed, depth=2)
        assert holed2[14:20].tolist() == [IGNORE, IGNORE, IGNORE] + PROMPTS[0][6:8] + [IGNORE]
        teacher = next_position(logits, 2, 8, 2)
        assert teacher.shape == mtp2.shape and torch.equal(teacher[14], logits[2]) and torch.equal(teacher[20], logits[10])
        # sequence 0's depth-2 rows as a chunk over a cache: the layer on its depth-1 outputs and x_{t+2}
        inputs, _ = mtp_targets(labels)
        cache = make_paged_cache(drafter.cfg, 2, 4, torch.float32, "cpu", target.ops)
        batch = AttentionBatch.build_paged([7], [0], [[0, 1]], 4)
        y1 = drafter.forward(inputs[0], target(ids[0, :7], batch, cache), batch, cache)
        cache = make_paged_cache(drafter.cfg, 2, 4, torch.float32, "cpu", target.ops)
        chained = drafter.logits(drafter.forward(ids[0, 2:8], y1[:6], AttentionBatch.build_paged([6], [0], [[0, 1]], 4),
                                                 cache))
    assert (chained - mtp2[14:20]).abs().max() < 1e-4 * chained.abs().max()
