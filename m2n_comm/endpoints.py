"""open_endpoint: the one place that picks a backend of the slot protocol (m2n_comm/transport.py)
by TransportConfig.backend. The backends import the protocol, never this module; nixl is imported
only when asked for (an optional dependency)."""
from typing import Sequence

from m2n_comm._hello import signed_store
from m2n_comm.transport import Endpoint, TransportConfig


def open_endpoint(cfg: TransportConfig, store, session: str, me: str, peers: Sequence[str],
                  num_slots: int) -> Endpoint:
    """Create my receive slots, publish how to reach me through `store` (a torch.distributed Store:
    set/get/check; what is published there is signed with cfg.token, _hello.SignedStore), and connect
    to every peer. Returns when all peers are reachable (or raises TransportTimeout after
    cfg.connect_timeout_s naming the missing peers)."""
    store = signed_store(store, cfg.token)
    if cfg.backend == "shm":
        from m2n_comm.shm import ShmEndpoint
        return ShmEndpoint(cfg, store, session, me, list(peers), num_slots)
    if cfg.backend == "nixl":
        from m2n_comm.nixl import NixlEndpoint
        return NixlEndpoint(cfg, store, session, me, list(peers), num_slots)
    from m2n_comm.tcp import TcpEndpoint
    return TcpEndpoint(cfg, store, session, me, list(peers), num_slots)
