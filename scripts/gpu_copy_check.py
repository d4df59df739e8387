"""The connector's own GPU copy path, checked with torch alone (no vLLM, no package index).

    python scripts/gpu_copy_check.py                 # on CUDA: about a minute, prints figures
    python scripts/gpu_copy_check.py --device cpu --quick   # the same checks on CPU (the suite)

A GPU machine lent for a few minutes has PyTorch with CUDA but no vLLM and no package index, so
this script imports only torch and the worker's torch-only modules (``server.kv.tiers.ram``,
``server.kv.tiers.codec``, ``server.kv.worker.kv_views``); carry the repository and run it.

What it does, each on the paged cache layouts vLLM's GPU backends use:

- FlashAttention's ``[2, num_blocks, block_size, kv_heads, head_dim]`` per layer and MLA's
  latent ``[num_blocks, block_size, latent_dim]``, viewed block-first as the worker views them
  (:func:`~server.kv.worker.kv_views.block_first_views`);
- **bytes**: random blocks saved into the RAM pool (pinned on CUDA) and loaded back into other
  paged blocks, every layer at once and layer by layer, must come back bit for bit (``auto``)
  or within the codec's bound (``int8``); the cache's other blocks are left untouched;
- **link**: pinned host <-> device bandwidth of one large copy, the ceiling;
- **blocks**: save (device -> pool) and load (pool -> device) of 1, 8, 32, 128 blocks of every
  layer, in GB/s and as a share of the link (goal: >= 80% for loads of 8+ blocks);
- **overlap**: a load of 32 blocks issued while a compute stream runs matmuls, against each
  alone: the share of the shorter one hidden (1.0: fully overlapped).

Exit status 1 when a byte check fails; figures never fail it. On CPU the pool is told to take
the batched (CUDA) path too (``RamPool(batched=True)``), so its indexing and codec are checked
here; transfer figures on CPU are memory copies, not a link.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.kv.groups import LayerBlocks
from server.kv.tiers.codec import BlockCodec
from server.kv.tiers.manifest import Manifest
from server.kv.tiers.ram import RamPool
from server.kv.worker.kv_views import block_first_views

GOAL_SHARE = 0.8
"""Loads of 8+ blocks should reach this share of the measured link bandwidth."""


@dataclass(frozen=True)
class Geometry:
    """One model's paged cache, as vLLM allocates it on the GPU."""

    name: str
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    latent_dim: int
    num_blocks: int
    dtype: torch.dtype

    def layer_shape(self, layout: str) -> tuple[int, ...]:
        if layout == "mla":
            return (self.num_blocks, self.block_size, self.latent_dim)
        return (2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)


FULL = Geometry("8B-like", 32, 16, 8, 128, 576, 640, torch.bfloat16)
"""A Llama-3-8B-shaped cache (MLA: DeepSeek's 576-wide latent): 2 MiB per block of all layers."""
QUICK = Geometry("tiny", 4, 16, 2, 16, 48, 48, torch.float32)
"""Small enough for a CPU test in a few seconds."""


class Check:
    """The report: lines printed as they come, and whether every byte check passed."""

    def __init__(self, out: Path | None) -> None:
        self.lines: list[str] = []
        self.failed: list[str] = []
        self.out = out

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def expect(self, ok: bool, what: str) -> None:
        self.say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failed.append(what)

    def save(self) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_copy_check.txt").write_text("\n".join(self.lines) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up, device work included."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def link_gbps(device: torch.device, mib: int, reps: int) -> tuple[float, float]:
    """Pinned host -> device and device -> host GB/s of one ``mib`` MiB copy."""
    pin = device.type == "cuda"
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), device, reps)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), device, reps)
    return (mib << 20) / h2d / 1e9, (mib << 20) / d2h / 1e9


