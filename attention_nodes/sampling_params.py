"""SamplingParams: how one request is decoded (the OpenAI and vLLM parameters)."""
import math
from dataclasses import dataclass, field

from attention_nodes.structured import KINDS, StructuredOutputs

MAX_LOGPROBS = 20  # most alternatives a request may ask for, as OpenAI and vLLM's default
MAX_N = 128  # most samples per prompt, as OpenAI's limit


@dataclass
class SamplingParams:
    """How one request is decoded. Errors are ValueErrors that name the field and the bad value.

    max_tokens: tokens to generate at most (>= 1).
    temperature: 0 is greedy; higher flattens the distribution (>= 0).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 disables.
    seed: makes sampling reproducible whatever else is in the batch; None draws from the global RNG.
    stop: strings that end the text (not returned unless include_stop_str_in_output).
    stop_token_ids: extra ids that end the text.
    ignore_eos: keep going past the end-of-sequence token.
    n: output sequences per prompt, 1 to MAX_N.
    min_p: drop tokens whose probability is below min_p times the most likely one's, in [0, 1].
    presence_penalty: subtracted once from the logit of every token already generated, in [-2, 2].
    frequency_penalty: subtracted from a token's logit per time it was generated, in [-2, 2].
    repetition_penalty: divides positive (multiplies negative) logits of tokens in the prompt or
        the output (> 0; 1 disables).
    logprobs: how many most likely alternatives to return with each chosen token's logprob, 0 to
        MAX_LOGPROBS; None returns no logprobs.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    skip_special_tokens: leave special tokens out of the detokenized text.
    min_tokens: the end-of-sequence and stop_token_ids are banned until this many tokens were
        generated (>= 0, at most max_tokens).
    logit_bias: token id -> value in [-100, 100] added to its logit before sampling (-100 bans the
        token in practice, +100 forces it); ids beyond the vocabulary are refused by the engine.
    prompt_logprobs: also return the log-probability of every prompt token after the first (and
        this many most likely alternatives, 0 to MAX_LOGPROBS); None returns none. The first
        sample computes them, so its prompt skips the prefix cache.
    structured_outputs: a grammar the output must match (attention_nodes/structured.py); a dict
        {"kind", "spec"} is taken too (the wire form). Its spec is checked when the engine
        compiles it (StructuredOutputs.check checks it up front).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        if self.seed is not None:
            _check_int("seed", self.seed, low=-(2 ** 63), high=2 ** 63 - 1)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, low=0)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        """Type and range checks of the fields beyond the original OpenAI core."""
        _check_int("n", self.n, low=1, high=MAX_N)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias, got {self.logit_bias!r}")
            for tid, bias in self.logit_bias.items():
                _check_int("logit_bias", tid, low=0)
                _check_float(f"logit_bias[{tid}]", bias, low=-100.0, high=100.0)
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs) or self.structured_outputs.kind not in KINDS:
                raise ValueError(f"structured_outputs must be a StructuredOutputs of kind {'/'.join(KINDS)}, "
                                 f"got {self.structured_outputs!r}")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ValueError unless value is an int (bools refused) in [low, high] (high None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def _check_float(name: str, value: object, low: float, high: float | None = None, low_open: bool = False) -> None:
    """Raise ValueError unless value is a finite int or float (bools refused) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    above = value > low if low_open else value >= low
    if not (math.isfinite(value) and above and (high is None or value <= high)):
        upper = f"{high}]" if high is not None else "inf)"
        bounds = f"{'(' if low_open else '['}{low}, {upper}"
        raise ValueError(f"{name} must be a finite number in {bounds}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    """Raise ValueError unless value is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
