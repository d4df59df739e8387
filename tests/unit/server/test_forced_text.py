"""``server/forced_text.py``: grammar-forced words in whole tokens, the model's choices kept.

The chain rule on strings, the processor on a real masked logits row with SmolLM2's
vocabulary (the mask a named tool choice leaves at the tool's name), and the server's argv.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
forced_text = pytest.importorskip("server.forced_text")


@pytest.mark.parametrize(
    ("chosen", "allowed", "expected"),
    [
        # a forced name: the model picked "l", the grammar spells "lookup"
        ("l", ["l", "lo", "look", "lookup", "s", "se", "search"], ["l", "lo", "look", "lookup"]),
        ("t", ["t", "ti", "title"], ["t", "ti", "title"]),
        # the end of the arguments' JSON and the call's closing brace: BPE writes "}}"
        ("}", ["}", "}}", "}}\n", "\n"], ["}", "}}"]),
        # two literals share "lo": the model chooses, nothing changes
        ("lo", ["lo", "look", "loc", "locate"], None),
        # layout is the model's: " {" may be followed by a newline the vocabulary has no " {" for
        (" {", [" {", ' {"', " ", "\n"], None),
        # nothing extends the chosen token
        ("lookup", ["lookup", "s"], None),
    ],
)
def test_forced_chain(chosen: str, allowed: list[str], expected: list[str] | None) -> None:
    got = forced_text.forced_chain(chosen, allowed)
    assert (None if got is None else [allowed[i] for i in got]) == expected


def _processor(vocab: list[str], rows: dict[int, bool]) -> Any:
    proc = forced_text.WholeForcedTokens.__new__(forced_text.WholeForcedTokens)
    proc.vocab, proc.rows = vocab, rows
    return proc


def test_the_forced_word_gets_the_chain_probability_and_free_rows_are_untouched() -> None:
    vocab = ["<pad>", "l", "lo", "look", "lookup", "s", "search", "x"]
    minus = float("-inf")
    masked = [minus, 2.0, 0.5, 0.1, 1.0, 1.5, 0.2, minus]  # the grammar allows the names only
    free = [0.0, 2.0, 0.5, 0.1, 1.0, 1.5, 0.2, 0.3]  # free text: not a structured-output row
    logits = torch.tensor([masked, free, masked])
    out = _processor(vocab, {0: True, 2: True}).apply(logits.clone())
    merged = torch.logsumexp(torch.tensor([2.0, 0.5, 0.1, 1.0]), dim=0)
    for row in (0, 2):
        assert int(out[row].argmax()) == vocab.index("lookup")
        assert out[row, vocab.index("lookup")] == pytest.approx(float(merged))
        assert out[row, 1:4].tolist() == [minus] * 3
        assert torch.equal(out[row, 5:7], logits[row, 5:7])  # the other name keeps its chance
    assert torch.equal(out[1], logits[1])


def test_many_allowed_tokens_are_free_text() -> None:
    vocab = ["l", "lookup", *[f"w{i}" for i in range(forced_text.MAX_ALLOWED)]]
    row = torch.zeros(1, len(vocab))
    row[0, 0] = 5.0
    out = _processor(vocab, {0: True}).apply(row.clone())
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
    proc.rows = {0: True}
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

    tag = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag="{}"))
    schema = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    added = [(0, tag, None, []), (1, schema, None, []), (2, SamplingParams(), None, [])]
    proc = _processor([], {})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    assert proc.rows == {0: True}
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=[]))
    assert proc.rows == {}
