"""The `shuttle` command.

    shuttle serve [--model DIR] [--host H] [--port P] [--api-key KEY] [--grpc-port P] [pool flags]
    shuttle serve --role attention|expert --rendezvous HOST:PORT      (a worker of a multi-host pool)
    shuttle generate --model DIR --prompt TEXT [--prompt TEXT ...] [--max-tokens N] [--json]
                     [--attention-workers N --expert-workers M --micro-batches K --transport shm|tcp|nixl]
                     [--launcher spawn|ray --ray-address auto|HOST:PORT --attention-resources JSON --expert-resources JSON]
    shuttle bench serve --base-url URL [--backend openai|openai-chat|grpc] [--num-prompts N] ...
    shuttle profile [--model DIR] [--torch-threads 1,2] [--transport shm,tcp] [--quick] --out PROFILE.json
    shuttle simulate --profile PROFILE.json (--colocated | --attention-workers A ...) --num-prompts N ...
    shuttle plan --model DIR|NAME --hardware KIND[=PRICE][,...] --tbt-slo-ms X --max-devices N --out PLAN.json
    shuttle train (--recipe builtin | --family F ... | --init-from DIR) --data FILES --out DIR [--nproc-per-node N]

`shuttle serve` runs the OpenAI-compatible HTTP server (and gRPC with --grpc-port) in front of
disaggregated worker pools on this host (1 attention and 1 expert worker unless told otherwise;
--colocated runs the experts in-process), or, with --rendezvous, in front of workers started on
other hosts with `shuttle serve --role ...`. `shuttle generate` runs everything in one process
unless a pool flag is given. The API key may also come from the SHUTTLE_API_KEY variable.
SHUTTLE_DEPLOYMENT_TOKEN (front and --role workers alike) is the deployment token the pools prove to
each other (never sent, never in the rendezvous store); a --role worker needs it, and a front with
--rendezvous started without it generates one and logs the line to export on the workers.
"""
import argparse
import json
import logging
import os
import sys

from attention_nodes.config import M2N_DTYPES, QUANTIZATIONS
from attention_nodes.sampling_params import SamplingParams
from m2n_comm.transport import BACKENDS
from server.parsers import REASONING_PARSERS, TOOL_PARSERS


def _generate(args: argparse.Namespace) -> int:
    from server.llm import LLM

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos, n=args.n)
        kwargs = _deployment_kwargs(args, disaggregate_by_default=False)
        llm = LLM(kwargs.pop("model", args.model), rendezvous=args.rendezvous, **kwargs)
        try:
            outputs = llm.generate(args.prompt, params)
        finally:
            llm.shutdown()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"shuttle generate: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids, "index": c.index,
                                  "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}))
            else:
                print(f"{out.prompt}{c.text}\n")
    return 0


def _deployment_kwargs(args: argparse.Namespace, disaggregate_by_default: bool) -> dict:
    """Engine and pool keyword arguments of LLM/AsyncLLM from the flags, or from --plan (the plan's
    deployment and batch; ValueError if pool flags are given too, or the host cannot run it)."""
    if args.plan is None:
        return {**_engine_kwargs(args), **_pool_kwargs(args, disaggregate_by_default)}
    given = [f"--{f.replace('_', '-')}" for f in POOL_FLAGS + ("torch_threads", "expert_device")
             if getattr(args, f) is not None] + (["--colocated"] if args.colocated else [])
    if given or args.rendezvous:
        raise ValueError(f"--plan sets the deployment; it takes no {', '.join(given) or '--rendezvous'}")
    from planner.plan import plan_engine_kwargs

    asked = {} if args.quantization is None else {"quantization": args.quantization}
    if args.quantize_linears:
        asked["quantize_linears"] = True
    planned = plan_engine_kwargs(args.plan, args.model, **asked)  # a plan made for another quantization: refused
    logging.getLogger("shuttle").info("--plan %s: %s", args.plan, describe_plan(planned))
    kwargs = {**_engine_kwargs(args), **planned, **_eplb_kwargs(args)}
    if args.attention_device or args.device:
        kwargs["device"] = args.attention_device or args.device
    return kwargs


