"""Disaggregated deployments: the attention and expert worker pools and the front that drives them.

engine.py: PoolEngine, the engine the front (LLM, the HTTP and gRPC servers) runs over the pools;
supervision.py: failure handling (restart, failover), an object the engine holds; control.py: the
control connections of attention workers; launchers.py: how workers start (spawned processes or
Ray actors); roles.py: `shuttle serve --role attention|expert` for workers on other hosts; eplb.py:
live expert placement and load balancing.
"""
