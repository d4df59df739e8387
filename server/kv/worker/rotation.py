"""Keys moved to other positions: re-rotated by the position difference with the model's own
rotary embedding.

vLLM stores keys after the rotary embedding: the key of a token at position ``p`` is its raw
key with each pair of components rotated by ``p * theta_i``. Rotations of a plane compose, so
the key the same raw key would have at ``p + delta`` is the stored key rotated by
``delta * theta_i`` (CachedAttention's position re-embedding, done on stored keys). The angles
come from the rotary embedding vLLM built for the model (``get_rope`` keeps every instance it
made in ``_ROPE_DICT``): its ``_compute_cos_sin_cache`` in float32, so scaled variants (linear,
NTK, Llama 3, YaRN without magnitude scaling) rotate as the model does. Neox style rotates the
two halves of the rotary dimensions, GPT-J style interleaved pairs.

Not supported (``Rotation.from_model`` says why): models with no rotary embedding (ALiBi,
learned positions), with several (Gemma 3's local and global bases), multimodal position
schemes (M-RoPE and other subclasses not listed), and cos/sin tables whose rows are not unit
rotations (magnitude scaling).
"""

from __future__ import annotations

import torch

_PLAIN_ROPES = {
    "RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding",
    "NTKScalingRotaryEmbedding",
    "Llama3RotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
}
"""vLLM rotary embeddings whose forward is the plain rotation by ``position * theta``."""


class Rotation:
    """Rotates keys ``[tokens, heads, head_size]`` by a per-token position difference."""

    def __init__(self, cos_sin: torch.Tensor, rotary_dim: int, neox: bool) -> None:
        self.cos_sin = cos_sin.float()
        """``[positions, rotary_dim]``: cos of every angle, then sin (vLLM's cache layout)."""
        self.rotary_dim = rotary_dim
        self.neox = neox

    @classmethod
    def from_model(cls) -> tuple[Rotation | None, str]:
        """The rotation of the model vLLM loaded in this process, or None and why not."""
        try:
            from vllm.model_executor.layers import rotary_embedding
        except ImportError:
            return None, "vLLM's rotary embeddings cannot be imported"
        ropes = {id(r): r for r in rotary_embedding._ROPE_DICT.values()}
        if len(ropes) != 1:
            return None, f"the model has {len(ropes)} rotary embeddings (one is supported)"
        rope = next(iter(ropes.values()))
        name = type(rope).__name__
        if name not in _PLAIN_ROPES:
            return None, f"its rotary embedding ({name}) is not supported"
        cos_sin = rope._compute_cos_sin_cache().float()
        half = rope.rotary_dim // 2
        norm = cos_sin[1:, :half] ** 2 + cos_sin[1:, half:] ** 2
        if not torch.allclose(norm, torch.ones_like(norm), atol=1e-4):
            return None, f"its rotary embedding ({name}) scales magnitudes"
        return cls(cos_sin, rope.rotary_dim, bool(rope.is_neox_style)), ""

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys`` (``[tokens, heads, head_size]``) rotated by ``delta`` (``[tokens]``,
        positions, negative moves them earlier), in ``keys``' dtype."""
        if int(delta.abs().max()) >= self.cos_sin.shape[0]:
            raise ValueError(
                f"a shift of {int(delta.abs().max())} positions is past the rotary table "
                f"({self.cos_sin.shape[0]} positions)"
            )
        half = self.rotary_dim // 2
        rows = self.cos_sin[delta.abs()]
        cos = rows[:, None, :half]
        sin = rows[:, None, half:] * torch.sign(delta).to(rows.dtype)[:, None, None]
        out = keys.clone()
        rot = keys[..., : self.rotary_dim].float()
        if self.neox:
            x1, x2 = rot[..., :half], rot[..., half:]
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        if self.neox:
            out[..., :half] = y1.to(keys.dtype)
            out[..., half : self.rotary_dim] = y2.to(keys.dtype)
        else:
            out[..., 0 : self.rotary_dim : 2] = y1.to(keys.dtype)
            out[..., 1 : self.rotary_dim : 2] = y2.to(keys.dtype)
        return out
