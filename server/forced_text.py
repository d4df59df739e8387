"""Text a grammar forces is written in whole tokens, so the next turn's prompt reuses its KV.

Under structured outputs (a named or ``required`` tool choice, a JSON schema) vLLM masks the
logits to the tokens the grammar allows. Where the grammar forces a literal (a tool's name, a
JSON key, ``"arguments": ``) every token that spells a prefix of it is allowed, and the model's
argmax among them need not be the tokenizer's: SmolLM2 forced to ``"lookup"`` may write ``l``,
``oo``, ``k``, ``up``. The text is the same, but the chat template renders the tool call back as
text on the next call, the tokenizer spells it ``lookup``, and from that token on the cached
KV of the previous answer does not match: it is computed again.

:class:`WholeForcedTokens` is a vLLM logits processor (``--logits-processors``) that runs after
the grammar's mask and before sampling, only for forced tool calls (requests whose output
follows vLLM's tool-call structural tag; ``response_format`` schemas are left alone). In a row
where the grammar leaves few tokens (at most :data:`MAX_ALLOWED`, so the text is forced or a
choice among a few literals), it takes the token the model would pick, ``t``, and the allowed
tokens that extend ``t``; when those form one chain (each a prefix of the next: ``l``, ``lo``,
``look``, ``lookup``) that adds the rest of a word (or closing brackets to closing brackets),
the grammar is spelling it for the model, and the chain's probability goes to its longest
token: the same text in fewer, longer tokens, which is how BPE spells it (greedy picks it;
sampling keeps the text's probability). When the extensions branch (``lookup`` and ``locate``
both allowed after ``lo``) nothing changes, so the model's choice between literals is its own.
Free text (thousands of tokens allowed) is never touched.

The choice depends only on the logits and the grammar, never on what is cached, so greedy
answers stay identical with the cache on and off. vLLM is imported here: only the server (its
engine processes) imports this module.
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MAX_ALLOWED = 256
"""Rows whose grammar allows more tokens than this are free text and left alone."""

WORD = re.compile(r"[A-Za-z0-9_]+")
CLOSING = re.compile(r"[}\]]+")


def _spelled(chosen: str, extension: str) -> bool:
    """Whether a chain may add ``extension`` to ``chosen``: the rest of a word (a name, a key, an
    enum value), or more closing brackets after closing brackets (the end of the arguments'
    JSON and the ``}`` that closes the call, which BPE writes as one ``}}``). Other whitespace
    and punctuation are the model's: a JSON grammar allows `` {"`` and `` {`` then a newline,
    so a chain there is no forced text and extending it would change the answer's layout."""
    if WORD.fullmatch(extension):
        return True
    return bool(CLOSING.fullmatch(chosen) and CLOSING.fullmatch(extension))


def forced_chain(chosen: str, allowed: list[str]) -> list[int] | None:
    """Indices in ``allowed`` of ``chosen`` and the strings that extend it, shortest first, up
    to the longest that :func:`_spelled` accepts, when the strings of ``allowed`` that start with
    ``chosen`` form one chain (each a prefix of the next); ``None`` when they branch (a choice
    the model makes itself) or no accepted string extends ``chosen``."""
    chain = sorted((i for i, s in enumerate(allowed) if s.startswith(chosen)),
                   key=lambda i: len(allowed[i]))  # fmt: skip
    for short, long in itertools.pairwise(chain):
        if not allowed[long].startswith(allowed[short]) or allowed[long] == allowed[short]:
            return None
    ok = [n for n, i in enumerate(chain) if n and _spelled(chosen, allowed[i][len(chosen) :])]
    return chain[: ok[-1] + 1] if ok else None


def _tool_call_grammar(params: Any) -> bool:
    """Whether a request's output follows a structural tag: vLLM's grammar for a forced (named or
    ``required``) tool call. ``response_format`` JSON schemas are left alone: that answer is
    usually a graph's last, not history a next call reuses, and SmolLM2 nudged to whole-word
    keys there was measured looping inside a string value to the token limit."""
    so = params.structured_outputs
    return so is not None and getattr(so, "structural_tag", None) is not None


class WholeForcedTokens(LogitsProcessor):
    """Forced text in the longest allowed tokens (see the module doc). Not argmax-invariant:
    it changes greedy choices, so vLLM runs it for greedy requests too."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        from transformers import AutoTokenizer

        model = vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer, revision=model.tokenizer_revision, trust_remote_code=False
        )
        # Raw vocabulary strings (byte-level BPE: a space is "Ġ"), one per id, so prefixes of
        # strings are prefixes of text. Ids past the tokenizer's vocabulary (padding) map to "".
        strings = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.vocab = [s if isinstance(s, str) else "" for s in strings]
        self.rows: dict[int, bool] = {}
        """Batch rows whose request is a forced tool call (:func:`_tool_call_grammar`)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.rows,
            batch_update,
            lambda params, _, __: True if _tool_call_grammar(params) else None,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row in self.rows:
            if row >= logits.shape[0]:
                continue
            finite = torch.isfinite(logits[row])
            n = int(finite.sum())
            if n < 2 or n > MAX_ALLOWED:
                continue
            ids = finite.nonzero().flatten().tolist()
            best = int(logits[row].argmax())
            strings = [self.vocab[i] if i < len(self.vocab) else "" for i in ids]
            chosen = self.vocab[best] if best < len(self.vocab) else ""
            if not chosen:
                continue
            chain = forced_chain(chosen, strings)
            if chain is None:
                continue
            # The chain spells one text: its probability goes to its longest token.
            members = torch.tensor([ids[k] for k in chain], device=logits.device)
            merged = torch.logsumexp(logits[row, members], dim=0)
            logits[row, members] = float("-inf")
            logits[row, members[-1]] = merged
        return logits
