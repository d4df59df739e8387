"""ServerConfig, sizes, environment variables, the CLI split and the vLLM namespace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.__main__ import config_from_argv
from server.config import ConfigError, ServerConfig, env_settings, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("1.5GB", 1_500_000_000),
        ("64M", 64 << 20),
        ("10 kB", 10_000),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1", "5 parsecs", "1.2.3GB", -5])
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(ConfigError, match=r"size|>= 0"):
        parse_size(text, name="--kv-ram-bytes")


def test_env_settings() -> None:
    env = {
        "LGKV_MODEL": "/m",
        "LGKV_PORT": "9001",
        "LGKV_KV_RAM_BYTES": "512MiB",
        "LGKV_KV_DISK_BYTES": "0",
        "LGKV_NO_KV_OFFLOAD": "yes",
        "LGKV_KV_SESSION_TTL": "3600",
        "LGKV_API_KEY": "a, b",
        "LGKV_KV_DISK_DIR": "/blocks",
        "LGKV_MAX_MODEL_LEN": "",  # empty means unset
    }
    values = env_settings(env)
    assert values == {
        "model": "/m",
        "port": 9001,
        "kv_ram_bytes": 512 << 20,
        "kv_disk_bytes": 0,
        "kv_offload": False,
        "kv_session_ttl": 3600.0,
        "api_keys": ("a", "b"),
        "kv_disk_dir": Path("/blocks"),
    }


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LGKV_PORT": "http"}, "LGKV_PORT"),
        ({"LGKV_NO_KV_OFFLOAD": "maybe"}, "LGKV_NO_KV_OFFLOAD"),
        ({"LGKV_KV_SESSION_TTL": "soon"}, "LGKV_KV_SESSION_TTL"),
        ({"LGKV_KV_RAM_BYTES": "lots"}, "LGKV_KV_RAM_BYTES"),
    ],
)
def test_env_errors_name_the_variable(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        env_settings(env)


def test_flags_beat_env_and_unknown_flags_pass_through(tmp_path: Path) -> None:
    env = {"LGKV_PORT": "9001", "LGKV_KV_RAM_BYTES": "1GiB", "LGKV_MODEL": "/from-env"}
    cfg = config_from_argv(
        [
            "/from-argv",
            "--port", "9002",
            "--kv-ram-bytes", "256MiB",
            "--cache-dir", str(tmp_path),
            "--no-kv-offload",
            "--tensor-parallel-size", "2",
            "--max-num-seqs=4",
        ],
        env=env,
    )  # fmt: skip
    assert cfg.model == "/from-argv"
    assert cfg.port == 9002
    assert cfg.kv_ram_bytes == 256 << 20
    assert cfg.cache_dir == tmp_path
    assert cfg.kv_offload is False
    assert cfg.vllm_args == ("--tensor-parallel-size", "2", "--max-num-seqs=4")


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="port"):
        ServerConfig(port=0)
    with pytest.raises(ConfigError, match="no-kv-offload"):
        ServerConfig(kv_ram_bytes=0)
    assert ServerConfig(kv_ram_bytes=0, kv_offload=False).kv_offload is False
    with pytest.raises(ConfigError, match="tool-strict-level must be one of"):
        ServerConfig(tool_strict_level="strict")
    cfg = ServerConfig(cache_dir=Path("/c"))
    assert cfg.disk_dir == Path("/c/blocks")


def test_defaults_are_laptop_friendly() -> None:
    from server.model import default_cache_dir

    cfg = ServerConfig()
    assert cfg.port == 8000 and cfg.host == "127.0.0.1"
    assert cfg.kv_offload is True
    assert cfg.cache_dir == default_cache_dir() / "kv"
    assert cfg.max_body_bytes == 2 << 20  # modest: a large body is parsed holding the GIL


@pytest.mark.vllm
def test_vllm_namespace(tmp_path: Path, tiny_model_dir: Path) -> None:
    from server.engine import build_vllm_args

    cfg = ServerConfig(
        model=str(tiny_model_dir),
        cache_dir=tmp_path,
        kv_cache_memory_bytes=64 << 20,
        kv_session_ttl=60.0,
        vllm_args=("--max-num-seqs", "3", "--enable-chunked-prefill"),
    )
    args = build_vllm_args(cfg)
    assert args.max_num_seqs == 3
    assert args.dtype == "float32"  # CPU
    assert args.kv_cache_memory_bytes == 64 << 20
    assert args.enable_prompt_tokens_details is True
    assert args.enable_auto_tool_choice is True and args.tool_call_parser == "lgkv_hermes"
    assert args.tool_strict_level == "parameter"  # forced tool calls follow the schema
    # the path (responses carry it) and the folder's name: what a client guesses from --model
    assert args.served_model_name == [str(tiny_model_dir), tiny_model_dir.name]
    ktc = args.kv_transfer_config
    assert ktc.kv_connector == "SessionKVConnector"
    assert ktc.kv_connector_module_path == "server.kv.connector"
    assert ktc.kv_role == "kv_both"
    assert ktc.kv_connector_extra_config == {
        "cache_dir": str(tmp_path),
        "disk_dir": str(tmp_path / "blocks"),
        "ram_bytes": cfg.kv_ram_bytes,
        "disk_bytes": cfg.kv_disk_bytes,
        "redis_url": None,
        "redis_namespace": str(tiny_model_dir),  # the served name: replicas of it share
        "default_ttl_s": 60.0,
        "model_id": str(tiny_model_dir),
        "offload_dtype": "auto",
        "redis_ttl_s": 3600.0,
        "stats_flush_s": 1.0,
        "default_gap_s": 60.0,
        "min_gap_s": 30.0,
        "pin_share": 0.5,
        "branch_blocks": 64,
        "shift_min_run": 16,
    }
    json.dumps(ktc.kv_connector_extra_config)  # plain JSON, travels to the engine process

    plain = build_vllm_args(ServerConfig(model=str(tiny_model_dir), kv_offload=False))
    assert plain.kv_transfer_config is None
    assert plain.enable_prefix_caching is True


@pytest.mark.vllm
def test_vllm_namespace_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    from server.engine import ModelNotFoundError, build_vllm_args

    with pytest.raises(ModelNotFoundError, match="no model there"):
        build_vllm_args(ServerConfig(model=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="invalid vLLM arguments"):
        build_vllm_args(ServerConfig(model=str(tiny_model_dir), vllm_args=("--no-such-flag",)))
    with pytest.raises(ConfigError, match="no-kv-offload"):
        build_vllm_args(
            ServerConfig(model=str(tiny_model_dir), vllm_args=("--kv-transfer-config", "{}"))
        )
    with pytest.raises(ConfigError, match=r"pipeline parallelism.*--pipeline-parallel-size 1"):
        build_vllm_args(
            ServerConfig(model=str(tiny_model_dir), vllm_args=("--pipeline-parallel-size", "2"))
        )
    tp = build_vllm_args(
        ServerConfig(model=str(tiny_model_dir), vllm_args=("--tensor-parallel-size", "2"))
    )
    assert tp.tensor_parallel_size == 2 and tp.kv_transfer_config is not None


def test_default_model_missing_says_how_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.engine import ModelNotFoundError, resolve_model

    monkeypatch.setenv("LGKV_MODEL_DIR", str(tmp_path / "nothing"))
    with pytest.raises(ModelNotFoundError, match=r"make setup.*python -m server.model"):
        resolve_model(ServerConfig())


def test_chatml_models_without_tools_get_the_tool_template(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from server.engine import TOOL_TEMPLATE, tool_template_for

    assert tool_template_for(str(smollm2_dir)) == TOOL_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ tools }}<|im_start|>")
    assert tool_template_for(str(tmp_path)) is None  # has its own tool support
    assert tool_template_for("org/hub-model") is None


def test_tool_template_renders_like_smollm2_without_tools(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from server.engine import TOOL_TEMPLATE

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ours = TOOL_TEMPLATE.read_text()
    for messages in (
        [{"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"},
        ],
    ):
        own = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        mine = tok.apply_chat_template(
            messages, chat_template=ours, tokenize=False, add_generation_prompt=True
        )
        assert mine == own
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with_tools = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], chat_template=ours, tools=tools, tokenize=False
    )
    assert '<tools>\n{"type": "function"' in with_tools


@pytest.mark.vllm
def test_cli_help_lists_our_flags_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from server.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--help=LangGraphKVCache"])
    assert info.value.code in (0, None)
    out = capsys.readouterr().out
    for flag in ("--kv-ram-bytes", "--kv-disk-dir", "--no-kv-offload", "--cache-dir"):
        assert flag in out
    assert "(default: 1GiB)" in out


def test_cli_reports_bad_values_as_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from server.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--kv-ram-bytes", "lots"])
    assert info.value.code == 2
    assert "kv-ram-bytes" in capsys.readouterr().err


def test_api_key_flag_repeats_and_keeps_every_key(tmp_path: Path) -> None:
    """``--api-key A --api-key B`` keeps both keys (it kept only the last one)."""
    argv = ["/m", "--cache-dir", str(tmp_path), "--api-key", "keyA", "--api-key", "keyB", "keyC"]
    assert config_from_argv(argv, env={}).api_keys == ("keyA", "keyB", "keyC")


@pytest.mark.parametrize("text", ["512MiB\nx", "12\n3"])
def test_parse_size_wants_the_whole_text(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text, name="--kv-ram-bytes")


def test_the_omp_wait_policy_is_passive_unless_the_environment_or_a_flag_says_otherwise() -> None:
    from server.__main__ import apply_wait_policy

    env: dict[str, str] = {}
    apply_wait_policy(config_from_argv([], env={}), env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "active"}  # the user's own wins
    apply_wait_policy(config_from_argv([], env={}), env)
    assert env == {"OMP_WAIT_POLICY": "active"}
    env = {}
    apply_wait_policy(config_from_argv(["--omp-wait-policy", "vllm"], env={}), env)
    assert env == {}  # left to libgomp, as plain vLLM
    apply_wait_policy(config_from_argv([], env={"LGKV_OMP_WAIT_POLICY": "Active"}), env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    with pytest.raises(ConfigError, match="omp"):
        config_from_argv(["--omp-wait-policy", "sleepy"], env={})
