"""MXFP4 weights kept as shipped (kernels/mxfp4_weights.py, kernels/csrc/mxfp4_gemm.c): a checkpoint's
blocks and scales moved into the panels and back bit for bit; mxfp4_linear's kernels (AVX2 and AVX-512
FMA, AVX-512 BF16) against the torch reference at odd shapes (rows 1-255, O not a multiple of 16,
I = 32-160), float32 and bf16, with and without bias, and exactly on every code and a wide range of
scales; the torch reference where the library is off. End to end, a tiny gpt-oss checkpoint with MXFP4
experts (biases, clamped activation) served with --quantization mxfp4 gives the default (dequantised)
path's greedy tokens in float32 with its experts' resident bytes under 0.32x of bf16's, colocated and
on an expert worker, whose loader (keep_mxfp4) hands over the shipped bytes without dequantising them."""
import functools
import logging

import pytest
import torch

import kernels.mxfp4_weights as mx
from kernels import int8
from kernels.quant import dequantize_mxfp4, quantize_mxfp4

KERNELS = [pytest.param(k, id=name, marks=pytest.mark.skipif(k not in mx.kernels(), reason=f"no {name} kernel here "
                                                                                           "(CPU or library)"))
           for k, name in ((mx.AVX2, "avx2"), (mx.AVX512, "avx512"), (mx.BF16DOT, "bf16dot"))]
NEEDS_MX = pytest.mark.skipif(not mx.available(), reason="MXFP4 kernels unavailable here (no AVX2 or no cc)")


def _clear() -> None:
    mx._library.cache_clear(), int8._library.cache_clear(), mx.native._library.cache_clear()


def _checkpoint(O: int, I: int, seed: int, lo: int = 118, hi: int = 134) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (O, I/32, 16), scales (O, I/32)) uint8: every byte value likely, scales from lo to hi - 1."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (O, I // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, torch.randint(lo, hi, (O, I // 32), generator=g, dtype=torch.int32).to(torch.uint8)


@functools.cache
def _weight(O: int, I: int, seed: int = 0) -> mx.Mxfp4Weight:
    return mx.Mxfp4Weight.from_checkpoint(*_checkpoint(O, I, seed))


def _close(got: torch.Tensor, want: torch.Tensor, I: int) -> None:
    """float32: summation order only; bf16: also one rounding of y (each side may round a tie apart)."""
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-2 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * I ** 0.5 * scale)


def test_a_checkpoints_blocks_and_scales_round_trip_bit_for_bit():
    blocks, scales = _checkpoint(37, 96, seed=1, lo=0, hi=255)
    w = mx.Mxfp4Weight.from_checkpoint(blocks, scales)
    assert w.panels.shape == (3, 3, 16, 16) and w.scales.shape == (3, 3, 16)
    got_blocks, got_scales = w.checkpoint()
    assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)
    # the panel layout: byte j of block g of row 16p + o at [p, g, j, o]; padding rows code 0, scale 1
    assert torch.equal(w.panels[1, 2, :, 5], blocks[21, 2]) and torch.equal(w.scales[2, 1, :5], scales[32:, 1])
    assert w.panels[2, :, :, 5:].eq(0).all() and w.scales[2, :, 5:].eq(mx.UNIT_SCALE).all()
    assert torch.equal(w.dequantize(), dequantize_mxfp4(blocks, scales)) and w.nbytes == 48 * 3 * 17
    # quantize: quantize_mxfp4's codes, the same values
    f = torch.randn(37, 96)
    q = mx.Mxfp4Weight.quantize(f, rows_per_chunk=16)
    b, s = quantize_mxfp4(f)
    assert torch.equal(q.checkpoint()[0], b) and torch.equal(q.checkpoint()[1], s)



