"""Performance models: the times the simulator and the plan search ask for, from a measured profile
(ProfilePerf) or from a catalogue device's spec sheet (RooflinePerf, an estimate).

All times are seconds. Per layer and micro-batch: `attention(tokens, kv_reads, prefill_tokens,
kv_prefill, eager, mixed)` on an attention worker (kv_reads: context tokens read, summed over the
micro-batch's query tokens; prefill_tokens and kv_prefill: the same over its prefilling sequences;
eager: 1 in a step with prompt tokens, which runs layer by layer; mixed: 1 where the micro-batch has
both kinds of rows: planner.profile.prefill_features), `experts(pairs,
active)` on an expert worker (pairs: gathered (token, expert) pairs; active: its experts receiving
at least one); per colocated step, `colocated(tokens, kv_reads, ..., active)` where whole steps were
measured (None otherwise). Per micro-batch and step: `head(rows, tokens)` (embedding, final norm, LM head on
the sampled rows). Per step: `step(seqs, prefill_tokens)` (scheduling, sampling, control messages) and, with
speculative method mtp, `mtp(rows, passes, prefill_tokens)` (the MTP layer's passes after it). Per message:
`transfer(nbytes, backend)`, `send(nbytes, backend)` (the sender's own CPU per message) and
`wake(backend)` (what a message adds when its receiver's wait has blocked, how long a wait polls
before it blocks). Per step, on a shared host: `front(tokens, messages)`, the CPU seconds that the
front process and the load generator spend on the step's output tokens and on the attention
workers' delta messages (one per worker that sampled; they share the cores).
Arguments may be numpy arrays (vectorised over workers).
"""
import copy
from dataclasses import dataclass

import numpy as np

from planner.fit import Fit
from planner.hardware import Efficiency, HardwareKind
from planner.shapes import ModelShape


NO_MTP_SAMPLES = ("the profile has no MTP drafting samples: run shuttle profile on a checkpoint with MTP layers "
                  "(num_nextn_predict_layers) to plan speculative method mtp")


