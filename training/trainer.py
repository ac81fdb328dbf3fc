"""The training loop: one step is `read this rank's micro-batches -> forward and backward each ->
reduce gradients -> clip -> AdamW`; around it, the schedule, evaluation, logs, heartbeats and
checkpoints. `train(cfg)` runs a whole job (one process of it under torchrun).

A run resumes from OUT/checkpoints/latest when there is one (torchrun --max-restarts restarts every
rank after a failure; each comes back here), restoring weights, optimiser, schedule, RNG and the data
position, so the loss curve continues where it left off.
"""
import json
import logging
import math
import random
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from models.config import ModelConfig
from training.checkpoint import export_model, load_trainer_state, save_checkpoint
from training.config import TrainConfig
from training.data import BatchLayout, PackedSamples, ShuffledLoader, eval_batches, tokenize_files
from training.losses import (Losses, lm_loss, load_balancing_loss, mtp_agreement, mtp_distill_loss, mtp_loss,
                             router_z_loss)
from training.metrics import Heartbeat, JsonlLog, find_stragglers, measure_peak_flops, train_flops_per_token
from training.model import (MTP_NAME, RouterLogits, Shard, build_model, build_mtp, check_mtp_family, forward_logits,
                            forward_mtp, is_expert_param, next_position)
from training.optim import CosineSchedule, build_optimizer, set_lr
from training.parallel import (AllToAllDispatcher, CommClock, ParallelContext, all_gather_floats, all_reduce_sum,
                               broadcast_object, clip_grad_norm_, init_distributed, reduce_gradients)
from training.source import ModelSource, model_source, resolve_tokenizer

log = logging.getLogger("shuttle.train")
CALIBRATION_STEPS = 5  # --max-minutes without --max-steps: steps timed to size the schedule
UNSIZED = 10 ** 9  # schedule length until calibrated (the cosine stays at its top meanwhile)