def test_quantize_mxfp4_rounds_to_the_nearest_value():
    """Each value takes its block's nearest FP4 value (the first of FP4_VALUES on a tie: the smaller
    magnitude, +0 for what rounds to zero), as a brute-force search over the 16 codes finds it,
    on random blocks of every scale and on exact ties, zeros, subnormals and the largest floats."""
    from kernels.quant import FP4_VALUES

    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * 10 ** torch.randn(64, 1, generator=g)
    w[0, :16] = torch.tensor([0.25, -0.25, 0.75, -0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.0, -0.0, 6, -6, 0.1, -0.1])
    w[0, 16:32] = 6.0  # scale 2^0: the first 16 are exact ties
    w[1, :32], w[2, :32] = 0.0, 1e-40
    w[3, :32] = torch.tensor([3e38, -3e38] * 16)
    for x in (w, w.bfloat16()):
        blocks, scales = quantize_mxfp4(x)
        scaled = x.float().unflatten(-1, (-1, 32)) / torch.exp2(scales.float() - 127)[..., None]
        want = (scaled[..., None] - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
        assert torch.equal(blocks, want[..., 0::2] | (want[..., 1::2] << 4))

def test_the_weight_refuses_what_the_kernels_cannot_take():
    with pytest.raises(ValueError, match=r"I a multiple of 32; got torch.float32 \[5, 40\]"):
        mx.Mxfp4Weight.quantize(torch.randn(5, 40))
    blocks, scales = _checkpoint(4, 32, seed=0)
    with pytest.raises(ValueError, match=r"blocks uint8 \(O, G, 16\); got torch.int8"):
        mx.Mxfp4Weight.from_checkpoint(blocks.view(torch.int8), scales)
    with pytest.raises(ValueError, match=r"scales uint8 \[4, 1\]"):
        mx.Mxfp4Weight.from_checkpoint(blocks, scales[:3])
    scales[2, 0] = 0xFF
    with pytest.raises(ValueError, match="NaN scales"):
        mx.Mxfp4Weight.from_checkpoint(blocks, scales)
    with pytest.raises(ValueError, match="input features"):
        mx.mxfp4_linear(torch.randn(2, 33), _weight(4, 32))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 17, 255])
@pytest.mark.parametrize("O, I", [(37, 32), (37, 96), (16, 160), (50, 160)])
def test_mxfp4_linear_equals_the_reference(O, I, T, dtype, kernel):
    if kernel == mx.BF16DOT and dtype != torch.bfloat16:
        pytest.skip("BF16DOT takes bf16 x only")
    w = _weight(O, I)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, I, generator=g).to(dtype)
    bias = torch.randn(O, generator=g) if T % 2 else None
    got = mx.mxfp4_linear(x, w, bias, kernel=kernel)
    assert got.dtype == dtype and got.shape == (T, O)
    _close(got, mx.mxfp4_linear_reference(x, w, bias), I)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernels_decode_every_code_and_scale_exactly(kernel):
    """One block of 32 inputs per row, small integer x: every product and sum is exact, so the kernels
    must equal the reference bitwise. Every byte value, i.e. every code in either nibble, and scale
    bytes from 2^-127 (a subnormal; the AVX-512 FMA kernel) to 2^73."""
    exps = [2, 8, 64, 127, 128, 170, 200] if kernel == mx.BF16DOT else [0, 1, 2, 64, 127, 128, 170, 200]
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 1, 16).repeat(len(exps), 1, 1)
    scales = torch.tensor(exps, dtype=torch.uint8).repeat_interleave(16)[:, None]
    w = mx.Mxfp4Weight.from_checkpoint(blocks, scales)
    x = torch.randint(-8, 9, (19, 32), generator=torch.Generator().manual_seed(0)).float()
    x = x.bfloat16() if kernel == mx.BF16DOT else x
    assert torch.equal(mx.mxfp4_linear(x, w, kernel=kernel), mx.mxfp4_linear_reference(x, w))


@pytest.mark.skipif(mx.BF16DOT not in mx.kernels(), reason="no AVX-512 BF16 kernel here")
@pytest.mark.parametrize("odd", [0, 1, 253, 254])
def test_bf16dot_decodes_a_block_with_a_scale_past_bf16s_normal_range_the_same_way(odd):
    """BF16DOT decodes a panel's block by its table of bf16 codes and an exponent step where all 16 rows'
    scale bytes are in [2, 252], else by float32 products: a row with a scale byte outside (values under
    2^-126, or past bf16's largest) sends its block the other way, and its 15 neighbours still come out
    bitwise as the reference, every code (x = the identity: each output one weight); so does the panel
    beside it, whose scales reach both ends of that range. (Of the odd rows only a scale byte 0 shows
    the way taken: past the range the row is NaN in every output either way, 0 x inf, and at 1 the
    values the table would get wrong are subnormals, which the dot products read as zero.)"""
    exps = torch.full((32,), 127, dtype=torch.uint8)
    exps[5], exps[20], exps[21] = odd, 252, 2
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 1, 16).repeat(2, 1, 1)
    w = mx.Mxfp4Weight.from_checkpoint(blocks, exps[:, None])
    x = torch.eye(32).bfloat16()
    got = mx.mxfp4_linear(x, w, kernel=mx.BF16DOT)
    # the reference with the values under 2^-126 zero, as the BF16 dot products read subnormal weights
    # (past the range the odd row is inf or NaN: 0 x inf in every output)
    w_OI = dequantize_mxfp4(blocks, exps[:, None])
    w_OI = torch.where(w_OI.abs() < 2.0 ** -126, 0.0, w_OI)
    want = (x.float() @ w_OI.T).bfloat16()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@NEEDS_MX
