"""Constrained decoding on the torch engine: per-stream grammar matchers mask the logits (llguidance).

A request whose `SamplingParams.constraint` is set gets one ``llguidance.LLMatcher``
per stream. Before each token is sampled the engine asks the matcher which tokens
may come next (a ``[B, ceil(V / 32)]`` int32 bitmask) and sets the other logits
to ``-inf``; the sampled token is then fed back to the matcher. The sampler's
temperature, top-k/top-p and reported logprobs therefore act on the masked
distribution: the logprob of a constrained token is that of the distribution it
was actually drawn from. Once the grammar is complete only the end-of-sequence
tokens are allowed, so a sequence ends with EOS as soon as its text is complete.

llguidance (Microsoft's guidance project, also one of vLLM's structured-output
backends) compiles JSON Schema and Lark grammars lazily against the tokenizer's
byte-level vocabulary; its tokenizer view of the HF tokenizer is built once per
engine (~0.7 s for SmolLM2's 49k tokens) on the first constrained request.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Sequence

import torch

from .types import Constraint

__all__ = ["COMPACT_JSON", "GrammarMasks", "check_constraint", "grammar_text"]

# JSON written as json.dumps writes it: no whitespace but the separators' (a free-whitespace
# grammar lets an untrained model pad with blanks until max_tokens).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar (its JSON form) of a constraint.

    Raises:
        ValueError: an unknown kind, or a json_schema spec that is not a JSON object.
    """
    import llguidance

    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    if c.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(c.spec)
    raise ValueError(f"unknown constraint kind {c.kind!r}; expected 'json_schema' or 'lark'")


def check_constraint(c: Constraint) -> None:
    """Compile-check a constraint without a tokenizer (the service's check before a replica sees it).

    Raises:
        ValueError: the grammar or schema does not compile; the message is llguidance's.
    """
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar_text(c))
    if err:
        raise ValueError(err)


class _TokenBytes:
    """The `llguidance.TokenizerWrapper` input for a tokenizer llguidance cannot read itself: each token's
    text as UTF-8 bytes (single-character and word-level vocabularies; special tokens listed as such)."""

    def __init__(self, hf: Any, n_vocab: int) -> None:
        self.eos_token_id = hf.eos_token_id
        self.bos_token_id = hf.bos_token_id
        self.special_token_ids = list(hf.all_special_ids)
        self.tokens = [hf.decode([i]).encode("utf-8") if i < len(hf) else b"" for i in range(n_vocab)]
        self._hf = hf

    def __call__(self, s: str) -> list[int]:
        return list(self._hf.encode(s, add_special_tokens=False))


def _ll_tokenizer(hf: Any, n_vocab: int, eos: list[int]) -> Any:
    """llguidance's view of a transformers tokenizer: its own reading of a fast tokenizer's byte-level
    or SentencePiece vocabulary, else the tokens' decoded text (`_TokenBytes`)."""
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos or None)
    except (ValueError, RuntimeError):  # e.g. "can't determine decoder type" for a plain character vocabulary
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(hf, n_vocab)), n_vocab=n_vocab,
                                      eos_token=eos or None)


class GrammarMasks:
    """Matchers and logit masking for one engine (its tokenizer and vocabulary).

    Args:
        tokenizer: the engine's transformers (fast) tokenizer.
        vocab_size: V, the logits' last dimension (may exceed the tokenizer's size).
        eos_token_ids: the tokens that end a sequence (allowed once the grammar is complete).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf, self.vocab_size, self._eos = tokenizer, int(vocab_size), [int(t) for t in eos_token_ids]
        self._ll: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self._hf, self.vocab_size, self._eos)
            return self._ll

    def matchers(self, c: Constraint, n: int) -> list[Any]:
        """``n`` fresh matchers of `c` (one per stream).

        Raises:
            ValueError: the constraint does not compile (llguidance's message).
        """
        import llguidance

        first = llguidance.LLMatcher(self._tokenizer(), grammar_text(c), log_level=0)
        if first.is_error():
            raise ValueError(f"constraint does not compile: {first.get_error()}")
        return [first] + [first.deep_copy() for _ in range(n - 1)]

    def mask_(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """Set to -inf, in place, the logits [B, V] (float32) of tokens row b's matcher forbids.

        Rows whose matcher is None (unconstrained) or in an error state are left alone.
        """
        import llguidance.torch as lt

        rows = [b for b, m in enumerate(matchers) if m is not None and not m.is_error()]
        if not rows:
            return
        bits = lt.allocate_token_bitmask(len(rows), self._tokenizer().vocab_size)
        for j, b in enumerate(rows):
            lt.fill_next_token_bitmask(matchers[b], bits, j)
        sel = logits[rows].cpu()
        lt.apply_token_bitmask_inplace(sel, bits)
        logits[rows] = sel.to(logits.device)

    @staticmethod
    def advance(matcher: Any, token: int) -> bool:
        """Feed a sampled token to a matcher; False once it is finished (EOS taken) or in error."""
        return bool(matcher.consume_token(int(token))) and not matcher.is_stopped()