class Trainer:
    """One rank's share of a run. Build, then `run()`; see the module docstring."""

    def __init__(self, cfg: TrainConfig, ctx: ParallelContext, source: ModelSource | None = None):
        self.cfg, self.ctx, self.clock = cfg, ctx, CommClock()
        cfg.out.mkdir(parents=True, exist_ok=True)
        source = source or model_source(cfg)
        self.tokenizer_dir, self.raw_config = resolve_tokenizer(cfg, source, ctx)
        self._mtp_config(source)
        self.model_cfg = ModelConfig.from_dict(self.raw_config, source="config.json")
        if cfg.mtp_layers:
            check_mtp_family(self.model_cfg)
        self.save_dtype = cfg.save_dtype or str(self.model_cfg.dtype).replace("torch.", "")
        self.layout = BatchLayout(cfg.micro_batch_size, cfg.grad_accum, ctx.rank, ctx.world_size)
        self.loader, self.eval_set = self._data()
        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_cfg, Shard(ctx.expert_ids(self.model_cfg.num_experts)), ctx.device,
                                 source.weights, cfg.seed, float(self.raw_config.get("initializer_range", 0.02)),
                                 self.raw_config.get("pad_token_id"))
        if ctx.ep_size > 1:
            self.model.dispatcher = AllToAllDispatcher(ctx, self.model_cfg.num_experts, self.clock)
        # --mtp-layers: an MTP layer beside the model (all its experts on every rank: replicated)
        self.mtp = (build_mtp(self.model_cfg, self.model, ctx.device, source.weights, cfg.seed,
                              float(self.raw_config.get("initializer_range", 0.02)), cfg.mtp_dense)
                    if cfg.mtp_layers else None)
        self.frozen = cfg.train_only == "mtp"  # only the MTP layer trains
        self.eval_mtp_loss: float | None = None
        self.eval_mtp_agreement: float | None = None
        if self.frozen:
            self.model.requires_grad_(False)
        watched = (([] if self.frozen else list(self.model.model.layers))
                   + ([self.mtp.layer] if self.mtp is not None else []))
        self.router = (RouterLogits(self.model, watched) if (cfg.aux_loss_coef or cfg.z_loss_coef)
                       and any(layer.is_moe for layer in watched) else None)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]  # not V3's correction bias
        self.sharded = [p for n, p in named if ctx.ep_size > 1 and is_expert_param(n)]
        self.replicated = [p for n, p in named if not (ctx.ep_size > 1 and is_expert_param(n))]
        if self.mtp is not None:
            mine = [(MTP_NAME + n, p) for n, p in self.mtp.layer.named_parameters() if p.requires_grad]
            named += mine
            self.replicated += [p for _, p in mine]
        self.optimizer = build_optimizer(named, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        self.step, self.max_steps, self.elapsed, self.skipped_steps = 0, cfg.max_steps, 0.0, 0
        self.tokens_per_step = self.layout.global_batch * cfg.seq_len
        self.flops_per_token = self._flops_per_token()
        self.peak_flops = self._peak_flops()  # before the RNG state is restored, though it uses its own
        if source.resume_from is not None:
            self._restore(source.resume_from)
        self.schedule = CosineSchedule(cfg.lr, cfg.final_lr, cfg.warmup_steps, self.max_steps or UNSIZED)
        self.log = JsonlLog(cfg.out / "train_log.jsonl", ctx.is_main)
        self.heartbeat = Heartbeat(cfg.out, ctx.rank)
        self.resumed_from = source.resume_from

    # ---- setup -----------------------------------------------------------------------------------
    def _mtp_config(self, source: ModelSource) -> None:
        """config.json's num_nextn_predict_layers as the run saves it: --mtp-layers; without it, 0
        where the starting checkpoint has an MTP layer (which this run does not train, so it is not
        saved), else as it was."""
        raw, n = self.raw_config, self.cfg.mtp_layers
        if n:
            raw["num_nextn_predict_layers"] = n
        elif int(raw.get("num_nextn_predict_layers") or 0) and source.weights is not None:
            from models.checkpoint import CheckpointReader
            from models.mtp import mtp_prefix

            cfg = ModelConfig.from_dict(raw, source="config.json")
            if mtp_prefix(cfg) + "eh_proj.weight" in CheckpointReader.of(source.weights, cfg).files:
                log.warning("%s has an MTP layer, which this run does not train (no --mtp-layers 1): the model it "
                            "saves has none (num_nextn_predict_layers 0)", source.weights)
                raw["num_nextn_predict_layers"] = 0

    def _data(self) -> tuple[ShuffledLoader, list]:
        cfg, ctx, cache = self.cfg, self.ctx, self.cfg.out / "cache"
        if not self.model_cfg.eos_token_ids:
            raise ValueError("the model's config.json has no eos_token_id to separate documents with")
        eos = self.model_cfg.eos_token_ids[0]
        paths = [None, None]
        if ctx.is_main:  # one rank tokenizes; the others map the cached array
            paths = [tokenize_files(list(cfg.data), self.tokenizer_dir, eos, cache, cfg.text_field),
                     tokenize_files(list(cfg.eval_data), self.tokenizer_dir, eos, cache, cfg.text_field)
                     if cfg.eval_data else None]
        train_path, eval_path = broadcast_object(paths, ctx)
        train = PackedSamples(np.load(train_path, mmap_mode="r"), cfg.seq_len)
        loader = ShuffledLoader(train, self.layout, cfg.seed)
        evals = []
        if eval_path is not None:
            held_out = PackedSamples(np.load(eval_path, mmap_mode="r"), cfg.seq_len)
            evals = eval_batches(held_out, self.layout, cfg.eval_batches)
            if not evals:
                raise ValueError(f"--eval-data holds {len(held_out)} samples, fewer than one global batch "
                                 f"({self.layout.global_batch})")
        return loader, evals

    def _flops_per_token(self) -> float:
        """Training FLOPs per token: the model's forward and backward (forward only when frozen) plus
        the MTP layer's, its eh_proj and the LM head's further use, once per --mtp-depth."""
        f = train_flops_per_token(self.model_cfg, self.cfg.seq_len)
        if self.mtp is None:
            return f
        D, V = self.model_cfg.hidden_size, self.model_cfg.vocab_size
        extra = train_flops_per_token(self.mtp.cfg, self.cfg.seq_len) - f + 6.0 * (V * D + 2 * D * D)
        return (f / 3 if self.frozen else f) + self.cfg.mtp_depth * extra

    def _restore(self, checkpoint: Path) -> None:
        state = load_trainer_state(checkpoint, self.ctx)
        self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.step, self.max_steps, self.elapsed = state["step"], state["max_steps"], state["elapsed"]
        self.skipped_steps = state.get("skipped_steps", 0)
        if self.cfg.max_steps is not None and self.cfg.max_steps != self.max_steps:
            self.max_steps = self.cfg.max_steps  # a longer (or shorter) run from here: the cosine re-spans
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.ctx.device)

    def _peak_flops(self) -> float:
        """Sum over ranks of each one's matmul peak, measured at the same time (they share the host)."""
        if self.cfg.peak_tflops:
            return self.cfg.peak_tflops * 1e12
        self.ctx.barrier()
        dtype = torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32
        mine = measure_peak_flops(self.ctx.device, dtype)
        return sum(r[0] for r in all_gather_floats([mine], self.ctx))

    # ---- one step --------------------------------------------------------------------------------
    def autocast(self) -> torch.autocast:
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16")

    def losses(self, ids_BL: torch.Tensor, labels_BL: torch.Tensor) -> Losses:
        """Forward one micro-batch; the load-balancing loss uses the whole global batch's routing.
        With an MTP layer the total adds mtp_loss_weight times its cross entropy (of x_{t+2}, and over
        every --mtp-depth the token after its input's; with
        --mtp-distill against the model's own distribution for it); with --train-only mtp that is the
        whole total (the next-token loss is reported, not trained)."""
        cfg, mcfg = self.cfg, self.model_cfg
        if self.mtp is None:
            lm = lm_loss(forward_logits(self.model, ids_BL), labels_BL.reshape(-1))
            out = Losses(total=lm, lm=lm)
        else:
            logits, mtp_logits, mtp_labels = forward_mtp(self.model, self.mtp, ids_BL, labels_BL, cfg.mtp_depth)
            lm, mtp = lm_loss(logits, labels_BL.reshape(-1)), mtp_loss(mtp_logits, mtp_labels, 1.0)
            distill = (mtp_distill_loss(mtp_logits, next_position(logits, *ids_BL.shape, cfg.mtp_depth), mtp_labels)
                       if cfg.mtp_distill else None)
            weighted = cfg.mtp_loss_weight * (mtp if distill is None else distill)
            out = Losses(total=weighted if self.frozen else lm + weighted, lm=lm, mtp=mtp, mtp_distill=distill)
        if self.router is not None:
            router_logits = self.router.take()
            if cfg.aux_loss_coef:
                out.aux = load_balancing_loss(router_logits, mcfg.num_experts, mcfg.top_k, self._reduce_sum)
                out.total = out.total + cfg.aux_loss_coef * out.aux
            if cfg.z_loss_coef:
                out.z = router_z_loss(router_logits)
                out.total = out.total + cfg.z_loss_coef * out.z
        return out

    def _reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        with self.clock():
            return all_reduce_sum(t)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        """Forward/backward every micro-batch, reduce, clip, step. Returns the step's mean losses over
        the global batch, grad norm, lr and this rank's wall and work seconds. A step whose gradient
        norm is not finite (the same on every rank) leaves the weights and optimiser state as they
        were ("skipped": True); its data is consumed and the step counts, as in Megatron-LM."""
        t0, comm0 = time.perf_counter(), self.clock.seconds
        lr = self.schedule(self.step)
        set_lr(self.optimizer, lr)
        sums = torch.zeros(6, dtype=torch.float64, device=self.ctx.device)
        for ids_BL, labels_BL in micro_batches:
            ids_BL, labels_BL = ids_BL.to(self.ctx.device), labels_BL.to(self.ctx.device)
            with self.autocast():
                losses = self.losses(ids_BL, labels_BL)
            (losses.total / len(micro_batches)).backward()
            zero = torch.zeros((), device=self.ctx.device)
            sums += torch.stack([(zero if v is None else v.detach()).double()
                                 for v in (losses.total, losses.lm, losses.aux, losses.z, losses.mtp, losses.mtp_distill)])
        self._debug_delay()
        with self.clock():
            reduce_gradients(self.replicated, self.sharded, self.ctx)
            norm = clip_grad_norm_(self.replicated, self.sharded, self.cfg.grad_clip, self.ctx)
            sums = all_reduce_sum(sums) / (len(micro_batches) * self.ctx.world_size)
        skipped = not math.isfinite(norm)
        if skipped:
            self.skipped_steps += 1
            log.warning("step %d: gradient norm %s, the update is skipped (%d skipped so far)", self.step + 1, norm,
                        self.skipped_steps)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        seconds = time.perf_counter() - t0
        total, lm, aux, z, mtp, distill = sums.tolist()
        return {"loss": total, "lm_loss": lm, "aux_loss": aux if self.cfg.aux_loss_coef and self.router else None,
                "z_loss": z if self.cfg.z_loss_coef and self.router else None,
                "mtp_loss": mtp if self.mtp is not None else None,
                "mtp_distill_loss": distill if self.cfg.mtp_distill else None, "grad_norm": norm, "lr": lr, "seconds": seconds,
                "work_seconds": seconds - (self.clock.seconds - comm0), "skipped": skipped}

    def _debug_delay(self) -> None:
        if self.cfg.debug_delay and self.cfg.debug_delay[0] == self.ctx.rank:
            time.sleep(self.cfg.debug_delay[1])

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over the held-out batches (the same on every rank); with an MTP layer
        its mean held-out loss (of x_{t+2}) goes to self.eval_mtp_loss and how often its top token is
        the model's own (losses.mtp_agreement) to self.eval_mtp_agreement."""
        total = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for ids_BL, labels_BL in self.eval_set:
            ids_BL, labels_BL = ids_BL.to(self.ctx.device), labels_BL.to(self.ctx.device)
            with self.autocast():
                if self.mtp is None:
                    total[0] += float(lm_loss(forward_logits(self.model, ids_BL), labels_BL.reshape(-1)))
                else:
                    logits, mtp_logits, mtp_labels = forward_mtp(self.model, self.mtp, ids_BL, labels_BL)
                    total[0] += float(lm_loss(logits, labels_BL.reshape(-1)))
                    total[1] += float(mtp_loss(mtp_logits, mtp_labels, 1.0))
                    total[2] += float(mtp_agreement(mtp_logits, next_position(logits, *ids_BL.shape), mtp_labels))
            if self.router is not None:
                self.router.take()
        total = all_reduce_sum(total) / (len(self.eval_set) * self.ctx.world_size)
        self.eval_mtp_loss = float(total[1]) if self.mtp is not None else None
        self.eval_mtp_agreement = float(total[2]) if self.mtp is not None else None
        return float(total[0])

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to max_steps (or the time budget), checkpointing, logging and evaluating on the way;
        export the final model into OUT. Returns a summary (the same on every rank)."""
        cfg, ctx = self.cfg, self.ctx
        start, start_step = time.time(), self.step
        deadline = start + cfg.max_minutes * 60 - self.elapsed if cfg.max_minutes else None
        self.log.write(event="resume" if self.resumed_from else "start", step=self.step,
                       restart=ctx.restart_count, world_size=ctx.world_size, ep_size=ctx.ep_size,
                       peak_tflops=self.peak_flops / 1e12, flops_per_token=self.flops_per_token)
        if ctx.is_main:
            log.info("%s at step %d: %d ranks (expert parallel %d), %d tokens per step, %.3f GFLOP per token, "
                     "peak %.2f TFLOP/s", "resuming" if self.resumed_from else "starting", self.step, ctx.world_size,
                     ctx.ep_size, self.tokens_per_step, self.flops_per_token / 1e9, self.peak_flops / 1e12)
        bar = self._progress_bar()
        watch = (_HeartbeatWatch(self.heartbeat.dir, ctx.world_size, stale_s=cfg.collective_timeout_s / 5)
                 if ctx.is_main and ctx.distributed else None)
        window: list[dict] = []
        last_saved, eval_loss = None, None
        try:
            while self.max_steps is None or self.step < self.max_steps:
                stats = self.train_step(self.loader.next_step())
                self._record(stats, window, bar)
                if self.max_steps is None and self.step - start_step == CALIBRATION_STEPS:
                    self._size_schedule(window, deadline)
                if self.step % cfg.log_every == 0:
                    self._report(window)
                    window = []
                if cfg.eval_every and self.eval_set and self.step % cfg.eval_every == 0:
                    eval_loss = self._evaluate_and_log()
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save(start)
                    last_saved = self.step
                if deadline is not None and self._out_of_time(deadline):
                    log.info("time budget of %.1f minutes reached at step %d", cfg.max_minutes, self.step)
                    break
        finally:
            if bar is not None:
                bar.close()
            if watch is not None:
                watch.stop()
        if last_saved != self.step and self.step != start_step:  # (resumed at the end: already saved)
            self.save(start)
        if self.eval_set and (eval_loss is None or not cfg.eval_every or self.step % cfg.eval_every):
            eval_loss = self._evaluate_and_log()
        export_model(cfg.out, self.model, ctx, self.raw_config, self.tokenizer_dir, self.save_dtype, self._mtp_layer())
        summary = self._summary(start, start_step, eval_loss)
        self.log.write(event="done", **summary)
        return summary

    def _record(self, stats: dict, window: list[dict], bar: Any) -> None:
        stats["tokens_per_s"] = self.tokens_per_step / stats["seconds"]
        stats["mfu"] = stats["tokens_per_s"] * self.flops_per_token / self.peak_flops
        window.append(stats)
        self.heartbeat.beat(self.step, stats["seconds"])
        self.log.write(event="step", step=self.step, epoch=round(self.loader.epoch, 4), **stats)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tok_s=f"{stats['tokens_per_s']:.0f}",
                            mfu=f"{100 * stats['mfu']:.1f}%")

    def _report(self, window: list[dict]) -> None:
        """The log line of the last steps, and any straggler: a rank whose own work per step (step time
        minus time in collectives) exceeds the median over ranks by the set factor."""
        n = len(window)
        work = [w["work_seconds"] for w in window]
        per_rank = [r[0] for r in all_gather_floats([sum(work) / n], self.ctx)]
        if not self.ctx.is_main:
            return
        mean = {k: sum(w[k] for w in window) / n for k in ("loss", "lm_loss", "tokens_per_s", "mfu", "grad_norm")}
        mtp = "" if self.mtp is None else f", mtp {sum(w['mtp_loss'] for w in window) / n:.4f}"
        if self.cfg.mtp_distill:
            mtp += f", mtp distill {sum(w['mtp_distill_loss'] for w in window) / n:.4f}"
        log.info("step %d/%s loss %.4f (lm %.4f%s) lr %.2e grad_norm %.3f | %.0f tokens/s, MFU %.2f%%", self.step,
                 self.max_steps or "?", mean["loss"], mean["lm_loss"], mtp, window[-1]["lr"], mean["grad_norm"],
                 mean["tokens_per_s"], 100 * mean["mfu"])
        median = statistics.median(per_rank)
        for r in find_stragglers(per_rank, self.cfg.straggler_factor):
            log.warning("straggler: rank %d works %.3f s per step, %.1fx the median %.3f s (steps %d-%d)", r,
                        per_rank[r], per_rank[r] / median, median, self.step - n + 1, self.step)
            self.log.write(event="straggler", step=self.step, rank=r, work_seconds=per_rank[r], median=median)

    def _size_schedule(self, window: list[dict], deadline: float | None) -> None:
        """--max-minutes alone: the steps that fit the remaining time at the measured step time (rank
        0's estimate, shared), so the cosine ends with the budget."""
        timed = window[1:] or window
        per_step = sum(w["seconds"] for w in timed) / len(timed)
        steps = self.step + int(max(0.0, deadline - time.time()) / per_step)
        self.max_steps = max(self.step + 1, broadcast_object(steps, self.ctx))
        self.schedule = CosineSchedule(self.cfg.lr, self.cfg.final_lr, self.cfg.warmup_steps, self.max_steps)
        log.info("%.2f s per step: the schedule spans %d steps", per_step, self.max_steps)

    def _out_of_time(self, deadline: float) -> bool:
        late = torch.tensor([1.0 if time.time() >= deadline else 0.0], device=self.ctx.device)
        return bool(all_reduce_sum(late) > 0)  # every rank stops at the same step

    def _evaluate_and_log(self) -> float:
        loss = self.evaluate()
        mtp = ({} if self.mtp is None else
               {"eval_mtp_loss": self.eval_mtp_loss, "eval_mtp_agreement": self.eval_mtp_agreement})
        self.log.write(event="eval", step=self.step, eval_loss=loss, **mtp)
        if self.ctx.is_main:
            log.info("step %d: held-out loss %.4f%s", self.step, loss,
                     f" (MTP layer {self.eval_mtp_loss:.4f}, top token the model's {self.eval_mtp_agreement:.1%})"
                     if mtp else "")
        return loss

    def _mtp_layer(self):
        return None if self.mtp is None else self.mtp.layer

    def save(self, start: float) -> None:
        """Checkpoint (collective): the model files plus this rank's optimiser, schedule, RNG and data
        state; `start` is when this process's run began (for the total training time)."""
        elapsed = self.elapsed + time.time() - start
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
               "cuda": torch.cuda.get_rng_state(self.ctx.device) if self.ctx.device.type == "cuda" else None}
        state = {"optimizer": self.optimizer.state_dict(), "loader": self.loader.state_dict(), "step": self.step,
                 "max_steps": self.max_steps, "schedule": self.schedule.state_dict(), "rng": rng, "elapsed": elapsed,
                 "skipped_steps": self.skipped_steps}
        meta = {"step": self.step, "world_size": self.ctx.world_size, "ep_size": self.ctx.ep_size,
                "samples_seen": self.loader.position, "tokens_seen": self.loader.position * self.cfg.seq_len,
                "time": time.time(), "train_config": asdict(self.cfg)}
        path = save_checkpoint(self.cfg.out, self.step, self.model, self.ctx, self.raw_config, self.tokenizer_dir,
                               self.save_dtype, state, meta, self.cfg.keep_checkpoints, self._mtp_layer())
        self.log.write(event="checkpoint", step=self.step, path=str(path))

    def _summary(self, start: float, start_step: int, eval_loss: float | None) -> dict[str, Any]:
        seconds = time.time() - start
        steps = self.step - start_step
        summary = {"rank": self.ctx.rank, "world_size": self.ctx.world_size, "tokens_per_step": self.tokens_per_step,
                   "step": self.step, "steps_this_run": steps, "seconds_this_run": seconds,
                   "train_seconds_total": self.elapsed + seconds, "tokens_seen": self.loader.position * self.cfg.seq_len,
                   "tokens_per_s": steps * self.tokens_per_step / seconds if steps else None,
                   "eval_loss": eval_loss, "eval_mtp_loss": self.eval_mtp_loss,
                   "eval_mtp_agreement": self.eval_mtp_agreement,
                   "peak_tflops": self.peak_flops / 1e12,
                   "skipped_steps": self.skipped_steps}
        if summary["tokens_per_s"]:
            summary["mfu"] = summary["tokens_per_s"] * self.flops_per_token / self.peak_flops
        return summary

    def _progress_bar(self) -> Any:
        if not (self.cfg.progress and self.ctx.is_main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.max_steps, initial=self.step, unit="step", dynamic_ncols=True)