def describe_plan(planned: dict) -> str:
    """One line saying which deployment, threads and batch a plan set."""
    p = planned
    if p["colocated"]:
        where = f"colocated on {p['device']}"
    else:
        where = (f"{p['attention_workers']} attention worker(s) on {p['device']} + {p['expert_workers']} expert "
                 f"worker(s) on {p['expert_device'] or p['device']}, {p['micro_batches']} micro-batch(es), "
                 f"transport {p['transport']}")
    threads = p["torch_threads"] or "default"
    linears = " (and linears)" if p.get("quantize_linears") else ""
    quantized = f"; experts {p['quantization']}{linears}" if p.get("quantization") else ""
    return f"{where}; torch threads per worker: {threads}; batch up to {p['max_num_seqs']} sequences{quantized}"


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.attention_device or args.device, kernels=args.kernels, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
                max_worker_restarts=args.max_worker_restarts, restart_window_s=args.restart_window_s,
                enforce_eager=args.enforce_eager, native_decode=args.native_decode, trace_dir=args.trace_dir,
                quantization=args.quantization, speculative_config=args.speculative_config,
                quantize_linears=args.quantize_linears)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's, but float32 for a bf16/fp16 checkpoint on a CPU without native "
                        "bf16/fp16 GEMMs), float32, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--kernels", default=None, choices=["torch", "triton"], help="override the device's kernels")
    p.add_argument("--quantization", "-q", default=None, choices=["none", *QUANTIZATIONS, "experts_int8"],
                   help="int8: keep the expert weights as int8 with per-channel scales, quantised at load from a "
                        "float checkpoint (half of bf16's bytes; CPU workers; experts_int8 is vLLM's name for it; "
                        "weight-only, except that an expert with enough rows in a step takes w8a8_int8's "
                        "arithmetic where the kernel choice measured it >10%% faster). w8a8_int8: the same int8 experts, their activations quantised per token "
                        "to int8 too (int8 x int8 with AVX-512 VNNI; SiLU experts without biases). fp8: as FP8 "
                        "E4M3 in 128x128 blocks (the same bytes). An FP8 block "
                        "checkpoint is served in FP8 as shipped (experts and FP8 linears) where its experts run "
                        "on CPU workers with torch kernels or on Triton (sm_89+); none: dequantise it at load "
                        "instead. fp8 and mxfp4 also run on Triton kernels. mxfp4: the "
                        "experts as MXFP4 (4-bit E2M1 codes, a scale byte per 32 inputs: 0.27x bf16's bytes), an "
                        "MXFP4 checkpoint's (gpt-oss) as shipped, a float checkpoint's quantised at load")
    p.add_argument("--quantize-linears", action="store_true",
                   help="with --quantization int8 or fp8: the other linear layers in that format too (attention "
                        "projections, dense and shared-expert MLPs; not the LM head or routers), quantised at load; "
                        "the attention side on the CPU (fp8: or on Triton, sm_89+)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4} (also prompt_lookup_min, disable_by_batch_size; method mtp, '
                        'draft_model with model; token_map: a file of the token ids MTP drafts from)')
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences per step, per attention worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run every op eagerly; --no-enforce-eager compiles the CPU decode path's non-GEMM stages "
                        "(residual add + RMSNorm, q/k norm + rotary) with torch.compile at start-up "
                        "(default: $SHUTTLE_ENFORCE_EAGER, else eager)")
    p.add_argument("--native-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="run bf16 decode steps' layers from C on CPUs with AVX-512 BF16, for the models it takes "
                        "(Mixtral, Qwen3-MoE, OLMoE shapes): colocated the whole step in one call, on attention "
                        "workers each layer's attention side; --no-native-decode keeps the eager layers")


POOL_FLAGS = ("attention_workers", "expert_workers", "micro_batches", "transport", "placement", "launcher",
              "ray_address", "attention_resources", "expert_resources", "m2n_dtype")
EPLB_FLAGS = ("eplb", "eplb_interval", "num_redundant_experts")


def _eplb_kwargs(args: argparse.Namespace) -> dict:
    if (args.eplb_interval is not None or args.num_redundant_experts is not None) and not args.eplb:
        raise ValueError("--eplb-interval and --num-redundant-experts take effect with --eplb")
    return dict(eplb=bool(args.eplb), eplb_interval=args.eplb_interval or 3000,
                num_redundant_experts=args.num_redundant_experts or 0)


def _pool_kwargs(args: argparse.Namespace, disaggregate_by_default: bool) -> dict:
    named = ["--" + f.replace("_", "-") for f in POOL_FLAGS + EPLB_FLAGS if getattr(args, f) is not None]
    given = bool(named)
    colocated = args.colocated or not (disaggregate_by_default or given or args.rendezvous)
    if args.colocated and (given or args.rendezvous):
        raise ValueError(f"--colocated runs the experts in-process; it takes no pool flag or --rendezvous (given: "
                         f"{', '.join(named + (['--rendezvous'] if args.rendezvous else []))})")
    return dict(colocated=colocated, attention_workers=args.attention_workers or 1,
                expert_workers=args.expert_workers or 1, micro_batches=args.micro_batches or 1,
                transport=args.transport or "shm", placement=args.placement, torch_threads=args.torch_threads,
                expert_device=args.expert_device, launcher=args.launcher or "spawn", ray_address=args.ray_address,
                attention_resources=args.attention_resources or (), expert_resources=args.expert_resources or (),
                m2n_dtype=args.m2n_dtype or "auto", **_eplb_kwargs(args))