class ProfilePerf:
    """Times from `shuttle profile` fits. Thread counts that were not profiled use the nearest
    profiled one, scaled by (profiled / wanted) threads (ideal scaling: an assumption, stated)."""

    estimated = False

    def __init__(self, profile: dict):
        self.profile = profile
        self.fits = {int(t): {k: Fit.from_dict(f) for k, f in fits.items()} for t, fits in profile["fits"].items()}
        self.transfers = {b: Fit.from_dict(f) for b, f in profile["transfer"].items()}
        # (wake-up seconds, spin seconds) per backend; profiles without them: no wake-up cost
        self.wakes = {b: (float(f.get("wake_s", 0.0)), float(f.get("spin_s", 0.0)))
                      for b, f in profile["transfer"].items()}
        self.sends = {b: Fit.from_dict(f["send"]) for b, f in profile["transfer"].items() if "send" in f}
        self.served_factor = float(profile.get("served_factor", 1.0))  # see planner.calibrate.served_factor
        self.served_factors = [tuple(map(float, p)) for p in profile.get("served_factors") or []]  # ... and _factors
        # the front's CPU as served beside deployments that take every core (planner.calibrate.front_scales)
        self.front_scales = list(profile.get("front_scales") or [])
        fr = profile.get("front") or {}  # profiles without it (older, or --no-front): no front work
        self.front_s_per_token = fr.get("front_s_per_token", 0.0) + fr.get("client_s_per_token", 0.0)
        # Per request (older profiles: none, all of it per token): parsing, tokenizing and admitting
        # a request in the front, building and sending it in the load generator; one at a time.
        self.front_s_per_request = fr.get("front_s_per_request", 0.0) + fr.get("client_s_per_request", 0.0)
        # Per delta message, whatever it carries (older profiles: none, all of it per token).
        self.front_s_per_step = fr.get("front_s_per_step", 0.0) + fr.get("client_s_per_step", 0.0)

    def for_pools(self) -> "ProfilePerf":
        """The costs as the worker pools of one host run them: with OpenMP's passive waits
        (pools/launchers.py), measured at 2 and more threads (profile["fits_passive"]); one thread
        is the same either way. Profiles without them (older ones): unchanged."""
        passive = self.profile.get("fits_passive") or {}
        if not passive:
            return self
        view = copy.copy(self)
        view.fits = dict(self.fits)  # (the passive fits replace their kinds; colocated-only kinds stay)
        for t, fits in passive.items():
            view.fits[int(t)] = {**self.fits.get(int(t), {}), **{k: Fit.from_dict(f) for k, f in fits.items()}}
        return view

    def with_front_scale(self, scale: float) -> "ProfilePerf":
        """This profile with the front's and the load generator's CPU times `scale` (front_scales)."""
        view = copy.copy(self)
        view.front_s_per_token = scale * self.front_s_per_token
        view.front_s_per_request = scale * self.front_s_per_request
        view.front_s_per_step = scale * self.front_s_per_step
        return view

    def _fit(self, name: str, threads: int) -> tuple[Fit | None, float]:
        """The fit of the nearest profiled thread count (None if it has no such fit) and its scale."""
        t = min(self.fits, key=lambda k: (abs(k - threads), -k))
        return self.fits[t].get(name), t / threads if t != threads else 1.0

    def attention(self, tokens, kv_reads, threads: int = 1, prefill_tokens=0, kv_prefill=0, eager=0, mixed=0):
        f, s = self._fit("attention", threads)
        # Profiles from before the prefill (or eager and mixed) terms have fits without them (Fit reads
        # only its terms).
        t = f(tokens=tokens, kv_reads=kv_reads, prefill_tokens=prefill_tokens, kv_prefill=kv_prefill, eager=eager,
              mixed=mixed)
        return np.where(np.asarray(tokens) > 0, t * s, 0.0)

    def head(self, rows, tokens, threads: int = 1):
        f, s = self._fit("head", threads)
        return np.where(np.asarray(tokens) > 0, f(rows=rows, tokens=tokens) * s, 0.0)

    def step(self, seqs, threads: int = 1, prefill_tokens=0, verify_rows=0):
        """The step's own work; a step that verifies drafts (verify_rows > 0: the verified sequences'
        rows) from the speculative steps' fit where the profile has one (measure_mtp)."""
        f, s = self._fit("step", threads)
        t = f(seqs=seqs, prefill_tokens=prefill_tokens)
        spec, _ = self._fit("spec_step", threads)
        if spec is not None:
            t = np.where(np.asarray(verify_rows) > 0, spec(seqs=seqs, verify_rows=verify_rows), t)
        return t * s

    def experts(self, pairs, active, threads: int = 1):
        f, s = self._fit("experts", threads)
        return np.where(np.asarray(pairs) > 0, f(pairs=pairs, active=active) * s, 0.0)

    def colocated(self, tokens, kv_reads, threads: int = 1, prefill_tokens=0, kv_prefill=0, active=0, eager=0,
                  mixed=0):
        """A colocated step's compute (every layer, its experts and the head) from whole steps
        measured as such (planner.profile.measure_colocated); None for profiles without them (then
        the parts' fits and native_decode_saving apply)."""
        f, s = self._fit("colocated", threads)
        if f is None:
            return None
        t = f(tokens=tokens, kv_reads=kv_reads, prefill_tokens=prefill_tokens, kv_prefill=kv_prefill, active=active,
              eager=eager, mixed=mixed)
        return np.where(np.asarray(tokens) > 0, t * s, 0.0)

    def prompts_as_rows(self) -> bool:
        """Whether the profiled engine computes short prompt chunks as one-token rows in its native
        decode step (ModelRunner.prompts_as_rows): the model has that step (native_decode samples), and
        the profile timed such steps (its fits have the `eager` term: older profiles timed every prompt
        eagerly)."""
        return any("native_decode" in fits for fits in self.fits.values()) and any(
            "eager" in f.terms for fits in self.fits.values() for f in fits.values())

    def native_decode_saving(self, tokens, threads: int = 1):
        """What a colocated decode-only step of `tokens` sequences saves by running whole in one
        native call instead of as the attention and expert fits time it
        (planner.profile.measure_native_decode); 0 where the profile has no such fit (the model does
        not take it, or an older profile)."""
        f, s = self._fit("native_decode", threads)
        return 0.0 * np.asarray(tokens, dtype=float) if f is None else f(tokens=np.asarray(tokens, dtype=float)) * s

    def mtp(self, rows, passes, prefill_tokens=0, threads: int = 1):
        """The MTP layer's passes after a step (planner.profile_mtp.measure_mtp): `passes` of them over
        `rows` one-token rows in all, plus `prefill_tokens` rows of prompt chunks."""
        f, s = self._fit("mtp", threads)
        if f is None:
            raise ValueError(NO_MTP_SAMPLES)
        return f(rows=rows, passes=passes, prefill_tokens=prefill_tokens) * s

    def front(self, tokens, messages=1):
        """The front's and the load generator's CPU seconds for a step's output tokens, which came
        in `messages` delta messages (one per attention worker that sampled)."""
        return self.front_s_per_token * np.asarray(tokens, dtype=float) + self.front_s_per_step * np.asarray(messages)

    def front_request(self) -> float:
        """CPU seconds the front and the load generator spend on one request, before the engine has it."""
        return self.front_s_per_request

    def send(self, nbytes, backend: str = "shm"):
        """The sender's own CPU per message (packing, copying into the slot); 0 if not profiled."""
        f = self.sends.get(backend)
        return np.where(np.asarray(nbytes) > 0, f(bytes=nbytes), 0.0) if f else 0.0 * np.asarray(nbytes, dtype=float)

    def wake(self, backend: str = "shm") -> tuple[float, float]:
        """(seconds a message adds when its receiver's wait has blocked, seconds a wait polls first)."""
        return self.wakes.get(backend, (0.0, 0.0))

    def transfer(self, nbytes, backend: str = "shm"):
        if backend not in self.transfers:
            raise ValueError(f"the profile has no M2N measurement for {backend!r} (it has "
                             f"{', '.join(self.transfers) or 'none'}); run shuttle profile --transport {backend}")
        return self.transfers[backend](bytes=nbytes)


