"""What the server returns for a request (vLLM's shapes), and the per-request state that turns the
engine's token deltas into text: incremental detokenization and stop strings.
"""
from dataclasses import dataclass, field

from attention_nodes.engine import SequenceDelta
from attention_nodes.sampling_params import SamplingParams
from server.detokenizer import IncrementalDetokenizer


@dataclass
class Logprob:
    logprob: float | None  # None only for an echoed prompt's first token, which nothing predicts
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request. text and token_ids are cumulative; delta_text and delta_token_ids
    hold what was added since the previous output was handed on (for streaming). logprobs: per generated token, a dict from
    token id to Logprob holding the chosen token and the top alternatives."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (eos, stop id or stop string), "length" or "abort"
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    request_id: str = ""
    num_cached_tokens: int = 0  # prompt tokens whose prefill the prefix cache skipped
    # with params.prompt_logprobs: per prompt token, its Logprob and the top alternatives' (None
    # for the first token, which nothing predicts), as vLLM's RequestOutput.prompt_logprobs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class RequestTracker:
    """Collects one request's deltas. `apply` returns a stop string when one ended a sequence's
    text, so the caller can stop that sequence in the engine. The outputs' delta fields gather
    every delta applied since `clear_deltas` (one engine step can hold several deltas of a
    sequence: PoolEngine returns all that the workers sent since the last step)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer):
        self.params, self.tokenizer = params, tokenizer
        self.output = RequestOutput(prompt, list(prompt_token_ids), finished=False, request_id=request_id)
        self.detoks: list[IncrementalDetokenizer | None] = []
        for i in range(params.n):
            self.output.outputs.append(CompletionOutput(i, "", [], None, logprobs=[] if params.logprobs is not None else None))
            self.detoks.append(None if tokenizer is None else IncrementalDetokenizer(
                tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output))

    def apply(self, delta: SequenceDelta) -> str | None:
        """Add one engine delta to its sequence's output (tokens, logprobs, text, finish reason).
        Returns the stop string that ended the text, if one did (the caller stops the sequence)."""
        out, detok = self.output.outputs[delta.index], self.detoks[delta.index]
        if out.finished:  # a stop string ended it already
            return None
        ids, stop = list(delta.new_token_ids), None
        if detok is not None and ids:
            if len(ids) == 1 or not self.params.stop:
                stop = detok.add_tokens(ids)
            else:  # several tokens (speculative decoding): those after the one that ends a stop string are not output
                for n, tok in enumerate(ids, 1):
                    if (stop := detok.add_tokens([tok])) is not None:
                        ids = ids[:n]
                        break
        out.token_ids += ids
        self.output.num_cached_tokens = max(self.output.num_cached_tokens, delta.num_cached_tokens)
        out.delta_token_ids = out.delta_token_ids + ids  # a new list: snapshots keep theirs
        if out.logprobs is not None and delta.new_logprobs:
            out.logprobs += [self._entry(lp) for lp in delta.new_logprobs[:len(ids)]]
        if delta.prompt_logprobs:
            if self.output.prompt_logprobs is None:
                self.output.prompt_logprobs = [None]
            self.output.prompt_logprobs += [self._entry(lp) for lp in delta.prompt_logprobs]
        if stop is not None:
            out.finish_reason, out.stop_reason = "stop", stop
        elif delta.finish_reason:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        if detok is not None:
            out.delta_text += detok.take_delta(out.finished)
            out.text = detok.text
        self.output.finished = all(o.finished for o in self.output.outputs)
        return stop

    def clear_deltas(self) -> None:
        """Start the next output's deltas (after this one was handed on); a sample that gets no
        token in the next step (finished, preempted) then has an empty delta, not a stale one."""
        for o in self.output.outputs:
            o.delta_text, o.delta_token_ids = "", []

    def _entry(self, lp) -> dict[int, Logprob]:
        """One position's engine.TokenLogprobs as {token id: Logprob}: the top alternatives, then the chosen one."""
        entry = {tid: Logprob(v, i + 1, self._piece(tid)) for i, (tid, v) in enumerate(lp.top)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._piece(lp.token_id))
        return entry

    def _piece(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])
