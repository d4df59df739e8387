"""``--kv-offload-dtype``: stored sizes, codec round trips per format, the worker and the disk
tier with compressed blocks (a corrupted or other-format block is a miss)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from server.config import ConfigError, ServerConfig, env_settings  # noqa: E402
from server.kv.formats import OFFLOAD_DTYPES, SCALE_GROUP, BlockFormat, FormatError  # noqa: E402
from server.kv.metadata import NO_SLOT, LoadItem, LoadJob, SaveItem, StepPlan  # noqa: E402
from server.kv.settings import ConnectorSettings, SettingsError  # noqa: E402
from server.kv.tiers.block_frame import PAGE  # noqa: E402
from server.kv.tiers.codec import BlockCodec, fp8_available  # noqa: E402
from server.kv.tiers.disk import DiskStore  # noqa: E402
from server.kv.tiers.manifest import Manifest  # noqa: E402
from server.kv.worker.worker import SessionKVWorker  # noqa: E402

HEADS, TOKENS, DIM = 2, 8, 16
SHAPE = (HEADS, 2 * TOKENS, DIM)  # vLLM CPU layout of one block: [heads, K rows + V rows, dim]
NUMEL = HEADS * 2 * TOKENS * DIM
LAYERS = ["l0", "l1"]
NUM_BLOCKS = 12
KEYS = [f"{i:02x}" * 32 for i in range(8)]
FORMATS = [f for f in OFFLOAD_DTYPES if f != "fp8" or fp8_available()]


def fmt(name: str) -> BlockFormat:
    return BlockFormat(name, "float32", (NUMEL * 4,) * len(LAYERS), HEADS, TOKENS)


def blocks(n: int = 4, seed: int = 0) -> torch.Tensor:
    """KV-like blocks: normal values, an outlier channel, a loud first token (an attention
    sink) and one head 100x larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=g)
    x[..., 3] *= 8.0  # outlier channel, as keys have
    x[:, :, 0] *= 50.0  # the first token's keys
    x[:, 1] *= 100.0
    return x


def amax(x: torch.Tensor) -> torch.Tensor:
    """Each element's scale group absmax: its row (one head, one token, keys or values)."""
    return x.abs().amax(dim=-1, keepdim=True).expand_as(x)


def half_range(x: torch.Tensor) -> torch.Tensor:
    """Each element's row's ``(max - min) / 2``: what the centered scale spans."""
    lo, hi = x.aminmax(dim=-1, keepdim=True)
    return ((hi - lo) / 2).expand_as(x)


SCALES = 2 * 2 * HEADS * TOKENS  # a scale and a center per row


def test_stored_sizes_and_ratio() -> None:
    assert fmt("auto").block_bytes == 2 * NUMEL * 4 and fmt("auto").ratio == 1.0
    assert fmt("float16").block_bytes == 2 * NUMEL * 2 and fmt("bfloat16").ratio == 2.0
    int8 = fmt("int8")
    assert int8.block_bytes == 2 * (NUMEL + SCALES * 2)
    assert int8.ratio == 4 * NUMEL / (NUMEL + SCALES * 2) < 4
    assert fmt("fp8").block_bytes == int8.block_bytes
    with pytest.raises(FormatError, match="one of"):
        BlockFormat("int4", "float32", (NUMEL * 4,))
    with pytest.raises(FormatError, match="do not divide"):
        BlockFormat("int8", "float32", (NUMEL * 4,), 3, TOKENS)


def test_auto_round_trip_is_bit_exact() -> None:
    x = blocks()
    x[0, 0, 0, 0] = float("nan")  # even NaN bit patterns survive
    codec = BlockCodec(fmt("auto"), [SHAPE, SHAPE])
    data, scales = codec.encode(x)
    assert scales is None and data.dtype == torch.uint8 and data.shape == (4, NUMEL * 4)
    back = codec.decode(0, data, None)
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_round_trip_within_rounding(name: str) -> None:
    x = blocks()
    codec = BlockCodec(fmt(name), [SHAPE, SHAPE])
    data, scales = codec.encode(x)
    assert scales is None and data.shape == (4, NUMEL * 2)
    back = codec.decode(1, data, None)
    assert back.dtype == torch.float32 and back.shape == x.shape
    rel = 2.0**-11 if name == "float16" else 2.0**-8  # half a unit in the last place
    assert torch.all((back - x).abs() <= rel * x.abs() + 1e-6)
    assert not torch.equal(back, x)  # it did compress


