"""Hardware kinds: the catalogue of devices we cannot measure here, and a description of this host.

    kinds = parse_hardware("H20,L40S=2.1")      # catalogue kinds, prices overridden where given
    describe_host()                             # {"cpu": "AMD EPYC ...", "cores": 2, ...}

The catalogue (planner/hardware.json) holds public spec-sheet numbers; performance models built on
it (planner.perf.RooflinePerf) are estimates, and every output that uses one says "estimated".
The special kind "host" is this machine, modelled by a measured profile (`shuttle profile`).
"""
import json
import os
import platform
from dataclasses import dataclass, replace
from pathlib import Path

import torch

CATALOGUE = Path(__file__).parent / "hardware.json"
HOST = "host"


class HardwareError(ValueError):
    """An unknown hardware kind or a bad price; the message lists the known kinds."""


@dataclass(frozen=True)
class Efficiency:
    """Shares of peak that real kernels reach, and fixed costs, for catalogue roofline models."""

    flops: float
    memory_bandwidth: float
    network: float
    layer_overhead_us: float  # per layer and micro-batch on a device (kernel launches, syncs)
    message_latency_us: float  # per M2N message, on top of bytes over the NIC
    step_overhead_us: float  # per engine step (scheduling, sampling, control messages)


@dataclass(frozen=True)
class HardwareKind:
    """One device kind. Bandwidths: GB/s (10^9 bytes); NIC: Gbit/s; FLOP/s: 10^12 (dense bf16).
    device: "cuda" (a GPU) or "cpu" (a CPU server; the only kind that serves int8 experts)."""

    name: str
    memory_gib: float
    memory_bandwidth_gbs: float
    bf16_tflops: float
    interconnect_gbs: float
    nic_gbps: float
    price_per_hour: float
    source: str = ""
    device: str = "cuda"  # what shuttle serve runs a worker of this kind on: "cuda" or "cpu"

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2 ** 30


def load_catalogue(path: str | Path = CATALOGUE) -> tuple[dict[str, HardwareKind], Efficiency]:
    raw = json.loads(Path(path).read_text())
    kinds = {name: HardwareKind(name=name, **spec) for name, spec in raw["kinds"].items()}
    return kinds, Efficiency(**raw["efficiency"])


def parse_hardware(spec: str, host_price: float | None = None) -> list[HardwareKind]:
    """'KIND[=PRICE][,KIND...]' -> kinds, in order. 'host' is this machine (its price: host_price,
    default 1.0 per hour, or the one given). Raises HardwareError naming an unknown kind."""
    kinds, _ = load_catalogue()
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, price = part.partition("=")
        if name == HOST:
            kind = host_kind(host_price if host_price is not None else 1.0)
        elif name in kinds:
            kind = kinds[name]
        else:
            raise HardwareError(f"unknown hardware kind {name!r}; known: {HOST} (this machine, from a profile), "
                                f"{', '.join(kinds)} (catalogue {CATALOGUE})")
        if price:
            try:
                value = float(price)
            except ValueError:
                raise HardwareError(f"hardware {part!r}: price {price!r} is not a number") from None
            if not value > 0:
                raise HardwareError(f"hardware {part!r}: price must be positive")
            kind = replace(kind, price_per_hour=value)
        out.append(kind)
    if not out:
        raise HardwareError("--hardware names no kind")
    return out


def host_kind(price_per_hour: float = 1.0) -> HardwareKind:
    """This machine as a kind: one device is one core (a worker process with one torch thread)."""
    info = describe_host()
    return HardwareKind(HOST, info["memory_gib"], 0.0, 0.0, 0.0, 0.0, price_per_hour, info["cpu"], "cpu")


def parse_cpuinfo(text: str) -> tuple[str, str, set[str]]:
    """(model name, "family F model M stepping S", flags) of the first CPU in a /proc/cpuinfo text;
    "" and an empty set for what it lacks (an ARM cpuinfo has no model name, family or flags)."""
    name, ident, flags = "", {}, None
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name" and not name:
            name = value
        elif key in ("cpu family", "model", "stepping") and key not in ident:
            ident[key] = value
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return name, " ".join(f"{k.removeprefix('cpu ')} {v}" for k, v in ident.items()), flags or set()


def describe_host() -> dict:
    """CPU model, cores usable by this process, hardware threads, memory, accelerator, and which
    dtypes oneDNN can pack here (bf16 only with AVX-512-BF16 or AMX). `cpu_id` is the CPU's family,
    model and stepping: under a hypervisor that names every CPU "AMD EPYC" it is what tells hosts
    apart (two such hosts served bench/planner.py's quick Mixtral shape colocated on one thread at
    2,723 and 1,342 tok/s); `python` the interpreter, which runs the front and the scheduler."""
    from kernels.cpu_linear import packing_available

    cpu = platform.processor() or platform.machine()
    try:
        name, cpu_id, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        name, cpu_id, flags = "", "", set()
    if name and cpu in ("", platform.machine(), platform.processor()):
        cpu = name
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return {"cpu": cpu, "cpu_id": cpu_id, "python": platform.python_version(),
            "cores": len(os.sched_getaffinity(0)), "hardware_threads": os.cpu_count(),
            "memory_gib": round(mem, 1), "isa": isa, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "bf16_packed": packing_available(torch.bfloat16), "float32_packed": packing_available(torch.float32)}