def build(geo: Geometry, layout: str, offload: str, device: torch.device, batched: bool | None):
    """A random paged cache of ``geo`` in ``layout``, its block-first views, and a pool."""
    names = [f"model.layers.{i}.attn" for i in range(geo.layers)]
    caches = {n: torch.randn(geo.layer_shape(layout), device=device).to(geo.dtype) for n in names}
    per_block = caches[names[0]].numel() // geo.num_blocks * caches[names[0]].element_size()
    views = block_first_views(caches, names, [per_block] * geo.layers, geo.num_blocks)
    manifest = Manifest(  # the connector's own description of a block, and its format
        model_id=geo.name,
        dtype=str(geo.dtype),
        block_size=geo.block_size,
        layers=tuple(names),
        layer_block_bytes=(per_block,) * geo.layers,
        hash_scheme="gpu-copy-check",
        offload_dtype=offload,
        kv_heads=1 if layout == "mla" else geo.kv_heads,
    )
    fmt = manifest.block_format
    codec = BlockCodec(fmt, [tuple(v.shape[1:]) for v in views])
    pool = RamPool(geo.num_blocks // 2, codec, batched=batched)
    return views, pool


def check_bytes(check: Check, geo: Geometry, layout: str, offload: str, device, batched) -> None:
    views, pool = build(geo, layout, offload, device, batched)
    n = min(8, pool.num_slots)
    src = list(range(1, 1 + n))  # block 0 is vLLM's null block: never copied
    dst = list(range(geo.num_blocks - n, geo.num_blocks))
    slots = list(range(pool.num_slots - n, pool.num_slots))
    expected = [v[src].clone() for v in views]
    untouched = [v[n + 1 : geo.num_blocks - n].clone() for v in views]
    pool.save(views, LayerBlocks(src), slots)
    for how in ("every layer", "layer by layer"):
        for v in views:
            v[dst] = 0
        if how == "every layer":
            pool.load(views, slots, LayerBlocks(dst))
        else:
            for i in range(len(views)):
                pool.load_layer(views, i, slots, dst)
        sync(device)
        got = [v[dst] for v in views]
        if offload == "auto":
            ok = all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
            bound = "bit for bit"
        else:  # int8: per (head, K/V) row groups, error within a step of the scale
            worst = max(
                float(((g.float() - e.float()).abs().max() / e.float().abs().max()).item())
                for g, e in zip(got, expected, strict=True)
            )
            ok, bound = worst < 0.02, f"max error {worst:.4f} of the largest value (< 0.02)"
        same = all(
            torch.equal(v[n + 1 : geo.num_blocks - n], u)
            for v, u in zip(views, untouched, strict=True)
        )
        path = "batched" if pool.is_batched(views[0]) else "per block"
        check.expect(
            ok and same,
            f"{layout:10} {offload:5} {path:9} {how:14}: {n} blocks back {bound}; "
            "other blocks untouched",
        )


def transfer_figures(check: Check, geo: Geometry, device, link_h2d: float, reps: int) -> None:
    views, pool = build(geo, "flash_attn", "auto", device, None)
    block_bytes = pool.block_bytes
    check.say(f"blocks of {block_bytes / 2**20:.2f} MiB (all {geo.layers} layers), pool pinned: "
              f"{pool.buffer.is_pinned() if device.type == 'cuda' else 'n/a (cpu)'}")  # fmt: skip
    check.say("  blocks  save GB/s  load GB/s  load / link")
    for n in (1, 8, 32, 128):
        if n > min(pool.num_slots, geo.num_blocks - 1):
            continue
        blocks, slots = LayerBlocks(list(range(1, 1 + n))), list(range(n))
        save = timed(lambda: pool.save(views, blocks, slots), device, reps)  # noqa: B023
        load = timed(lambda: pool.load(views, slots, blocks), device, reps)  # noqa: B023
        gb = n * block_bytes / 1e9
        share = gb / load / link_h2d
        goal = "" if n < 8 or device.type != "cuda" else ("  goal met" if share >= GOAL_SHARE
                                                          else "  below goal")  # fmt: skip
        check.say(f"  {n:6}  {gb / save:9.2f}  {gb / load:9.2f}  {share:10.2f}{goal}")


def overlap_figure(check: Check, geo: Geometry, device, reps: int) -> None:
    if device.type != "cuda":
        check.say("overlap: n/a on cpu (no streams)")
        return
    views, pool = build(geo, "flash_attn", "auto", device, None)
    n = min(32, pool.num_slots)
    blocks, slots = LayerBlocks(list(range(1, 1 + n))), list(range(n))
    pool.save(views, blocks, slots)
    side = torch.cuda.Stream(device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    load_s = timed(lambda: pool.load(views, slots, blocks), device, reps)
    one = timed(lambda: a @ a, device, reps)
    matmuls = max(1, round(load_s / one))

    def compute() -> None:
        with torch.cuda.stream(side):
            for _ in range(matmuls):
                a @ a

    def both() -> None:
        compute()
        pool.load(views, slots, blocks)

    compute_s = timed(compute, device, reps)
    both_s = timed(both, device, reps)
    hidden = (compute_s + load_s - both_s) / min(compute_s, load_s)
    check.say(f"overlap: load of {n} blocks {load_s * 1e3:.2f} ms, compute {compute_s * 1e3:.2f} "
              f"ms ({matmuls} matmuls on a side stream), both {both_s * 1e3:.2f} ms: "
              f"{max(0.0, hidden):.2f} of the shorter hidden")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny cache (the suite's CPU run)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link-mib", type=int, default=256)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    geo = QUICK if args.quick else FULL
    check = Check(args.out)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    check.say(f"torch {torch.__version__}, device {name}, geometry {geo}")
    check.say("bytes:")
    batched = True if device.type == "cpu" else None  # the CUDA path's indexing, on CPU too
    for layout, offload in (("flash_attn", "auto"), ("flash_attn", "int8"), ("mla", "auto")):
        check_bytes(check, geo, layout, offload, device, batched)
    if device.type == "cpu":
        check_bytes(check, geo, "flash_attn", "auto", device, False)  # the CPU path
    mib = 16 if args.quick else args.link_mib
    h2d, d2h = link_gbps(device, mib, args.reps)
    check.say(f"link: host -> device {h2d:.2f} GB/s, device -> host {d2h:.2f} GB/s ({mib} MiB)")
    transfer_figures(check, geo, device, h2d, args.reps)
    overlap_figure(check, geo, device, args.reps)
    check.say(f"byte checks: {'all passed' if not check.failed else f'{len(check.failed)} FAILED'}")
    check.save()
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
