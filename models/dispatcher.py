"""The seam between a MoE layer's router and its experts.

Each MoE layer runs `router -> dispatcher.dispatch -> experts -> dispatcher.combine`. The
LocalDispatcher computes the experts in this process and is the oracle; the M2N dispatcher sends
the tokens to expert workers instead. `dispatch` returns a handle and `combine` waits on that handle
only, so a caller may dispatch several micro-batches before combining any.

Legend: T tokens, D hidden, K experts per token.
"""
from typing import Any, Protocol

import torch
from torch import nn


class Dispatcher(Protocol):
    def dispatch(self, layer: int, experts: nn.Module | None, x_TD: torch.Tensor,
                 topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, mb: int = 0) -> Any:
        """Start the expert computation of layer `layer` for these tokens of micro-batch `mb`;
        returns a handle. experts: the layer's local Experts module (None on an attention worker)."""
        ...

    def combine(self, handle: Any) -> torch.Tensor:
        """Wait for the handle's result: y_TD, the router-weighted sum of the chosen experts."""
        ...

    def begin_step(self) -> None:
        """A forward pass (one engine step, all its micro-batches) begins."""
        ...

    def end_step(self) -> None:
        """That forward pass has combined everything it dispatched."""
        ...


def count_expert_tokens_(counts_E: torch.Tensor, ids: torch.Tensor) -> None:
    """counts_E[e] += how many entries of ids are e; negative ids (empty slots) are skipped. Stays on
    the device without synchronising (torch.bincount on CUDA reads the ids' range on the host)."""
    ids = ids.reshape(-1).to(counts_E.device)  # (a no-op where they share the device, as they should)
    counts_E.index_add_(0, ids.clamp(min=0), (ids >= 0).to(counts_E.dtype))


class LocalDispatcher:
    """Runs the layer's own experts in this process (no transport): the reference dispatcher.
    num_experts > 0 keeps expert_tokens_E: (token, expert) pairs routed to each expert so far,
    summed over layers (int64, on `device`, the experts' device: counting never synchronises).
    The layers' ids are counted together when the step ends: one count per step instead of five
    small ops per layer, which a decode step at batch 1 pays in full. Counting happens only there,
    on the engine's thread; a reader (the metrics endpoint, from another thread) sees the counts of
    the steps finished so far and changes nothing."""

    def __init__(self, num_experts: int = 0, device: torch.device | str = "cpu"):
        self.expert_tokens_E = torch.zeros(num_experts, dtype=torch.long, device=device) if num_experts else None
        self._pending: list[torch.Tensor] = []

    def dispatch(self, layer: int, experts: nn.Module | None, x_TD: torch.Tensor,
                 topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, mb: int = 0) -> torch.Tensor:
        if experts is None:
            raise RuntimeError(f"layer {layer}: this model was built without experts; use a remote dispatcher")
        if self.expert_tokens_E is not None:
            self._pending.append(topk_ids_TK)
        return experts(x_TD, topk_ids_TK, topk_weights_TK)

    def combine(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def record(self, topk_ids: torch.Tensor) -> None:
        """Count ids chosen outside dispatch (models/native_decode.py runs a step's experts in C)."""
        if self.expert_tokens_E is not None:
            self._pending.append(topk_ids)

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        if self._pending:
            ids = self._pending[0] if len(self._pending) == 1 else torch.cat([t.reshape(-1) for t in self._pending])
            self._pending = []
            count_expert_tokens_(self.expert_tokens_E, ids)
