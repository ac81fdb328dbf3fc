"""Clients of Shuttle's wire formats (gRPC client, load-test tool); built by the server issue."""
