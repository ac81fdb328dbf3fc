"""Clients of a running Shuttle: the gRPC client (grpc_client.py), `shuttle bench serve` (bench_*.py),
readiness polling (ready.py), and LiveServer (live_server.py), a `shuttle serve` process that tests
and benchmarks start."""
