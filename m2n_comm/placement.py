"""Expert placement tables: which expert workers hold which (MoE layer, expert); M2N routes by them.
How a placement is chosen (the greedy, EPLB) is pools/eplb.py.

Legend: E experts per MoE layer, W expert workers, R redundant copies per layer (E + R copies in
all per layer), L MoE layers.

- `Placement`: one layer's map, copies[e] = the workers holding expert e (a hot expert may have
  several copies: the attention side splits its tokens between them by token index, in proportion
  to `shares[e]` when the placement has shares: EPLB gives a slow worker's copies smaller shares).
- `ExpertPlacement`: a versioned Placement per MoE layer, what attention and expert workers act on.
  Version 0 is the placement the deployment starts with; every re-placement (EPLB, failover)
  publishes version + 1, and the M2N headers carry the version a chunk was routed with.
  `down`: expert workers out of service (failover: a dead worker whose experts all have copies
  elsewhere); they hold nothing and attention workers do not reach them at all.
- Slots: each worker holds (E + R) // W copies per layer, the first (E + R) % W workers one more
  (the memory each worker has for experts, fixed at start).
"""
import json
from dataclasses import dataclass
from pathlib import Path

MAX_SHARE = 8  # the largest weight of one copy in splitting an expert's tokens (Placement.shares)


