"""``server/forced_text.py``: grammar-forced words in whole tokens, the model's choices kept.

The chain rule on strings, the processor on a real masked logits row with SmolLM2's
vocabulary (the mask a named tool choice leaves at the tool's name), and the server's argv.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
forced_text = pytest.importorskip("server.forced_text")


@pytest.mark.parametrize(
    ("chosen", "allowed", "expected"),
    [
        # the end of the arguments' JSON and the call's closing brace: BPE writes "}}"
        ("}", ["}", "}}", "}}\n", "\n"], ["}", "}}"]),
        # layout is the model's: " {" may be followed by a newline the vocabulary has no " {" for
        (" {", [" {", ' {"', " ", "\n"], None),
        # nothing extends the chosen token
        ("lookup", ["lookup", "s"], None),
    ],
)
def test_forced_chain(chosen: str, allowed: list[str], expected: list[str] | None) -> None:
    got = forced_text.forced_chain(chosen, allowed)
    assert (None if got is None else [allowed[i] for i in got]) == expected


def test_words_are_completed_only_inside_the_tool_name() -> None:
    """A key (``set`` -> ``setup``) stays the model's: outside the name only braces merge."""
    assert forced_text.forced_chain("set", ["set", "setup"]) is None
    got = forced_text.forced_chain("}", ["}", "}}"])
    assert got == [0, 1]


NAME_OPEN = '{"name":Ġ"'
"""A vocabulary string ending where a tool call's name starts (byte-level space ``Ġ``)."""


class _Tokenizer:
    """Spells a name as the given pieces (a tokenizer's BPE, for the unit tests)."""

    def __init__(self, vocab: list[str], spell: dict[str, list[str]]) -> None:
        self.vocab, self.spell = vocab, spell

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [self.vocab.index(p) for p in self.spell[text]]}


def _processor(vocab: list[str], rows: dict[int, Any], spell: dict | None = None) -> Any:
    proc = forced_text.WholeForcedTokens.__new__(forced_text.WholeForcedTokens)
    proc.vocab, proc.rows, proc.spellings = vocab, rows, {}
    proc.tokenizer = _Tokenizer(vocab, spell or {})
    return proc


def test_the_forced_word_gets_the_chain_probability_and_free_rows_are_untouched() -> None:
    vocab = ["<pad>", "l", "lo", "look", "lookup", "s", "search", "x", NAME_OPEN, "{"]
    minus = float("-inf")
    masked = [minus, 2.0, 0.5, 0.1, 1.0, 1.5, 0.2, minus, minus, minus]  # the names only
    free = [0.0, 2.0, 0.5, 0.1, 1.0, 1.5, 0.2, 0.3, 0.0, 0.0]  # not a forced tool call's row
    logits = torch.tensor([masked, free, masked, masked])
    name = ([9, 8], ("lookup", "search"))  # the output so far ends with {"name": "
    rows = {0: name, 2: name, 3: ([9], ("lookup", "search"))}
    spell = {"lookup": ["lookup"], "search": ["search"]}
    out = _processor(vocab, rows, spell).apply(logits.clone())
    merged = torch.logsumexp(torch.tensor([2.0, 0.5, 0.1, 1.0]), dim=0)
    for row in (0, 2):
        assert int(out[row].argmax()) == vocab.index("lookup")
        assert out[row, vocab.index("lookup")] == pytest.approx(float(merged))
        assert out[row, 1:4].tolist() == [minus] * 3
        assert torch.equal(out[row, 5:7], logits[row, 5:7])  # the other name keeps its chance
    assert torch.equal(out[1], logits[1])
    assert torch.equal(out[3], logits[3])  # not inside a name: the model's choice stands


def test_many_allowed_tokens_are_free_text() -> None:
    vocab = ["l", "lookup", *[f"w{i}" for i in range(forced_text.MAX_ALLOWED)]]
    row = torch.zeros(1, len(vocab))
    row[0, 0] = 5.0
    out = _processor(vocab, {0: ([], ())}).apply(row.clone())
    assert torch.equal(out, row)