@pytest.mark.parametrize("kernel", KERNELS)
def test_mxfp4_linear_threads_and_leading_dims(kernel):
    w, dtype = _weight(70, 128), torch.bfloat16
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mx.mxfp4_linear(x, w, kernel=kernel)
        torch.set_num_threads(2)
        two = mx.mxfp4_linear(x, w, kernel=kernel)
    finally:
        torch.set_num_threads(before)
    assert one.shape == (2, 9, 70) and torch.equal(one, two)  # each panel's sums do not depend on the split
    # the leading dims are rows of one call (a part of them alone is tiled otherwise: another summation order)
    assert torch.equal(two.reshape(18, 70), mx.mxfp4_linear(x.reshape(18, 128), w, kernel=kernel))
    assert mx.mxfp4_linear(x[:, :0], w).shape == (2, 0, 70)


@pytest.mark.skipif(mx.BF16DOT not in mx.kernels(), reason="no AVX-512 BF16 kernel here: nothing to choose")
def test_the_kernel_choice_sends_bf16_rows_to_bf16dot_where_it_says_so(monkeypatch):
    """kernels/choice.py's "mxfp4" table (forced here, as SHUTTLE_KERNEL_CHOICE forces it) picks the
    kernel mxfp4_linear runs for bf16 x by default; float32 x keeps the FMA kernel."""
    from kernels import choice

    w, x = _weight(37, 96), torch.randn(5, 96).bfloat16()
    monkeypatch.setenv(choice.ENV_VAR, "mxfp4=bf16dot")
    try:
        assert choice.configure("mxfp4", [(37, 96)]).picks == ["bf16dot"] * len(mx.native.BUCKET_ROWS)
        assert torch.equal(mx.mxfp4_linear(x, w), mx.mxfp4_linear(x, w, kernel=mx.BF16DOT))
        assert torch.equal(mx.mxfp4_linear(x.float(), w), mx.mxfp4_linear(x.float(), w, kernel=mx.AVX512))
    finally:
        mx.set_bf16dot_rows([False] * len(mx.native.BUCKET_ROWS))
        choice._chosen.pop("mxfp4", None)


def test_without_the_library_mxfp4_linear_is_the_torch_reference(monkeypatch, caplog):
    w = _weight(37, 96)
    x, bias = torch.randn(3, 96).bfloat16(), torch.randn(37)
    monkeypatch.setenv(mx.native.ENV_VAR, "0")
    _clear()
    try:
        with caplog.at_level(logging.INFO, logger="shuttle"):
            assert not mx.available() and not mx.kernels()
        assert torch.equal(mx.mxfp4_linear(x, w, bias), mx.mxfp4_linear_reference(x, w, bias))
    finally:
        monkeypatch.undo()
        _clear()
    # autograd takes the reference too
    xg = torch.randn(4, 96, requires_grad=True)
    mx.mxfp4_linear(xg, w).sum().backward()
    torch.testing.assert_close(xg.grad, w.dequantize().sum(dim=0).expand(4, -1))


def test_the_c_entry_point_refuses_what_it_cannot_run():
    if mx._library() is None:
        pytest.skip("no library")
    lib = mx._library()
    assert lib.shuttle_mxfp4_linear(None, 0, 1, 40, None, None, None, 4, None, 0, 1, mx.AVX512) == -2  # I % 32
    assert lib.shuttle_mxfp4_linear(None, 0, 1, 32, None, None, None, 4, None, 0, 1, mx.BF16DOT) == -2  # float32 x
    assert lib.shuttle_mxfp4_linear(None, 0, 1, 32, None, None, None, 4, None, 0, 1, int8.AMX) == -2  # none


# --- the fused MXFP4 MoE block ---

