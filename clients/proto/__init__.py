"""Shuttle's gRPC wire format: shuttle.proto (package shuttle.v1, service Generation) and the
modules grpc_tools.protoc generates from it, committed beside it:

    shuttle_pb2.py (+ .pyi)   the messages        from clients.proto import shuttle_pb2
    shuttle_pb2_grpc.py       stub and servicer   from clients.proto import shuttle_pb2_grpc

After editing shuttle.proto, regenerate them from the repository root (needs grpcio-tools):

    .venv/bin/python -m clients.proto.regenerate

tests/test_grpc.py fails while the committed modules differ from what protoc makes of the .proto.
"""

# The largest message either side sends or accepts (server and clients agree): a batch of long
# prompts, or logprobs of long outputs, exceed gRPC's default of 4 MiB.
MAX_MESSAGE_BYTES = 64 << 20
