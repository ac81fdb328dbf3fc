"""M2N: the many-to-many transport between attention and expert workers. transport.py: the slot
protocol every backend implements; endpoints.py: open_endpoint, which picks a backend (shm.py: one
host; tcp.py: any hosts; nixl.py: RDMA where the NIC has it, through NIXL); _common.py / _hello.py:
what the backends share; m2n.py: token dispatch and combine over it (M2NSender, a
models.dispatcher.Dispatcher, and M2NReceiver); placement.py: the tables dispatch routes by."""
