"""The built-in model, and tiny random checkpoints made locally (never downloaded) for tests.

`builtin_model_dir()` is the trained checkpoint committed in models/builtin/ (see its model card).
Tokenizers are byte-level BPE trained with `tokenizers` on text every Python install carries
(pydoc_data's topics), saved so that `AutoTokenizer.from_pretrained` loads them offline.
"""
import json
import shutil
from pathlib import Path
from typing import Iterable

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"

# Tools (when given) and earlier tool calls render in the Hermes/Qwen style that `--tool-call-parser
# hermes` reads back; without them the template is the plain role/content one.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools you may call, each as <tool_call>{\"name\": NAME, \"arguments\": {...}}"
    "</tool_call>:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|end|>"]


def corpus() -> list[str]:
    """English text available offline on every machine: the Python documentation's topics."""
    from pydoc_data.topics import topics
    return [topics[k] for k in sorted(topics)]


def train_tokenizer(out_dir: str | Path, vocab_size: int = 1024, texts: Iterable[str] | None = None) -> None:
    """Train a byte-level BPE tokenizer on `texts` (default: corpus()) and save it (tokenizer.json +
    config) into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus() if texts is None else texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def make_random_checkpoint(out_dir: str | Path, config, seed: int = 0, dtype: str = "float32",
                           tokenizer_dir: str | Path | None = None, build_in_dtype: bool = False) -> Path:
    """Save a transformers model with random weights built from `config` (a transformers config
    object), plus a tokenizer (copied from tokenizer_dir, or trained). Returns out_dir.
    build_in_dtype: initialise the weights in `dtype` itself rather than in float32 and cast them
    (other random values; a bf16 checkpoint of billions of parameters then needs half the memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    if build_in_dtype:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    if tokenizer_dir is None:
        train_tokenizer(out, vocab_size=config.vocab_size)
    elif Path(tokenizer_dir).resolve() != out.resolve():
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, out / f.name)
    return out


def randomize_correction_bias(model_dir: str | Path, seed: int = 0, scale: float = 0.2) -> None:
    """transformers initialises DeepSeek-V3's e_score_correction_bias to zeros; trained checkpoints
    have non-zero ones (they steer which experts are chosen), so tests and benchmarks rewrite them
    with uniform [0, scale) values in place."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(f)
        for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
            tensors[name] = torch.rand(tensors[name].shape, generator=gen) * scale
        save_file(tensors, f, metadata={"format": "pt"})


def randomize_norms(model_dir: str | Path, seed: int = 0, scale: float = 0.2) -> None:
    """Rewrite every `*norm.weight` tensor with normal(0, scale) values in place: Qwen3-Next's
    transformers initialisation leaves its norms at zeros (they scale by 1 + weight), so tests could
    not tell a norm that lost its weight, or its offset."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(f)
        for name in [n for n in tensors if n.endswith("norm.weight")]:
            tensors[name] = (torch.randn(tensors[name].shape, generator=gen) * scale).to(tensors[name].dtype)
        save_file(tensors, f, metadata={"format": "pt"})


def randomize_biases(model_dir: str | Path, seed: int = 0, scale: float = 0.1, sink_scale: float = 1.0) -> None:
    """transformers initialises linear biases (and gpt-oss's expert biases) to zeros; tests rewrite
    every `*bias` tensor with normal(0, scale) values and the attention sinks (gpt-oss's `sinks`,
    MiMo-V2-Flash's `attention_sink_bias`) with
    normal(0, sink_scale) ones, so a model that forgot one of them differs. Correction biases get
    randomize_correction_bias's uniform values."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed + 1)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.rand(t.shape, generator=gen) * 0.2
            elif name.endswith(("bias", "sinks")):
                s = sink_scale if name.endswith(("sinks", "attention_sink_bias")) else scale  # (MiMo's name)
                tensors[name] = (torch.randn(t.shape, generator=gen) * s).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})


def randomize_v4(model_dir: str | Path, seed: int = 0) -> None:
    """DeepSeek-V4's tensors that transformers initialises to constants, made random so a model that
    forgot one differs: the sinks (attn_sink), compressors' position biases (ape), mHC's biases,
    correction biases (ffn.gate.bias), and each hash layer's token-to-experts table (tid2eid:
    distinct experts per token; transformers' zeros would send every token to expert 0 twice)."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed + 2)
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("tid2eid"):
                experts = int(json.loads((Path(model_dir) / "config.json").read_text())["n_routed_experts"])
                tensors[name] = torch.rand(t.shape[0], experts, generator=gen).argsort(-1)[:, :t.shape[1]].contiguous().to(t.dtype)
            elif name.endswith("gate.bias"):
                tensors[name] = torch.rand(t.shape, generator=gen) * 0.2
            elif name.endswith(("attn_sink", "ape", "_base", "hc_base")):
                tensors[name] = (torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})


def builtin_model_dir() -> Path:
    """The built-in model: the checkpoint committed in models/builtin/, trained by this project's
    training module (`shuttle train --recipe builtin`; its README.md is the model card)."""
    if not (BUILTIN_DIR / "config.json").is_file():
        raise FileNotFoundError(f"{BUILTIN_DIR}: the built-in model is missing; pass --model DIR, or train it "
                                f"(`shuttle train --recipe builtin`, see {BUILTIN_DIR}/README.md in the repository)")
    return BUILTIN_DIR