def test_smollm2_vocabulary_spells_lookup_whole(smollm2_dir: Path) -> None:
    """The real tokenizer: the processor built as vLLM builds it reads the model's vocabulary,
    and at the name position of a forced ``lookup`` picks the token ``lookup``."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(tokenizer=str(smollm2_dir), tokenizer_revision=None)
    )
    proc = forced_text.WholeForcedTokens(config, torch.device("cpu"), False)
    ids = {s: i for i, s in enumerate(proc.vocab) if s in {"l", "lo", "look", "lookup", "oo"}}
    assert "lookup" in ids and "l" in ids
    logits = torch.full((1, len(proc.vocab) + 64), float("-inf"))  # vLLM pads the vocabulary
    for s in ("l", "lo", "look", "lookup"):
        if s in ids:
            logits[0, ids[s]] = 1.0
    logits[0, ids["l"]] = 3.0
    proc.update_state(None)
    # SmolLM2 writes '{"name": "' as {" name ": Ġ"
    prefix = [proc.vocab.index(t) for t in ('{"', "name", '":', 'Ġ"')]
    proc.rows = {0: (prefix, ("lookup", "search"))}
    assert int(proc.apply(logits)[0].argmax()) == ids["lookup"]


def test_the_server_passes_the_processor_unless_told_not_to(tiny_model_dir: Path) -> None:
    from server.config import ServerConfig
    from server.engine import FORCED_TEXT_PROCESSOR, vllm_argv

    module, cls = FORCED_TEXT_PROCESSOR.split(":")
    assert module == forced_text.__name__ and getattr(forced_text, cls).__name__ == cls
    argv = vllm_argv(ServerConfig(model=str(tiny_model_dir)))
    assert argv[argv.index("--logits-processors") + 1] == FORCED_TEXT_PROCESSOR
    off = vllm_argv(ServerConfig(model=str(tiny_model_dir), whole_forced_tokens=False))
    assert "--logits-processors" not in off
    own = ("--logits-processors", "my.module:Mine")
    theirs = vllm_argv(ServerConfig(model=str(tiny_model_dir), vllm_args=own))
    assert theirs.count("--logits-processors") == 1 and theirs[-1] == "my.module:Mine"


def test_only_forced_tool_calls_are_watched() -> None:
    """A structural tag (vLLM's grammar for a named or ``required`` tool choice) is watched; a
    ``response_format`` JSON schema and a plain request are not."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    begin = '<tool_call>\n{"name": "lookup", "arguments": '
    spec = json.dumps({"type": "structural_tag", "format": {"tags": [{"begin": begin}]}})
    tag = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=spec))
    schema = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    out: list[int] = [5]
    added = [(0, tag, None, out), (1, schema, None, []), (2, SamplingParams(), None, [])]
    proc = _processor([], {})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    assert list(proc.rows) == [0] and proc.rows[0][0] is out  # vLLM's live list
    assert proc.rows[0][1] == ("lookup",)
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=[]))
    assert proc.rows == {}


def test_a_name_is_written_as_the_tokenizer_spells_it_once_one_name_fits() -> None:
    """``Joke`` spelled ``J`` ``oke`` by the tokenizer: the model's ``Jo`` becomes ``J``; with
    two names starting ``lo``, the model's ``lo`` stands."""
    vocab = ["J", "Jo", "oke", "ke", "lo", "look", "lookup", "locate", "{", NAME_OPEN]
    minus = float("-inf")
    joke = [2.0, 3.0, minus, minus, minus, minus, minus, minus, minus, minus]
    names = [minus, minus, minus, minus, 3.0, 1.0, 0.5, 0.4, minus, minus]
    logits = torch.tensor([joke, names])
    rows = {0: ([8, 9], ("Joke",)), 1: ([8, 9], ("lookup", "locate"))}
    spell = {"Joke": ["J", "oke"], "lookup": ["lookup"], "locate": ["locate"]}
    out = _processor(vocab, rows, spell).apply(logits.clone())
    assert int(out[0].argmax()) == vocab.index("J")
    assert torch.equal(out[1], logits[1])