@dataclass
class RooflinePerf:
    """Estimated times on catalogue devices: each op takes max(FLOPs / (peak x eff), bytes /
    (bandwidth x eff)) plus a fixed per-layer overhead; a transfer takes bytes / (NIC x eff) plus a
    message latency. Attention reads the layer's non-expert weights once per micro-batch and the
    KV cache of every context token it attends to; experts read each active expert's weights once.
    Sizes and FLOPs are ModelConfig's (models/config.py), in the checkpoint's dtype, the experts'
    bytes in `quantization` (EngineConfig.quantization; their FLOPs are the same); a layer's
    attention side is the model's average over its layers (dense MLPs, routers and shared experts
    included), so that L layers add up to the whole model."""

    shape: ModelShape
    attention_hw: HardwareKind
    expert_hw: HardwareKind
    eff: Efficiency
    quantization: str | None = None
    estimated = True

    def _roof(self, hw: HardwareKind, flops, nbytes):
        return np.maximum(flops / (hw.bf16_tflops * 1e12 * self.eff.flops),
                          nbytes / (hw.memory_bandwidth_gbs * 1e9 * self.eff.memory_bandwidth))

    def attention(self, tokens, kv_reads, threads: int = 1, prefill_tokens=0, kv_prefill=0, eager=0, mixed=0):
        """(prefill_tokens, kv_prefill, eager and mixed: a measured profile's; the roofline counts all
        reads alike.)"""
        c = self.shape.config
        L, itemsize = c.num_layers, c.dtype.itemsize
        tokens, kv_reads = np.asarray(tokens, dtype=float), np.asarray(kv_reads, dtype=float)
        per_layer_w = (c.non_expert_bytes(c.dtype) - c.embedding_params() * itemsize) / L
        full = (L - c.num_linear_layers) / L  # layers that read a KV cache (linear ones read and write a state)
        flops = tokens * c.non_expert_flops_per_token() / L + kv_reads * full * c.context_flops()
        nbytes = (per_layer_w + kv_reads * c.kv_bytes_per_token(c.dtype) / L
                  + tokens * 2 * c.state_bytes_per_sequence(c.dtype) / L)
        t = self._roof(self.attention_hw, flops, nbytes) + self.eff.layer_overhead_us * 1e-6
        return np.where(tokens > 0, t, 0.0)

    def head(self, rows, tokens, threads: int = 1):
        c = self.shape.config
        rows = np.asarray(rows, dtype=float)
        t = self._roof(self.attention_hw, rows * 2.0 * c.hidden_size * c.vocab_size,
                       c.hidden_size * c.vocab_size * c.dtype.itemsize) + self.eff.layer_overhead_us * 1e-6
        return np.where(np.asarray(tokens) > 0, t, 0.0)

    def step(self, seqs, threads: int = 1, prefill_tokens=0, verify_rows=0):
        return self.eff.step_overhead_us * 1e-6 + 0.0 * np.asarray(seqs, dtype=float)

    def prompts_as_rows(self) -> bool:
        """(A CPU engine's native step; a catalogue device computes prompts as chunks.)"""
        return False

    def colocated(self, tokens, kv_reads, threads: int = 1, prefill_tokens=0, kv_prefill=0, active=0, eager=0,
                  mixed=0):
        """(A CPU engine's measurement; none for a catalogue device: its parts apply.)"""
        return None

    def native_decode_saving(self, tokens, threads: int = 1):
        """(A CPU engine's measurement; none for a catalogue device.)"""
        return 0.0 * np.asarray(tokens, dtype=float)

    def experts(self, pairs, active, threads: int = 1):
        c = self.shape.config
        pairs, active = np.asarray(pairs, dtype=float), np.asarray(active, dtype=float)
        nbytes = active * c.expert_bytes(c.dtype, self.quantization)
        t = self._roof(self.expert_hw, pairs * c.expert_flops_per_pair(), nbytes)
        return np.where(pairs > 0, t + self.eff.layer_overhead_us * 1e-6, 0.0)

    def front_request(self) -> float:
        """Not in the catalogue: no per-request cost."""
        return 0.0

    def front(self, tokens, messages=1):
        """The front runs on its own host here: it takes no core from the workers."""
        return 0.0 * np.asarray(tokens, dtype=float)

    def send(self, nbytes, backend: str = "rdma"):
        """One-sided writes by the NIC: no sender CPU modelled."""
        return 0.0 * np.asarray(nbytes, dtype=float)

    def wake(self, backend: str = "rdma") -> tuple[float, float]:
        """Waits on accelerators poll (no wake-up cost)."""
        return 0.0, float("inf")

    def transfer(self, nbytes, backend: str = "rdma"):
        nic = min(self.attention_hw.nic_gbps, self.expert_hw.nic_gbps) * 1e9 / 8 * self.eff.network
        return np.asarray(nbytes, dtype=float) / nic + self.eff.message_latency_us * 1e-6


def expected_active(tokens, local_experts, num_experts: int, top_k: int):
    """Expected experts among `local_experts` that receive at least one of `tokens` tokens, each
    routed to top_k distinct experts uniformly at random."""
    miss = (1.0 - top_k / num_experts) ** np.asarray(tokens, dtype=float)
    return np.asarray(local_experts, dtype=float) * (1.0 - miss)