def _experts(E: int, D: int, I: int, act, biases: bool, seed: int = 0) -> mx.Mxfp4Experts:
    g = torch.Generator().manual_seed(seed)
    w13 = [mx.Mxfp4Weight.quantize(torch.randn(2 * I, D, generator=g) / D ** 0.5) for _ in range(E)]
    w2 = [mx.Mxfp4Weight.quantize(torch.randn(D, I, generator=g) / I ** 0.5) for _ in range(E)]
    b13, b2 = (torch.randn(E, 2 * I, generator=g), torch.randn(E, D, generator=g)) if biases else (None, None)
    return mx.Mxfp4Experts(w13, w2, b13, b2, act)


@NEEDS_MX
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("variant", ["silu", "gpt_oss"])
def test_fused_mxfp4_block_equals_the_per_expert_linears(variant, T, dtype):
    """fused_moe_mxfp4 (one native call) is fused_moe_packed on the experts' mxfp4_linear: the same ops in
    the same order, so float32 differs by exp's rounding only and bf16 by the rare rounding that makes;
    for every kernel it runs, at odd sizes (D 96, I 160), with gpt-oss's biases and clamped SwiGLU, and
    with ids outside [0, E) skipped."""
    from kernels.moe import SILU, SwiGLU

    act = SILU if variant == "silu" else SwiGLU(alpha=1.702, limit=7.0, up_offset=1.0)
    experts = _experts(5, 96, 160, act, biases=variant == "gpt_oss")
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 96, generator=g).to(dtype)
    ids = torch.randint(0, 5, (T, 2), generator=g)
    ids[:, 1] = (ids[:, 0] + 1 + torch.randint(0, 4, (T,), generator=g)) % 5  # two distinct experts a token
    w = torch.rand(T, 2, generator=g)
    want = mx.fused_moe_mxfp4_reference(x, ids, w, experts)
    for kernel in [None, *(k for k in (mx.AVX2, mx.AVX512, mx.BF16DOT) if k in mx.kernels())]:
        if kernel == mx.BF16DOT and dtype != torch.bfloat16:
            continue
        got = mx.fused_moe_mxfp4(x, ids, w, experts, kernel=kernel)
        assert got.dtype == dtype and got.shape == (T, 96)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # a bf16 rounding apart where exp rounds a tie the other way, then carried along
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2e-2 * want.abs().max().item())
    skipped = ids.clone()
    skipped[:, 1] = 9  # not an expert of this block: its pairs add nothing
    torch.testing.assert_close(mx.fused_moe_mxfp4(x, skipped, w, experts),
                               mx.fused_moe_mxfp4_reference(x, ids[:, :1], w[:, :1], experts).to(dtype),
                               rtol=2 ** -6 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


@NEEDS_MX
def test_packed_mxfp4_experts_run_the_fused_block(monkeypatch):
    """PackedExperts of MXFP4 weights run one fused_moe_mxfp4 call per layer, biases and gpt-oss's
    activation included."""
    from kernels.cpu_linear import CpuWeight
    from kernels.moe import SwiGLU
    from models.cpu_inference import PackedExperts

    experts = _experts(4, 64, 96, SwiGLU(alpha=1.702, limit=7.0, up_offset=1.0), biases=True)
    packed = PackedExperts.from_packed([CpuWeight.quantized(w) for w in experts.w13_E],
                                       [CpuWeight.quantized(w) for w in experts.w2_E], experts._b13, experts._b2,
                                       experts.act)
    assert packed.mxfp4 is not None
    calls = []
    monkeypatch.setattr("models.cpu_inference.fused_moe_mxfp4", lambda *a: calls.append(a) or mx.fused_moe_mxfp4(*a))
    x, ids, w = torch.randn(3, 64), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    torch.testing.assert_close(packed(x, ids, w), mx.fused_moe_mxfp4_reference(x, ids, w, experts), rtol=1e-5,
                               atol=1e-5)
    assert len(calls) == 1


# --- a gpt-oss checkpoint with MXFP4 experts, served ---

def test_keep_mxfp4_hands_over_the_shipped_bytes_without_dequantising(gpt_oss_mxfp4):
    from safetensors.torch import load_file

    from models.cpu_inference import PackedExperts
    from models.loader import load_experts, load_model

    q = load_file(gpt_oss_mxfp4 / "model.safetensors")
    name = "model.layers.1.mlp.experts."
    mine = load_experts(gpt_oss_mxfp4, [3, 1], keep_mxfp4=True)[1]
    blocks, scales = mine.mxfp4_checkpoint["w13"]
    gate_then_up = torch.cat((torch.arange(0, 128, 2), torch.arange(1, 128, 2)))  # (interleaved on disk)
    assert torch.equal(blocks, q[name + "gate_up_proj_blocks"][[3, 1]][:, gate_then_up])
    assert torch.equal(scales, q[name + "gate_up_proj_scales"][[3, 1]][:, gate_then_up])
    assert torch.equal(mine.mxfp4_checkpoint["w2"][0], q[name + "down_proj_blocks"][[3, 1]])
    assert mine.w13.stride() == (0, 0, 0) and not mine.w13.any()  # never dequantised: no memory
    packed = PackedExperts(mine, "mxfp4")
    w = packed.w13_packed[0].int8
    assert isinstance(w, mx.Mxfp4Weight) and torch.equal(w.checkpoint()[0], blocks[0])
    # the same block as the dequantised experts of ids 3 and 1 (local 0 and 1), up to summation order
    ref = load_model(gpt_oss_mxfp4).model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(0)
    x, local, wk = torch.randn(6, 128, generator=g), torch.tensor([[0, 1], [1, 0], [0, 1]] * 2), torch.rand(6, 2)
    torch.testing.assert_close(packed(x, local, wk), ref(x, torch.tensor([3, 1])[local], wk), rtol=1e-5, atol=1e-6)
    model = load_model(gpt_oss_mxfp4, keep_mxfp4=True)
    assert torch.equal(model.model.layers[2].mlp.experts.mxfp4_checkpoint["w2"][1],
                       q["model.layers.2.mlp.experts.down_proj_scales"])


def test_gpt_oss_served_with_mxfp4_experts_matches_the_dequantised_path(gpt_oss_mxfp4):
    from server import LLM, SamplingParams
    from tests.conftest import PROMPTS
    from tests.test_quantization import expert_weights

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(gpt_oss_mxfp4)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy)]
    finally:
        plain.shutdown()
    llm = LLM(gpt_oss_mxfp4, quantization="mxfp4")
    try:
        assert llm.engine_cfg.quantization == "mxfp4" and llm.engine_cfg.dtype == torch.float32
        weights = expert_weights(llm)
        assert weights and all(isinstance(w.int8, mx.Mxfp4Weight) for w in weights)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        runner = llm.engine.runner
        bf16_bytes = runner.weight_bytes["experts"] // 2  # (the float32 parameters, in bf16)
        assert runner.resident_bytes["experts"] <= 0.32 * bf16_bytes
    finally:
        llm.shutdown()
    assert got == want
    # an expert worker keeps the checkpoint's blocks as shipped (keep_mxfp4): the same tokens and bytes
    pools = LLM(gpt_oss_mxfp4, quantization="mxfp4", colocated=False, attention_workers=1, expert_workers=1)
    try:
        assert [o.outputs[0].token_ids for o in pools.generate(PROMPTS, greedy)] == want
        rows = {(r["pool"], r["kind"]): r["bytes"] for r in pools.engine.stats()["weights"]}
    finally:
        pools.shutdown()
    assert rows[("expert", "experts")] == runner.resident_bytes["experts"]
    with pytest.raises(ValueError, match="already MXFP4-quantised; --quantization int8 .* --quantization mxfp4"):
        LLM(gpt_oss_mxfp4, quantization="int8")


@NEEDS_MX
def test_fused_mxfp4_block_over_several_chunks_and_row_blocks_equals_the_per_expert_linears():
    """A hidden size of more blocks than one chunk decodes (BF16DOT: 64 blocks of 32 inputs; 66 here, so
    a short last chunk) and enough tokens for blocks of rows and tiles of every size: fused_moe_mxfp4
    with each kernel against the per-expert linears, one block of them with scales under bf16's normal
    range (decoded apart)."""
    from kernels.moe import SILU

    D, I, T = 66 * 32, 96, 300
    experts = _experts(3, D, I, SILU, biases=False, seed=3)
    experts.w13_E[1].scales[0, 0, 5] = 1  # block 0 of expert 1's gate rows 0-15: products under bf16's normals
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(T, D, generator=g) * 0.01).bfloat16()
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    want = mx.fused_moe_mxfp4_reference(x, ids, w, experts)
    for kernel in [k for k in (mx.AVX512, mx.BF16DOT) if k in mx.kernels()]:
        got = mx.fused_moe_mxfp4(x, ids, w, experts, kernel=kernel)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2e-2 * want.abs().max().item())
