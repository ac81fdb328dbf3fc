"""Checkpoints: the model in the Hugging Face layout the server loads, plus what exact resumption
needs, written so that a crash at any moment leaves the newest complete checkpoint usable.

    OUT/checkpoints/step-00000100/   config.json, generation_config.json, tokenizer files,
                                     model.safetensors (one rank) or model-0000r-of-0000n.safetensors
                                     + model.safetensors.index.json (expert parallel: rank r writes its
                                     experts, rank 0 also everything else),
                                     trainer/meta.json, trainer/rank-0000r.pt (optimiser, schedule, RNG,
                                     data position), trainer/master/ (float32 weights, when the model
                                     files are saved in a lower precision)
    OUT/checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written into checkpoints/.tmp-step-..., its files and directories are fsynced, it is
renamed when complete, and only then is `latest` replaced (os.replace of a fsynced temporary file),
so `latest` always names a complete checkpoint, after a power loss too.
Tensor names are the checkpoints' own (models/loader.py maps them): per-expert matrices, Mixtral's
and MiniMax-M2's `block_sparse_moe` module; gpt-oss's fused, transposed, gate/up-interleaved experts
and its `mlp.router`; Llama 4's `feed_forward` module (models.checkpoint.RENAMES) and fused, transposed experts.
"""
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from models.config import DTYPES
from models.checkpoint import FUSED_TRANSPOSED, RENAMES, STACKED_EXPERTS, expert_checkpoint_names, v4_checkpoint_name
from models.moe_decoder import MoEForCausalLM
from models.norm import RMSNorm
from training.data import TOKENIZER_FILES
from training.parallel import ParallelContext



