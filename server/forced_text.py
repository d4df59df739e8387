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
follows vLLM's tool-call structural tag; ``response_format`` schemas, keys and values are left
alone), in rows where the grammar leaves at most :data:`MAX_ALLOWED` tokens:

- inside the tool's name (after ``{"name": "``; the names come from the request's structural
  tag), once the model's choice leaves one name that fits, the allowed tokens that spell more
  of it give their probability to the tokenizer's next token of that name: the model writes
  ``lookup`` as the tokenizer does. While several names fit (``lookup`` and ``locate`` after
  ``lo``) nothing changes: the choice between tools is the model's;
- a closing brace chosen where ``}}`` is allowed (the end of the arguments and of the call,
  one token for BPE) gives its probability to the longest chain of closing braces.

The choice depends only on the logits and the grammar, never on what is cached, so greedy
answers stay identical with the cache on and off. vLLM is imported here: only the server (its
engine processes) imports this module.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MAX_ALLOWED = 256
"""Rows whose grammar allows more tokens than this are free text and left alone."""

CLOSING = re.compile(r"[}\]]+")
BEGIN_NAME = re.compile(r'"name":\s*"([^"]+)"')
IN_NAME = re.compile(r'"name":\s*"([^"]*)$')
"""The output so far ends inside a tool call's name (``{"name": "lo``): vocabulary strings
joined, byte-level spaces (``Ġ``) read as spaces."""


def forced_chain(chosen: str, allowed: list[str]) -> list[int] | None:
    """Indices in ``allowed`` of ``chosen`` and the strings that extend it, shortest first, up
    to the longest that adds only closing brackets to closing brackets (the end of the
    arguments' JSON and the ``}`` that closes the call, which BPE writes as one ``}}``), when
    the strings of ``allowed`` that start with ``chosen`` form one chain (each a prefix of the
    next); ``None`` when they branch or no such string extends ``chosen``. Keys, values,
    whitespace and other punctuation stay the model's: a JSON grammar allows `` {"`` and `` {``
    then a newline, so a chain there is no forced text; and SmolLM2 nudged to whole-word keys
    (``setup`` for ``set``) was measured looping inside the next string to its token limit."""
    if not CLOSING.fullmatch(chosen):
        return None
    chain = sorted((i for i, s in enumerate(allowed) if s.startswith(chosen)),
                   key=lambda i: len(allowed[i]))  # fmt: skip
    for short, long in itertools.pairwise(chain):
        if not allowed[long].startswith(allowed[short]) or allowed[long] == allowed[short]:
            return None
    ok = [n for n, i in enumerate(chain) if n and CLOSING.fullmatch(allowed[i][len(chosen) :])]
    return chain[: ok[-1] + 1] if ok else None


def tool_names(params: Any) -> tuple[str, ...]:
    """The tool names a request's structural tag allows (from each tag's ``begin``, e.g.
    ``<tool_call>\n{"name": "lookup", "arguments": ``)."""
    try:
        tag = json.loads(params.structured_outputs.structural_tag)
    except (TypeError, ValueError):
        return ()
    names: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            begin = node.get("begin")
            if isinstance(begin, str) and (m := BEGIN_NAME.search(begin)):
                names.append(m.group(1))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(tag)
    return tuple(dict.fromkeys(names))


def _tool_call_grammar(params: Any) -> bool:
    """Whether a request's output follows a structural tag: vLLM's grammar for a forced (named or
    ``required``) tool call. ``response_format`` JSON schemas are left alone: that answer is
    usually a graph's last, not history a next call reuses, and SmolLM2 nudged to whole-word
    keys there was measured looping inside a string value to the token limit."""
    so = params.structured_outputs
    return so is not None and getattr(so, "structural_tag", None) is not None


class WholeForcedTokens(LogitsProcessor):
    """Forced tool names as the tokenizer spells them, closing braces merged (see the module
    doc). Not argmax-invariant:
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
        self.tokenizer = tokenizer
        self.spellings: dict[str, list[int]] = {}
        """Each tool name's token ids as the tokenizer spells it (computed once)."""
        self.rows: dict[int, tuple[list[int], tuple[str, ...]]] = {}
        """Batch rows whose request is a forced tool call (:func:`_tool_call_grammar`): their
        output token ids so far (vLLM's live list) and the tool names their grammar allows."""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(
            self.rows,
            batch_update,
            lambda params, _, out: (
                (out, tool_names(params)) if _tool_call_grammar(params) else None
            ),
        )

    def spelling(self, name: str) -> list[int]:
        """``name``'s token ids as the tokenizer writes it after ``{"name": "``."""
        if name not in self.spellings:
            self.spellings[name] = self.tokenizer(name, add_special_tokens=False)["input_ids"]
        return self.spellings[name]

    def name_token(self, typed: str, chosen: str, names: tuple[str, ...]) -> tuple[str, int] | None:
        """The one tool name that ``typed`` (the name so far) and the model's ``chosen`` token
        lead to, with the tokenizer's next token of it; ``None`` when several names still fit
        (the model's choice) or the name so far is not the tokenizer's spelling of its start."""
        fits = [n for n in names if (n + '"').startswith(typed + chosen) or
                ((typed + chosen).startswith(n + '"') and typed != n)]  # fmt: skip
        if len(fits) != 1 or typed == fits[0]:
            return None
        ids, spelled = self.spelling(fits[0]), ""
        for token in ids:
            if spelled == typed:
                return fits[0], token
            spelled += self.vocab[token] if token < len(self.vocab) else ""
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (output, names) in self.rows.items():
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
            tail = "".join(self.vocab[t] for t in output[-8:] if t < len(self.vocab))
            name = IN_NAME.search(tail.replace("Ġ", " "))
            if name is not None:
                # Inside the name: the tokens that spell more of it give their probability to
                # the tokenizer's next token of it.
                found = self.name_token(name.group(1), chosen, names)
                if found is None or found[1] not in ids:
                    continue
                full, token = found
                todo = full[len(name.group(1)) :] + '"'
                group = [i for i, t in zip(ids, strings, strict=True) if t and todo.startswith(t)]
                members = torch.tensor(
                    [*[i for i in group if i != token], token], device=logits.device
                )
            else:
                chain = forced_chain(chosen, strings)
                if chain is None:
                    continue
                # The chain spells one text: its probability goes to its longest token.
                members = torch.tensor([ids[k] for k in chain], device=logits.device)
            merged = torch.logsumexp(logits[row, members], dim=0)
            logits[row, members] = float("-inf")
            logits[row, members[-1]] = merged
        return logits