def test_float16_saturates_instead_of_overflowing() -> None:
    x = torch.full((1, *SHAPE), 1e6)
    codec = BlockCodec(fmt("float16"), [SHAPE, SHAPE])
    back = codec.decode(0, *codec.encode(x))
    assert torch.isfinite(back).all() and back.max().item() == 65504.0


def test_int8_error_at_most_half_a_step_per_group() -> None:
    x = blocks()
    codec = BlockCodec(fmt("int8"), [SHAPE, SHAPE])
    data, scales = codec.encode(x)
    assert data.shape == (4, NUMEL) and scales is not None and scales.shape == (4, SCALES)
    kept = x.clone()
    back = codec.decode(0, data, scales)
    assert torch.equal(x, kept), "encode changed its input"
    # Half a step of the (float16-rounded) scale, plus the scale's and the center's own
    # rounding at the clamp.
    err = (back - x).abs()
    assert torch.all(err <= half_range(x) * (1 / 254 + 2.0**-11) + amax(x) * 2.0**-11)
    assert torch.all(err <= amax(x) * (1 / 254 + 2.0**-10))
    # Per-row scales: the quiet head keeps its precision next to the 100x head, and the
    # other tokens theirs next to the loud first token.
    assert (back - x)[:, 0].abs().max() < x[:, 1].abs().max() / 254 / 50
    assert (back - x)[:, :, 1:].abs().max() < x[:, :, 0].abs().amax() / 254 / 4


def test_int8_rows_away_from_zero_spend_their_levels_on_their_own_range() -> None:
    # A key channel sitting at +40 with a spread of +-1 (channel offsets, as SmolLM2's keys
    # have): plain absmax would step by 41/127; the centered scale by 1/127.
    g = torch.Generator().manual_seed(1)
    x = 40.0 + torch.rand(3, *SHAPE, generator=g) * 2 - 1
    codec = BlockCodec(fmt("int8"), [SHAPE, SHAPE])
    back = codec.decode(0, *codec.encode(x))
    assert (back - x).abs().max() <= 1 / 254 + 40 * 2.0**-11
    assert (back - x).abs().max() < 41 / 254 / 10