def hf_tensors(model: MoEForCausalLM, expert_ids: tuple[int, ...], dtype: torch.dtype, replicated: bool = True,
               experts: bool = True, mtp: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names, in `dtype`: stacked experts split into
    per-expert matrices (global ids expert_ids), tied lm_head left out. replicated / experts: which
    part to include. mtp: an MTP layer (models/mtp.MTPLayer, holding every expert), saved with the
    replicated part as model.layers.{num_layers}.*."""
    cfg = model.cfg
    out = _hf_tensors(cfg, model.named_parameters(), model.modules(), expert_ids, dtype, replicated, experts)
    if mtp is not None and replicated:
        prefix = f"model.layers.{cfg.num_layers}."
        out.update(_hf_tensors(cfg, [(prefix + n, p) for n, p in mtp.named_parameters()], mtp.modules(),
                               tuple(range(cfg.num_experts)), dtype, True, True))
    if cfg.family == "deepseek_v4":
        out = {v4_checkpoint_name(name): t for name, t in out.items()}
    return out


def _hf_tensors(cfg, named, modules, expert_ids: tuple[int, ...], dtype: torch.dtype, replicated: bool,
                experts: bool) -> dict[str, torch.Tensor]:
    I = cfg.moe_intermediate_size
    module, names = expert_checkpoint_names(cfg.family)
    out = {}
    renames = [(ours, theirs) for theirs, ours in RENAMES.get(cfg.family, ())]
    offset = {id(m.weight) for m in modules if isinstance(m, RMSNorm)} if cfg.norm_offset else set()
    for name, p in named:  # a tied lm_head is listed once, as embed_tokens
        # DeepSeek-V3's correction bias stays float32 (transformers keeps it so: it orders close scores)
        t = p.detach().to(torch.float32 if name.endswith("e_score_correction_bias") else dtype)
        if not p.is_floating_point():  # (DeepSeek-V4's token-to-experts tables)
            t = p.detach()
        if id(p) in offset:  # Qwen3-Next's checkpoints store weight - 1 (models/loader.offset_norms)
            t = (p.detach().float() - cfg.norm_offset).to(t.dtype)
        for ours, theirs in renames:
            name = name.replace(ours, theirs)
        if cfg.family in FUSED_TRANSPOSED and (m := _FUSED_EXPERTS.match(name)):
            if experts:
                t = _gpt_oss_layout(t, m.group(3)) if cfg.family == "gpt_oss" else t.transpose(1, 2).contiguous()
                out[f"{m.group(1)}.{m.group(2)}.experts.{_FUSED_NAMES[m.group(3)]}"] = t
            continue
        if name.endswith(".mlp.gate.e_score_correction_bias") and cfg.family == "minimax_m2":
            if replicated:
                out[name.replace(".mlp.gate.", ".block_sparse_moe.")] = t.clone()
            continue
        if m := STACKED_EXPERTS.match(name):
            if not experts:
                continue
            prefix = f"{m.group(1)}.{module}.experts"
            for i, e in enumerate(expert_ids):
                if m.group(2) == "w13":
                    out[f"{prefix}.{e}.{names[0]}.weight"] = t[i, :I].clone()
                    out[f"{prefix}.{e}.{names[1]}.weight"] = t[i, I:].clone()
                else:
                    out[f"{prefix}.{e}.{names[2]}.weight"] = t[i].clone()
        elif replicated:
            out[name.replace(".mlp.gate.", f".{module}.gate.")] = t.contiguous().clone()  # Mixtral: block_sparse_moe
    return out


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.(mlp|feed_forward)\.experts\.(w13|w2|b13|b2)$")
_FUSED_NAMES = {"w13": "gate_up_proj", "w2": "down_proj", "b13": "gate_up_proj_bias", "b2": "down_proj_bias"}


def _gpt_oss_layout(t: torch.Tensor, param: str) -> torch.Tensor:
    """A stacked expert tensor in gpt-oss's checkpoint layout (the inverse of models.loader.apply_layout):
    w13 (E, 2I, D) -> gate_up_proj (E, D, 2I) with gate and up interleaved, w2 -> down_proj (E, I, D),
    b13 (E, 2I) interleaved, b2 as is."""
    if param in ("w13", "b13"):
        E, I2 = t.shape[:2]
        gate, up = t[:, :I2 // 2], t[:, I2 // 2:]
        t = torch.stack((gate, up), dim=2).reshape(t.shape)  # rows gate0, up0, gate1, up1, ...
    if param in ("w13", "w2"):
        t = t.transpose(1, 2)
    return t.contiguous().clone()


def write_model(directory: Path, model: MoEForCausalLM, ctx: ParallelContext, dtype: torch.dtype,
                mtp: nn.Module | None = None) -> None:
    """Every rank calls this: safetensors files of the whole model into `directory` (which exists).
    One rank: model.safetensors. Expert parallel: ranks 0..ep-1 each write their experts' shard (rank
    0 also the rest, and the MTP layer `mtp`, see hf_tensors) and rank 0 the index."""
    expert_ids = ctx.expert_ids(model.cfg.num_experts)
    if ctx.ep_size > 1 and model.cfg.family in FUSED_TRANSPOSED:
        raise ValueError(f"{model.cfg.family} checkpoints store each layer's experts as one fused tensor: save them "
                         f"from one expert-parallel rank (--expert-parallel 1)")
    if ctx.ep_size == 1:
        if ctx.is_main:
            save_file(hf_tensors(model, expert_ids, dtype, mtp=mtp), str(directory / "model.safetensors"),
                      {"format": "pt"})
        return
    entries: list[tuple[str, str, int]] = []
    if ctx.rank < ctx.ep_size:  # the first expert-parallel group holds every expert once
        fname = f"model-{ctx.rank + 1:05d}-of-{ctx.ep_size:05d}.safetensors"
        tensors = hf_tensors(model, expert_ids, dtype, replicated=ctx.is_main, mtp=mtp)
        save_file(tensors, str(directory / fname), {"format": "pt"})
        entries = [(n, fname, t.numel() * t.element_size()) for n, t in tensors.items()]
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, entries)
    if ctx.is_main:
        weight_map = {n: f for part in gathered for n, f, _ in part}
        total = sum(size for part in gathered for _, _, size in part)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_config_files(directory: Path, raw_config: dict[str, Any], dtype_name: str,
                       tokenizer_dir: Path | None) -> None:
    """config.json (the family's transformers format, with the saved dtype), generation_config.json
    and the tokenizer files."""
    raw = dict(raw_config)
    raw["dtype"] = dtype_name
    if "torch_dtype" in raw:
        raw["torch_dtype"] = dtype_name
    (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    gen = {k: raw.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
    (directory / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **gen}, indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, directory / name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file and directory under root on disk (rename is atomic, but only over data that is)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def save_checkpoint(out: Path, step: int, model: MoEForCausalLM, ctx: ParallelContext, raw_config: dict[str, Any],
                    tokenizer_dir: Path | None, save_dtype: str, trainer_state: dict[str, Any],
                    meta: dict[str, Any], keep: int, mtp: nn.Module | None = None) -> Path:
    """Every rank calls this (collectively). Writes OUT/checkpoints/step-N atomically, then points
    `latest` at it and deletes all but the `keep` newest (mtp: an MTP layer saved with the model).
    Returns the checkpoint directory."""
    root = out / "checkpoints"
    name = f"step-{step:08d}"
    tmp, final = root / f".tmp-{name}", root / name
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "trainer").mkdir(parents=True)
    ctx.barrier()
    write_model(tmp, model, ctx, DTYPES[save_dtype], mtp)
    if save_dtype != "float32":  # resumption needs the float32 master weights
        if ctx.is_main:
            (tmp / "trainer" / "master").mkdir()
        ctx.barrier()
        write_model(tmp / "trainer" / "master", model, ctx, torch.float32, mtp)
    torch.save(trainer_state, tmp / "trainer" / f"rank-{ctx.rank:05d}.pt")
    ctx.barrier()
    if ctx.is_main:
        write_config_files(tmp, raw_config, save_dtype, tokenizer_dir)
        (tmp / "trainer" / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")  # Paths as text
        old = root / f".old-{name}"
        pointer = root / "latest"
        assert not (pointer.is_file() and pointer.read_text().strip() == name), f"{name} is latest: never rewritten"
        _fsync_tree(tmp)
        if final.exists():  # re-saved after a restart from an older checkpoint
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(root)
        _write_atomic(root / "latest", name + "\n")
        shutil.rmtree(old, ignore_errors=True)
        _prune(root, keep, name)
    ctx.barrier()
    return final


def _prune(root: Path, keep: int, latest: str) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for p in done[:-keep]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint `latest` names, None when there is none yet; stale temporary directories of an
    interrupted write are ignored (the next save replaces them)."""
    pointer = out / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = out / "checkpoints" / pointer.read_text().strip()
    if not (path / "trainer" / "meta.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def weights_dir(checkpoint: Path) -> Path:
    """Where a checkpoint's float32 weights are: trainer/master, else the model files themselves."""
    master = checkpoint / "trainer" / "master"
    return master if master.is_dir() else checkpoint


def load_trainer_state(checkpoint: Path, ctx: ParallelContext) -> dict[str, Any]:
    """This rank's optimiser, schedule, RNG and data state from a checkpoint written by the same
    rank layout (a ValueError otherwise)."""
    meta = json.loads((checkpoint / "trainer" / "meta.json").read_text())
    if (meta["world_size"], meta["ep_size"]) != (ctx.world_size, ctx.ep_size):
        raise ValueError(f"{checkpoint} was written by {meta['world_size']} ranks with expert parallel "
                         f"{meta['ep_size']}; resume with the same, or start a new run from it with --init-from")
    return torch.load(checkpoint / "trainer" / f"rank-{ctx.rank:05d}.pt", map_location="cpu", weights_only=False)


def export_model(directory: Path, model: MoEForCausalLM, ctx: ParallelContext, raw_config: dict[str, Any],
                 tokenizer_dir: Path | None, save_dtype: str, mtp: nn.Module | None = None) -> None:
    """The final model (and its MTP layer `mtp`) as a servable checkpoint in `directory` itself
    (collective). Files are written into a temporary directory and then moved in one by one; old
    model files are removed first."""
    tmp = directory / ".tmp-export"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx.barrier()
    write_model(tmp, model, ctx, DTYPES[save_dtype], mtp)
    ctx.barrier()
    if ctx.is_main:
        write_config_files(tmp, raw_config, save_dtype, tokenizer_dir)
        for old in list(directory.glob("model*.safetensors")) + list(directory.glob("model.safetensors.index.json")):
            old.unlink()
        for f in tmp.iterdir():
            os.replace(f, directory / f.name)
        tmp.rmdir()
    ctx.barrier()
