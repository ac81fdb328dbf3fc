"""M2N: the many-to-many token dispatch/combine transport between attention and expert workers
(see shared/DESIGN.md). It implements models.dispatcher.Dispatcher; built by the disaggregation issue."""