def _add_pool_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker pools (disaggregated experts)")
    g.add_argument("--attention-workers", type=int, default=None, help="attention worker processes (default 1)")
    g.add_argument("--expert-workers", type=int, default=None, help="expert worker processes (default 1)")
    g.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step, 1 to 4 (default 1)")
    g.add_argument("--transport", choices=list(BACKENDS), default=None,
                   help="M2N backend (default shm): shm on one host, tcp or nixl (UCX: RDMA where present) across hosts")
    g.add_argument("--placement", default=None, help='JSON file {"expert": [workers]} (default: contiguous blocks)')
    g.add_argument("--m2n-dtype", choices=M2N_DTYPES, default=None,
                   help="what tokens cross to the expert workers in: auto (the activations' dtype, default) or fp8 "
                        "(float8 e4m3 with per-token scales: half of bf16's bytes; answers stay in the activations' "
                        "dtype)")
    g.add_argument("--eplb", action="store_true", default=None,
                   help="expert load balancing: re-place the experts live from their measured load")
    g.add_argument("--eplb-interval", type=int, default=None, metavar="STEPS",
                   help="with --eplb: steps between re-placements (default 3000)")
    g.add_argument("--num-redundant-experts", type=int, default=None, metavar="R",
                   help="with --eplb: extra expert copies per MoE layer for the hottest experts (default 0)")
    g.add_argument("--torch-threads", type=int, default=None, help="torch threads per worker process")
    g.add_argument("--max-worker-restarts", type=int, default=3, metavar="N",
                   help="restart a dead or silent worker at most N times within --restart-window-s; past that "
                        "the deployment fails (0: never restart; default 3)")
    g.add_argument("--restart-window-s", type=float, default=600.0, metavar="S",
                   help="the window --max-worker-restarts counts restarts in (seconds, default 600)")
    g.add_argument("--colocated", action="store_true", help="experts inside the attention process, no transport")
    g.add_argument("--attention-device", default=None, help="the attention pool's device (cpu, cuda; as --device)")
    g.add_argument("--expert-device", default=None, help="the expert pool's device (default: the attention pool's)")
    g.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="each pool worker writes DIR/<worker>.trace.json when it stops: a Chrome trace of its steps "
                        "(with their sequences and prompt tokens), layers, M2N sends and waits, to open in "
                        "ui.perfetto.dev beside shuttle simulate --trace; the engine loop writes DIR/front.trace.json "
                        "(colocated: DIR/engine.trace.json) with its steps, admissions and deliveries when the "
                        "server stops; the spans stay in memory until then, so for diagnostic runs")
    g.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="run the deployment of a plan from shuttle plan (pools, micro-batches, threads, batch)")
    g.add_argument("--launcher", choices=["spawn", "ray"], default=None,
                   help="how the pools start: spawn (processes of this host, default) or ray (Ray actors)")
    g.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                   help="--launcher ray: the cluster to join (default: Ray's, a local instance if none runs)")
    g.add_argument("--attention-resources", default=None, metavar="JSON",
                   help='--launcher ray: Ray resources each attention worker needs, e.g. \'{"H20": 1}\'')
    g.add_argument("--expert-resources", default=None, metavar="JSON",
                   help='--launcher ray: Ray resources each expert worker needs, e.g. \'{"L40S": 1}\'')
    g.add_argument("--rendezvous", default=None, metavar="HOST:PORT",
                   help="meet workers started elsewhere with `shuttle serve --role ...` (TCPStore address)")


