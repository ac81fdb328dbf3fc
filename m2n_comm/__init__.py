"""M2N: the many-to-many token dispatch/combine transport between attention and expert workers
(see shared/DESIGN.md). transport.py: the slot protocol and open_endpoint; shm.py / tcp.py: its
backends; m2n.py: Placement, M2NSender (a models.dispatcher.Dispatcher), M2NReceiver."""
