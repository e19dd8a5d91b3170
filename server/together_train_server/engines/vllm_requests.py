"""Our sampling types <-> vLLM's: request parameters in, ``RequestOutput`` back (vllm imported lazily).

The semantics (module doc of `vllm_generator`): one vLLM request per stream,
``FINAL_ONLY`` outputs, EOS handled as a stop token id, stop strings matched
on text with special tokens kept and included in the tokens; scoring
requests (prompt logprobs) generate one greedy token and detokenize nothing.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .generator_base import stop_token_ids
from .types import Constraint, GenSequence, SamplingParams

__all__ = ["gen_sequence", "read_prompt_logprobs", "sampling_params", "scoring_params"]


def sampling_params(p: SamplingParams, budget: int, seed: int | None, eos_token_ids: Sequence[int]) -> Any:
    """The ``vllm.SamplingParams`` of one stream: ``budget`` new tokens at most, ``seed`` (< 2**63) or None."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    stop_ids = stop_token_ids(p, eos_token_ids)
    greedy = p.temperature == 0
    return VllmSamplingParams(
        n=1,
        max_tokens=budget,
        temperature=float(p.temperature),
        top_k=0 if greedy else int(p.top_k),
        top_p=1.0 if greedy else float(p.top_p),
        min_p=0.0 if greedy else float(p.min_p),
        seed=seed,
        stop=list(p.stop) or None,
        stop_token_ids=stop_ids or None,
        ignore_eos=True,              # EOS arrives through stop_token_ids (module doc)
        logprobs=0,                   # the sampled token's logprob only
        skip_special_tokens=False,    # stop strings see special tokens, like the torch engine
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
        **structured_output(p.constraint),
    )


def structured_output(c: Constraint | None) -> dict[str, Any]:
    """vLLM's own structured-output option for a constraint, as ``vllm.SamplingParams`` keyword arguments.

    vLLM >= 0.11: ``structured_outputs=StructuredOutputsParams(json= | grammar=)``; older:
    ``guided_decoding=GuidedDecodingParams(...)``. A Lark grammar (tool calls) is llguidance's
    syntax: vLLM's "auto" backend hands grammars xgrammar cannot read to llguidance ("guidance").
    Its masked logprobs follow vLLM's ``logprobs_mode`` (the torch engine reports the masked ones).
    """
    if c is None:
        return {}
    value: Any = json.loads(c.spec) if c.kind == "json_schema" else c.spec
    field = "json" if c.kind == "json_schema" else "grammar"
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**{field: value})}
    return {"structured_outputs": StructuredOutputsParams(**{field: value})}


def scoring_params(k: int) -> Any:
    """The ``vllm.SamplingParams`` of a scoring request: untempered prompt logprobs with ``k`` alternatives."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(n=1, max_tokens=1, temperature=0.0, prompt_logprobs=k, ignore_eos=True,
                              skip_special_tokens=False, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)


def gen_sequence(out: Any) -> GenSequence:
    """A finished sampling ``RequestOutput`` -> GenSequence (tokens, their logprobs in nats, stop reason).

    Raises:
        RuntimeError: vLLM returned a different number of logprobs than tokens.
    """
    c = out.outputs[0]
    toks = [int(t) for t in c.token_ids]
    lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], toks)]
    if len(lps) != len(toks):
        raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(toks)} tokens")
    return GenSequence(tokens=toks, logprobs=lps, stop_reason="stop" if c.finish_reason == "stop" else "length")


def read_prompt_logprobs(out: Any, tokens: list[int], k: int) -> tuple[list[float], list[tuple[list[int], list[float]]]]:
    """(actual-token logprobs [L-1], top-k (ids, logprobs) per position) from a scoring output."""
    plps = out.prompt_logprobs or [None]
    actual: list[float] = []
    topk: list[tuple[list[int], list[float]]] = []
    for pos, d in enumerate(plps[1:], start=1):
        actual.append(float(d[tokens[pos]].logprob))
        if k > 0:
            ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in d.items() if lp.rank <= k))
            topk.append(([int(t) for _, t, _ in ranked[:k]], [float(v) for _, _, v in ranked[:k]]))
    return actual, topk