class _HeartbeatWatch:
    """Rank 0's watcher thread: warns when a rank's heartbeat file goes stale (a hung or dead rank),
    even while rank 0 itself waits in a collective for it."""

    def __init__(self, directory: Path, world_size: int, stale_s: float, period_s: float = 10.0):
        self.dir, self.world, self.stale_s, self.period_s = directory, world_size, stale_s, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        warned: set[int] = set()
        while not self._stop.wait(self.period_s):
            now = time.time()
            for r in range(self.world):
                try:
                    beat = json.loads((self.dir / f"rank-{r}.json").read_text())
                except (OSError, ValueError):
                    continue
                if now - beat["time"] > self.stale_s and r not in warned:
                    log.warning("rank %d (pid %d) has not finished a step for %.0f s (last: step %d)", r,
                                beat["pid"], now - beat["time"], beat["step"])
                    warned.add(r)
                elif now - beat["time"] <= self.stale_s:
                    warned.discard(r)

    def stop(self) -> None:
        self._stop.set()


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (this rank's share of) a training job; returns its summary."""
    source = model_source(cfg)
    num_experts = ModelConfig.from_dict(source.raw_config, source="config.json").num_experts
    ctx = init_distributed(cfg.device, cfg.expert_parallel, num_experts, cfg.collective_timeout_s)
    try:
        return Trainer(cfg, ctx, source).run()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