@dataclass(frozen=True)
class Placement:
    """Which expert workers hold which experts of one layer. copies[e]: the workers holding expert e
    (a hot expert may have several; the attention side splits its tokens between them by token index)."""

    num_experts: int
    num_workers: int
    copies: tuple[tuple[int, ...], ...]
    down: tuple[int, ...] = ()  # workers out of service (failover): they hold nothing
    # shares[e][i]: the weight of copy copies[e][i] in splitting expert e's tokens (ints in
    # [0, MAX_SHARE], at least one positive: a copy with 0 is held but gets no tokens); None: equal.
    shares: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.copies) != self.num_experts:
            raise ValueError(f"placement lists {len(self.copies)} experts, the model has {self.num_experts}")
        for e, ws in enumerate(self.copies):
            if not ws or len(set(ws)) != len(ws) or not all(0 <= w < self.num_workers for w in ws):
                raise ValueError(f"placement of expert {e}: workers {list(ws)} must be distinct and in "
                                 f"[0, {self.num_workers})")
        if self.shares is not None:
            if len(self.shares) != self.num_experts or any(len(s) != len(ws) for s, ws in zip(self.shares, self.copies)):
                raise ValueError("placement shares must give one weight per copy of every expert")
            if not all(isinstance(x, int) and 0 <= x <= MAX_SHARE for s in self.shares for x in s) or \
                    not all(any(s) for s in self.shares):
                raise ValueError(f"placement shares must be integers in [0, {MAX_SHARE}], one positive per expert")
        for w in range(self.num_workers):
            if w in self.down and self.experts_on(w):
                raise ValueError(f"placement puts experts {self.experts_on(w)} on expert worker {w}, which is down")
            if w not in self.down and not self.experts_on(w):
                raise ValueError(f"placement leaves expert worker {w} without experts")

    @classmethod
    def balanced(cls, num_experts: int, num_workers: int, replicas: dict[int, int] | None = None) -> "Placement":
        """Contiguous blocks of experts per worker; replicas[e] = c places c copies of expert e on
        consecutive workers starting at its home."""
        if not 1 <= num_workers <= num_experts:
            raise ValueError(f"{num_workers} expert workers for {num_experts} experts: need 1 <= workers <= experts")
        copies = []
        for e in range(num_experts):
            home, c = e * num_workers // num_experts, (replicas or {}).get(e, 1)
            if not 1 <= c <= num_workers:
                raise ValueError(f"expert {e}: {c} copies, need 1 to {num_workers}")
            copies.append(tuple((home + j) % num_workers for j in range(c)))
        return cls(num_experts, num_workers, tuple(copies))

    @classmethod
    def from_file(cls, path: str | Path, num_experts: int, num_workers: int) -> "Placement":
        """JSON {"expert id": [worker, ...], ...}; experts not listed are placed as in `balanced`."""
        raw = json.loads(Path(path).read_text())
        base = cls.balanced(num_experts, num_workers).copies
        try:
            copies = tuple(tuple(int(w) for w in raw.get(str(e), base[e])) for e in range(num_experts))
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{path}: expected {{\"expert\": [workers]}}: {err}") from None
        return cls(num_experts, num_workers, copies)

    def without(self, workers: set[int]) -> "Placement":
        """This placement with `workers` down (their copies dropped); ValueError naming an expert
        that would have no copy left."""
        down = set(self.down) | set(workers)
        copies = tuple(tuple(w for w in ws if w not in down) for ws in self.copies)
        lost = [e for e, ws in enumerate(copies) if not ws]
        if lost:
            raise ValueError(f"experts {lost} have no copy outside expert workers {sorted(down)}")
        shares = None if self.shares is None else tuple(
            tuple(x for w, x in zip(ws, s) if w not in down) for ws, s in zip(self.copies, self.shares))
        if shares is not None:  # copies that got no tokens take them when the others are gone
            shares = tuple(s if any(s) else (1,) * len(s) for s in shares)
        return Placement(self.num_experts, self.num_workers, copies, tuple(sorted(down)), shares)

    def shares_of(self, e: int) -> tuple[int, ...]:
        """The weights of expert e's copies in splitting its tokens (1 each without shares)."""
        return self.shares[e] if self.shares is not None else (1,) * len(self.copies[e])

    def experts_on(self, worker: int) -> list[int]:
        """Global ids of the experts on `worker`, ascending (local id = position in this list)."""
        return [e for e, ws in enumerate(self.copies) if worker in ws]

    def worker_loads(self, load_E: list[float]) -> list[float]:
        """Tokens each worker computes when expert e gets load_E[e] tokens split over its copies by
        their shares."""
        out = [0.0] * self.num_workers
        for e, ws in enumerate(self.copies):
            shares = self.shares_of(e)
            for w, x in zip(ws, shares):
                out[w] += load_E[e] * x / sum(shares)
        return out


@dataclass(frozen=True)
class ExpertPlacement:
    """A versioned placement of every MoE layer: layers[i] is the Placement of MoE layer moe_layers[i]."""

    moe_layers: tuple[int, ...]
    layers: tuple[Placement, ...]
    version: int = 0

    def __post_init__(self) -> None:
        if len(self.moe_layers) != len(self.layers) or not self.layers:
            raise ValueError(f"placement of {len(self.layers)} layers for MoE layers {list(self.moe_layers)}")
        shapes = {(p.num_experts, p.num_workers) for p in self.layers}
        if len(shapes) != 1:
            raise ValueError(f"every layer's placement must have the same experts and workers, got {sorted(shapes)}")
        if len({p.down for p in self.layers}) != 1:
            raise ValueError("every layer's placement must have the same expert workers down")

    @classmethod
    def uniform(cls, placement: Placement, moe_layers: list[int] | tuple[int, ...],
                version: int = 0) -> "ExpertPlacement":
        """The same map in every MoE layer (what --placement FILE and the default give)."""
        return cls(tuple(moe_layers), (placement,) * len(moe_layers), version)

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    @property
    def num_workers(self) -> int:
        return self.layers[0].num_workers

    def of(self, layer: int) -> Placement:
        """The placement of MoE layer `layer` (a model layer index)."""
        return self.layers[self.moe_layers.index(layer)]

    def experts_on(self, worker: int) -> dict[int, list[int]]:
        """{MoE layer: global ids of the experts `worker` holds there, ascending}."""
        return {layer: p.experts_on(worker) for layer, p in zip(self.moe_layers, self.layers)}

    @property
    def down(self) -> tuple[int, ...]:
        """Expert workers out of service (failover), ascending."""
        return self.layers[0].down

    def covers_without(self, workers: set[int]) -> bool:
        """True when every expert of every layer has a copy outside `workers` and the workers
        already down: they can fail without a restart (failover)."""
        out = set(self.down) | set(workers)
        return all(any(w not in out for w in ws) for p in self.layers for ws in p.copies)

    def without(self, workers: set[int], version: int) -> "ExpertPlacement":
        """Every layer without `workers` (failover), as `version`."""
        return ExpertPlacement(self.moe_layers, tuple(p.without(workers) for p in self.layers), version)

    def copies_per_layer(self) -> int:
        """Expert copies per layer, the most over layers (E + R under EPLB)."""
        return max(sum(len(ws) for ws in p.copies) for p in self.layers)

    def to_json(self) -> str:
        d = {"version": self.version, "moe_layers": list(self.moe_layers),
             "copies": [[list(ws) for ws in p.copies] for p in self.layers], "down": list(self.down)}
        if any(p.shares is not None for p in self.layers):
            d["shares"] = [[list(p.shares_of(e)) for e in range(p.num_experts)] for p in self.layers]
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes, num_workers: int) -> "ExpertPlacement":
        d = json.loads(text)
        down = tuple(d.get("down", ()))
        shares = d.get("shares") or [None] * len(d["copies"])
        layers = tuple(Placement(len(c), num_workers, tuple(tuple(ws) for ws in c), down,
                                 None if s is None else tuple(tuple(x) for x in s))
                       for c, s in zip(d["copies"], shares))
        return cls(tuple(d["moe_layers"]), layers, d["version"])


def worker_slots(num_experts: int, num_workers: int, num_redundant: int) -> list[int]:
    """Copies each worker holds per layer: E + R spread as evenly as the division allows."""
    n = num_experts + num_redundant
    return [n // num_workers + (w < n % num_workers) for w in range(num_workers)]


def check_redundancy(num_experts: int, num_workers: int, num_redundant: int) -> None:
    """ValueError unless R extra copies per layer fit: 0 <= R, every worker gets a copy, and no
    expert needs more copies than there are workers."""
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    if num_workers > num_experts + num_redundant:
        raise ValueError(f"{num_workers} expert workers for {num_experts} experts + {num_redundant} redundant copies: "
                         "every expert worker needs at least one copy")
    if num_redundant > num_experts * (num_workers - 1):
        raise ValueError(f"num_redundant_experts={num_redundant}: with {num_workers} expert workers each of the "
                         f"{num_experts} experts has at most {num_workers} copies, so at most "
                         f"{num_experts * (num_workers - 1)} extra")