def _serve(args: argparse.Namespace) -> int:
    if args.role in ("attention", "expert"):
        if not args.rendezvous:
            print("shuttle serve: error: --role attention|expert needs --rendezvous HOST:PORT", file=sys.stderr)
            return 2
        from pools.roles import run_role
        try:
            run_role(args.role, args.rendezvous, args.host, args.torch_threads,
                     os.environ.get("SHUTTLE_DEPLOYMENT_TOKEN") or None)
        except ValueError as e:
            print(f"shuttle serve: error: {e}", file=sys.stderr)
            return 2
        return 0
    from server.api_server import ServerConfig, bind, serve
    from server.async_llm import AsyncLLM
    from server.metrics import ServerMetrics

    try:
        kwargs = _deployment_kwargs(args, disaggregate_by_default=True)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"shuttle serve: error: {e}", file=sys.stderr)
        return 2
    model = kwargs.pop("model", args.model)
    name = args.served_model_name or (str(model).rstrip("/") if model else "shuttle-builtin")
    cfg = ServerConfig(args.host or "127.0.0.1", args.port, args.api_key or os.environ.get("SHUTTLE_API_KEY") or None,
                       name, args.grpc_port, args.max_body_bytes, args.log_requests, args.tool_call_parser,
                       args.reasoning_parser)
    metrics = ServerMetrics(name)
    try:  # the ports first: a busy one should fail now, not after the pools started and the model loaded
        sock = bind(cfg.host, cfg.port)
        if cfg.grpc_port:
            bind(cfg.host, cfg.grpc_port).close()
    except OSError as e:
        print(f"shuttle serve: error: {e}", file=sys.stderr)
        return 2
    try:
        llm = AsyncLLM(model, rendezvous=args.rendezvous, max_waiting=args.max_waiting, observer=metrics,
                       deployment_token=os.environ.get("SHUTTLE_DEPLOYMENT_TOKEN") or None, **kwargs)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sock.close()
        print(f"shuttle serve: error: {e}", file=sys.stderr)
        return 2
    try:
        serve(llm, cfg, metrics, sock)
    finally:
        llm.shutdown()
    return 0


def _workers(args) -> int:
    import httpx

    key = args.api_key or os.environ.get("SHUTTLE_API_KEY")
    try:
        r = httpx.get(f"{args.url.rstrip('/')}/workers", headers={"Authorization": f"Bearer {key}"} if key else {},
                      timeout=30)
    except httpx.HTTPError as e:
        print(f"shuttle workers: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"shuttle workers: {args.url} answered {r.status_code}: {r.text[:300]}", file=sys.stderr)
        return 1
    body = r.json()
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    if not body["workers"]:
        print("no pool workers (a colocated engine, or no step yet)")
        return 0
    share = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    print(f"last {body['window_s']:.0f} s; a score of {body['threshold']:g} or more names a straggler")
    print(f"{'pool':<10} {'worker':<7} {'busy':>6} {'waited on':>10} {'score':>6} {'speed':>6}")
    for w in body["workers"]:
        flag = "  straggler" if w["score"] >= body["threshold"] else ""
        print(f"{w['pool']:<10} {w['worker']:<7} {share(w['busy']):>6} {share(w['waited_on']):>10} {w['score']:>6.2f} "
              f"{w.get('speed', 1.0):>6.3g}{flag}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shuttle", description="Shuttle: MoE serving with disaggregated experts")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="the OpenAI-compatible server (or, with --role, a worker of a deployment)")
    _add_engine_flags(s)
    s.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1); with --role: this "
                                                 "host's address for the tcp transport")
    s.add_argument("--port", type=int, default=8000, help="HTTP port")
    s.add_argument("--grpc-port", type=int, default=None, help="also serve gRPC on this port (0: any free one)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set SHUTTLE_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model's id in the API (default: --model as "
                                                             "given, or shuttle-builtin)")
    s.add_argument("--max-waiting", type=int, default=1024, help="requests that may wait for their first token; "
                                                                  "beyond, 503 with Retry-After")
    s.add_argument("--max-body-bytes", type=int, default=32 * 2 ** 20, help="larger request bodies get 413")
    s.add_argument("--log-requests", action="store_true", help="log every HTTP request")
    s.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="parse tool calls from the model's text under tool_choice auto, in its family's "
                        "format (vLLM's names)")
    s.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="return a reasoning model's thinking as reasoning_content, apart from the answer "
                        "(vLLM's names)")
    s.add_argument("--role", choices=["attention", "expert", "server"], default="server",
                   help="server (default): the API front; attention|expert: a worker joining --rendezvous")
    _add_pool_flags(s)
    s.set_defaults(func=_serve)
    g = sub.add_parser("generate", help="complete prompts offline and print the results")
    _add_engine_flags(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1, help="samples per prompt")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="a stop string; repeat for several")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    _add_pool_flags(g)
    g.set_defaults(func=_generate)
    from planner.cli import add_parsers as add_planner_parsers
    add_planner_parsers(sub)
    from training.cli import add_parser as add_train_parser
    add_train_parser(sub)
    w = sub.add_parser("workers", help="a running deployment's workers over the last window: busy share, how "
                                      "long the other pool waited on each, straggler score (GET /workers)")
    w.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    w.add_argument("--api-key", default=None, help="its API key (or set SHUTTLE_API_KEY)")
    w.add_argument("--json", action="store_true", help="print the JSON answer")
    w.set_defaults(func=_workers)
    b = sub.add_parser("bench", help="benchmarks: `shuttle bench serve` load-tests any OpenAI-compatible server")
    from clients.bench_serve import add_parser as add_bench_serve
    add_bench_serve(b.add_subparsers(dest="bench_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