def test_int8_rows_of_64_get_a_scale_per_32_elements() -> None:
    # SmolLM2's geometry: 64-element rows split into two groups of SCALE_GROUP (32).
    heads, tokens, dim = 2, 4, 64
    shape = (heads, 2 * tokens, dim)
    numel = heads * 2 * tokens * dim
    f = BlockFormat("int8", "float32", (numel * 4,), heads, tokens)
    assert f.group_size(0) == SCALE_GROUP == 32 and f.num_scales(0) == 2 * numel // 32
    assert f.block_bytes == numel + 2 * (numel // 32) * 2 and f.ratio == 4 * 32 / 36
    x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(2))
    x[..., :32] *= 100.0  # a loud first half of every row
    codec = BlockCodec(f, [shape])
    data, scales = codec.encode(x)
    assert scales is not None and scales.shape == (3, 2 * numel // 32)
    back = codec.decode(0, data, scales)
    quiet = x[..., 32:]
    # the quiet half keeps its own step, 100x finer than the loud half's
    assert (back - x)[..., 32:].abs().max() <= quiet.abs().max() * (1 / 127 + 2.0**-10)


@pytest.mark.skipif(not fp8_available(), reason="torch without float8_e4m3fn")
def test_fp8_error_relative_to_each_value() -> None:
    x = blocks()
    codec = BlockCodec(fmt("fp8"), [SHAPE, SHAPE])
    data, scales = codec.encode(x)
    back = codec.decode(1, data, scales)
    lo, hi = x.aminmax(dim=-1, keepdim=True)
    centered = (x - (lo + hi) / 2).abs()
    # 3 mantissa bits of x - c, the subnormal step, and the center's float16 rounding.
    bound = centered * 2.0**-4 + amax(x) * (2.0**-9 / 448 + 2.0**-10)
    assert torch.all((back - x).abs() <= bound * 1.0001)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_all_zero_blocks_decode_to_zero(name: str) -> None:
    if name == "fp8" and not fp8_available():
        pytest.skip("torch without float8_e4m3fn")
    codec = BlockCodec(fmt(name), [SHAPE, SHAPE])
    back = codec.decode(0, *codec.encode(torch.zeros(2, *SHAPE)))
    assert torch.equal(back, torch.zeros(2, *SHAPE))


def test_codec_rejects_a_shape_of_another_format() -> None:
    with pytest.raises(FormatError, match="does not match"):
        BlockCodec(fmt("int8"), [SHAPE, (HEADS, TOKENS, DIM)])


def manifest(name: str) -> Manifest:
    layout = ("m", "torch.float32", TOKENS, tuple(LAYERS), (NUMEL * 4,) * 2, "x")
    return Manifest(*layout, offload_dtype=name, kv_heads=HEADS)


def test_manifest_fingerprint_per_format_and_auto_unchanged() -> None:
    prints = {name: manifest(name).fingerprint() for name in OFFLOAD_DTYPES}
    assert len(set(prints.values())) == len(OFFLOAD_DTYPES)
    legacy = Manifest("m", "torch.float32", TOKENS, tuple(LAYERS), (NUMEL * 4,) * 2, "x")
    assert prints["auto"] == legacy.fingerprint()  # files written before the flag stay valid
    assert manifest("int8").block_bytes == fmt("int8").block_bytes
    assert manifest("auto").block_bytes == 2 * NUMEL * 4


def make_worker(tmp_path: Path, name: str, kv: dict[str, torch.Tensor]) -> SessionKVWorker:
    m = manifest(name)
    worker = SessionKVWorker(
        num_slots=4,
        layers=LAYERS,
        layer_block_bytes=list(m.layer_block_bytes),
        store=DiskStore(tmp_path, m),
        block_format=m.block_format,
    )
    worker.register_kv_caches(kv, NUM_BLOCKS)
    return worker


def caches() -> dict[str, torch.Tensor]:
    return {
        n: torch.cat([blocks(NUM_BLOCKS // 2, i), blocks(NUM_BLOCKS // 2, 9 + i)])
        for i, n in enumerate(LAYERS)
    }


def wait_written(worker: SessionKVWorker, n: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(worker._report.written) < n:
        worker.collect()
        time.sleep(0.01)


def drain(worker: SessionKVWorker) -> tuple[set[str], set[int]]:
    finished: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + 10
    while not finished and time.monotonic() < deadline:
        f, e = worker.collect()
        finished |= f
        errors |= e
        time.sleep(0.01)
    return finished, errors


@pytest.mark.parametrize("name", FORMATS)
def test_worker_ram_and_disk_round_trip(tmp_path: Path, name: str) -> None:
    kv = caches()
    worker = make_worker(tmp_path, name, kv)
    assert worker.pool is not None and worker.pool.block_bytes == manifest(name).block_bytes
    codec = worker.codec
    assert codec is not None
    expected = {n: codec.decode(i, *codec.encode(kv[n][[2, 3]])) for i, n in enumerate(LAYERS)}
    worker.save(StepPlan(saves=[SaveItem(2, KEYS[0], 0, True), SaveItem(3, KEYS[1], 1, True)]))
    wait_written(worker, 2)
    assert worker.store is not None
    size = worker.store.path(KEYS[0]).stat().st_size
    assert size <= worker.store.file_bytes and size > manifest(name).block_bytes
    ram = LoadJob("r", (LoadItem(8, KEYS[0], 0, "ram"),), False)
    disk = LoadJob("d", (LoadItem(9, KEYS[1], NO_SLOT, "disk"),), True)
    worker.start_load(StepPlan(loads=[ram, disk]))
    assert drain(worker) == ({"d"}, set())  # collect waits for the RAM load's last layer
    for n in LAYERS:
        assert torch.equal(kv[n][8], expected[n][0])  # RAM: decoded exactly as the codec says
        assert torch.equal(kv[n][9], expected[n][1])  # disk: the same bytes
        if name == "auto":
            assert torch.equal(kv[n][8], kv[n][2])
    worker.shutdown()


def test_corrupted_compressed_block_is_a_miss(tmp_path: Path) -> None:
    kv = caches()
    worker = make_worker(tmp_path, "int8", kv)
    before = {n: kv[n][10].clone() for n in LAYERS}
    worker.save(StepPlan(saves=[SaveItem(4, KEYS[2], 2, True)]))
    wait_written(worker, 1)
    assert worker.store is not None
    path = worker.store.path(KEYS[2])
    raw = bytearray(path.read_bytes())
    raw[PAGE + worker.store.manifest.block_bytes - 3] ^= 0x40  # in the last layer's scales
    path.write_bytes(bytes(raw))
    worker.start_load(
        StepPlan(loads=[LoadJob("r", (LoadItem(10, KEYS[2], NO_SLOT, "disk"),), True)])
    )
    finished, errors = drain(worker)
    assert finished == {"r"} and errors == {10}  # vLLM recomputes block 10
    for n in LAYERS:
        assert torch.equal(kv[n][10], before[n])  # never overwritten with bad KV
    report = worker.take_report()
    assert report is not None and report.read_failed == [KEYS[2]]
    worker.shutdown()


def test_blocks_of_another_format_are_a_miss(tmp_path: Path) -> None:
    kv = caches()
    worker = make_worker(tmp_path, "int8", kv)
    worker.save(StepPlan(saves=[SaveItem(1, KEYS[3], 0, True)]))
    wait_written(worker, 1)
    worker.shutdown()
    other = DiskStore(tmp_path, manifest("float16"))
    assert other.scan() == {}  # another folder: a restart with float16 sees no int8 files
    out = torch.empty(manifest("float16").block_bytes, dtype=torch.uint8)
    with pytest.raises(OSError, match="missing"):
        other.read_into(KEYS[3], memoryview(out.numpy()))


def test_settings_and_config_validate_the_format(tmp_path: Path) -> None:
    base = {"cache_dir": str(tmp_path)}
    assert ConnectorSettings.from_extra_config(base).offload_dtype == "auto"
    got = ConnectorSettings.from_extra_config({**base, "offload_dtype": "int8"})
    assert got.offload_dtype == "int8"
    with pytest.raises(SettingsError, match="offload_dtype"):
        ConnectorSettings.from_extra_config({**base, "offload_dtype": "int4"})
    assert env_settings({"LGKV_KV_OFFLOAD_DTYPE": "BFloat16"}) == {"kv_offload_dtype": "bfloat16"}
    with pytest.raises(ConfigError, match="--kv-offload-dtype"):
        ServerConfig(kv_offload_dtype="int4", cache_dir=tmp_path)


def test_redis_keys_name_the_format() -> None:
    pytest.importorskip("redis")
    from server.kv.tiers.redis import RedisStore

    prefixes = {
        name: RedisStore("redis://127.0.0.1:1/0", manifest(name), ttl_s=60).prefix
        for name in ("auto", "int8", "float16")
    }
    assert len(set(prefixes.values())) == 3  # an int8 replica never reads a float16 value
    assert prefixes["int8"] == f"lgkv:{manifest('int8').fingerprint()}:"


def test_compression_ratio_reaches_the_metrics(tmp_path: Path) -> None:
    from server.kv.registry import Registry
    from server.kv.registry.control import SessionControl

    reg = Registry(tmp_path / "sessions.sqlite3")
    reg.add_stats({}, {'lgkv_kv_compression_ratio{format="int8"}': 3.88})
    reg.close()
    control = SessionControl(tmp_path)
    try:
        assert control.metrics()['lgkv_kv_compression_ratio{format="int8"}'] == 3.88
    finally:
        control.close()
