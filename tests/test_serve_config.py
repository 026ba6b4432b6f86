"""serve.py's settings: configs/serve.yaml, dotted overrides, flags as shortcuts, errors before any loading."""

import dataclasses

import pytest
import yaml

import serve
from jaxgen.config import ConfigError, DistributedConfig, HttpConfig, ServeCommandConfig, ServeConfig, load_serve_config
from tests.conftest import ROOT

SERVE_YAML = ROOT / "configs" / "serve.yaml"


def _settings(argv: list[str]) -> ServeCommandConfig:
    return serve.command_config(serve.parse_args(argv)[1])


def test_serve_yaml_lists_every_field_at_its_default():
    raw = yaml.safe_load(SERVE_YAML.read_text())
    assert list(raw) == ["serve", "http", "distributed"]
    assert list(raw["serve"]) == [f.name for f in dataclasses.fields(ServeConfig)]
    assert list(raw["http"]) == [f.name for f in dataclasses.fields(HttpConfig)]
    assert list(raw["distributed"]) == [f.name for f in dataclasses.fields(DistributedConfig)]
    assert load_serve_config(SERVE_YAML) == ServeCommandConfig()
    assert load_serve_config() == ServeCommandConfig()


def test_file_then_overrides_then_explicit_flags(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("serve:\n  slots: 4\n  page_size: 8\n  chunk_steps: 4\nhttp:\n  port: 9000\n  model_name: m\n")
    base = ["http", "--checkpoint", "ckpt", "--config", str(path)]
    s = _settings([*base, "serve.chunk_steps=16", "serve.prefill_chunk=128", "serve.slots=6"])
    assert (s.serve.slots, s.serve.page_size, s.serve.chunk_steps, s.serve.prefill_chunk) == (6, 8, 16, 128)
    assert (s.http.port, s.http.model_name, s.http.host) == (9000, "m", "127.0.0.1")
    assert s.serve.prefix_caching and s.serve.kv_memory_gb == 1.0  # flags not given change nothing

    flags = ["--slots", "2", "--port", "9001", "--no-prefix-caching", "--kv-memory-gb", "2", "--host", "0.0.0.0"]
    flags += ["--model-name", "n", "--max-body-bytes", "10", "--max-queue", "3", "--request-timeout", "5"]
    flags += ["--shutdown-grace", "1", "--page-size", "32", "--quantize", "int8", "--cache-dtype", "int8"]
    flags += ["--draft", "runs/small"]
    s = _settings([*base, "serve.slots=6", "http.port=9002", "serve.cache_dtype=bfloat16", *flags])
    assert s == ServeCommandConfig(
        serve=ServeConfig(
            slots=2, page_size=32, kv_memory_gb=2.0, chunk_steps=4, prefix_caching=False, max_body_bytes=10,
            max_queue=3, request_timeout_s=5.0, shutdown_grace_s=1.0, quantize="int8", cache_dtype="int8",
            draft="runs/small",
        ),
        http=HttpConfig(host="0.0.0.0", port=9001, model_name="n"),
    )  # fmt: skip

    s = _settings(["generate", "--checkpoint", "ckpt", "--prompt", "x", "--config", str(path), "--slots", "3"])
    assert (s.serve.slots, s.serve.chunk_steps) == (3, 4)  # generate reads the same serve section


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["serve.chunk_step=16"], "unknown config key serve.chunk_step; allowed keys under serve: slots, page_size"),
        (["serving.slots=2"], "unknown config key serving; allowed keys under the top level: serve, http"),
        (["http.api_key=s3cret"], "http.api_key is not read from config files"),
        (["serve.slots=0"], "serve.slots=0 is not allowed: a positive integer"),
        (["serve.cache_dtype=int4"], "serve.cache_dtype='int4' is not allowed: float32, bfloat16, int8"),
        (["serve.spec_rule=rejection"], "serve.spec_rule='rejection' is not allowed: exact, standard"),
        (["serve.prefix_caching=maybe"], "serve.prefix_caching='maybe' is not allowed: true or false"),
        (["http.port=70000"], "http.port=70000 is not allowed: an integer in [0, 65535]"),
        (["serve=4"], "serve=4 is not allowed: a mapping of slots"),
        (["serve.slots"], "is not of the form key=value"),
    ],
)
def test_errors_name_key_value_and_allowed(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_serve_config(SERVE_YAML, overrides)
    assert fragment in str(e.value)


def test_a_training_config_is_refused():
    with pytest.raises(ConfigError, match=r"tiny.yaml is a training config \(it has checkpoint, data, model, "):
        load_serve_config(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("command", [["http"], ["generate", "--prompt", "x"]])
def test_a_bad_setting_stops_before_the_checkpoint_loads(command, monkeypatch, capsys):
    from jaxgen.inference import loading as checkpoint

    def load_model(*args, **kwargs):
        raise AssertionError("the model loaded before the settings were checked")

    monkeypatch.setattr(checkpoint, "load_model", load_model)
    argv = [*command, "--checkpoint", "ckpt", "--config", str(SERVE_YAML), "serve.prefill_chunk=-1"]
    assert serve.main(argv) == 2
    assert "serve.prefill_chunk=-1 is not allowed: a positive integer" in capsys.readouterr().err
    assert serve.main([*command, "--checkpoint", "ckpt", "--slots", "0"]) == 2  # a flag is checked the same way
    assert "serve.slots=0 is not allowed: a positive integer" in capsys.readouterr().err


def test_http_settings_reach_the_engine_and_the_server(monkeypatch, tmp_path):
    """serve.main end to end with the model, the engine and uvicorn replaced by recorders."""
    import jaxgen.inference.engine
    import jaxgen.inference.precompile
    import jaxgen.runtime
    import jaxgen.serving.server
    from jaxgen.inference import loading as checkpoint

    seen = {}

    class Engine:
        def __init__(self, params, cfg, tokenizer, serve_config, mesh, draft=None):
            self.serve = seen["serve"] = serve_config
            seen["mesh"], seen["draft"] = mesh, draft
            self.stats = self  # the start's phases (/metrics' jaxgen_startup_seconds) come here

        def startup(self, phase, seconds):
            seen.setdefault("phases", set()).add(phase)

    monkeypatch.setattr(jaxgen.inference.precompile, "precompile", lambda engine, progress: seen.update(pre=progress))
    monkeypatch.setattr(checkpoint, "load_model", lambda path, mesh, **kwargs: ("cfg", "tokenizer", "params"))
    monkeypatch.setattr(checkpoint, "load_draft", lambda path, tokenizer, mesh, **kwargs: (f"params of {path}", "dcfg"))
    monkeypatch.setattr(jaxgen.inference.engine, "Engine", Engine)
    monkeypatch.setattr(jaxgen.runtime, "enable_compilation_cache", lambda: None)
    monkeypatch.setattr(
        jaxgen.serving.server, "create_app",
        lambda engine, name, key, metrics_need_key: seen.update(name=name, key=key, metrics=metrics_need_key),
    )  # fmt: skip
    monkeypatch.setattr(
        jaxgen.serving.server, "serve_forever", lambda engine, app, host, port, grace_s: seen.update(at=(host, port))
    )
    argv = ["http", "--checkpoint", str(tmp_path / "my-model"), "--config", str(SERVE_YAML)]
    argv += ["serve.chunk_steps=16", "serve.prefill_chunk=128", "serve.shutdown_grace_s=3", "--port", "9001"]
    assert serve.main([*argv, "--api-key", "k"]) == 0
    assert (seen["serve"].chunk_steps, seen["serve"].prefill_chunk, seen["serve"].shutdown_grace_s) == (16, 128, 3)
    assert seen["at"] == ("127.0.0.1", 9001) and seen["name"] == "my-model" and seen["key"] == "k"
    assert seen["mesh"] is None  # one device unless serve.data_parallel / tensor_parallel say otherwise
    assert seen["draft"] is None  # n-gram drafts unless serve.draft names a model
    assert {"load", "engine", "precompile"} <= seen["phases"] and seen["pre"] is True  # compiled before ready
    assert serve.main([*argv, "--draft", "runs/small"]) == 0
    assert seen["serve"].draft == "runs/small" and seen["draft"] == ("params of runs/small", "dcfg")


# --- issue 31: files, overrides and flags; sizes and settings the model cannot serve -----------------------


@pytest.mark.parametrize(
    "content, fragment",
    [
        (None, "is a directory, not a YAML file"),
        (b"serve:\n  slots: [1\n", "is not valid YAML: expected ',' or ']'"),
        (b"serve:\n  slots: \xff\xfe\n", "is not UTF-8 text"),
    ],
)
def test_a_broken_config_file_is_one_line_naming_it(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    path.mkdir() if content is None else path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_serve_config(path)
    assert str(path) in str(e.value) and fragment in str(e.value) and "\n" not in str(e.value)


def test_every_given_value_is_checked_and_overrides_may_stand_among_flags(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'serve.slots=\[1' is not a YAML value"):
        _settings(["http", "--checkpoint", "c", "serve.slots=[1"])
    with pytest.raises(ConfigError, match=r"serve\.slots='abc' is not allowed: an integer"):
        _settings(["http", "--slots", "2", "--checkpoint", "c", "serve.slots=abc"])  # the flag would win: still wrong
    with pytest.raises(ConfigError, match=r"serve\.slots=0 is not allowed"):
        _settings(["http", "--checkpoint", "c", "serve.slots=0", "--slots", "2"])
    s = _settings(["http", "--checkpoint", "c", "serve.quantize_embedding=true", "--quantize", "int8"])
    assert s.serve.quantize_embedding and s.serve.quantize == "int8"  # checked together with the flags
    path = tmp_path / "file.yaml"
    path.write_text("serve:\n  slots: many\n")  # replaced by an override, still wrong
    with pytest.raises(ConfigError, match=r"serve\.slots='many' is not allowed: an integer"):
        _settings(["http", "--checkpoint", "c", "--config", str(path), "serve.slots=2"])
    argv = ["http", "serve.slots=3", "--checkpoint", "c", "serve.chunk_steps=4", "--port", "1", "serve.page_size=8"]
    s = _settings(argv)
    assert (s.serve.slots, s.serve.chunk_steps, s.serve.page_size, s.http.port) == (3, 4, 8, 1)
    with pytest.raises(SystemExit):
        serve.parse_args(["http", "--checkpoint", "c", "serve.slots=3", "--bogus", "1"])


def test_train_cli_takes_overrides_among_flags(capsys):
    import train

    argv = ["--config", "configs/tiny.yaml", "model.num_layers=2", "--no-progress", "training.steps=abc"]
    assert train.main(argv) == 2  # the second run of overrides is read (it was "unrecognized arguments")
    assert "training.steps='abc' is not allowed: an integer" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["serve.num_pages=1000000000000"], "serve.num_pages=1000000000000 is not allowed: 0 (from"),
        (["serve.kv_memory_gb=.inf"], "serve.kv_memory_gb=inf is not allowed: a number > 0 and at most"),
        (["serve.kv_memory_gb=1e308"], "serve.kv_memory_gb=1e+308 is not allowed"),
        (["serve.kv_memory_gb=.nan"], "serve.kv_memory_gb=nan is not allowed"),
        (["serve.chunk_steps=1000000000"], "serve.chunk_steps=1000000000 is not allowed: at most 1024"),
        (["serve.quantize_embedding=true"], "serve.quantize_embedding=True is not allowed: true only with"),
    ],
)
def test_hostile_sizes_are_refused_by_the_config(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_serve_config(None, overrides)
    assert fragment in str(e.value)


TINY = dict(vocab_size=384, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128, max_seq_len=256)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["serve.max_logprobs=385"], "serve.max_logprobs=385 is not allowed: at most the model's vocabulary of 384"),
        (["serve.slots=1000000000"], "serve.slots=1000000000 is not allowed: the engine's buffers would take"),
        (["serve.num_pages=100000000"], "serve.num_pages=100000000 is not allowed: the engine's buffers would take"),
        (["serve.kv_memory_gb=100000"], "serve.kv_memory_gb=100000.0 is not allowed: the engine's buffers"),
        (["serve.chunk_steps=1024", "serve.slots=1000000"], "serve.chunk_steps=1024 is not allowed"),
        (["serve.kv_memory_gb=1e-9"], "it holds 0 pages of 8192 bytes (serve.page_size=16 tokens) and the page pool"),
    ],
)
def test_settings_the_model_cannot_serve_are_refused_before_the_engine_allocates(overrides, fragment, monkeypatch):
    from jaxgen.config import ModelConfig
    from jaxgen.inference.engine import Engine, runner

    def nothing(*args, **kwargs):
        raise AssertionError("allocated before the settings were checked")

    monkeypatch.setattr(runner.model, "decode_params", nothing)
    with pytest.raises(ConfigError) as e:
        Engine({}, ModelConfig(**TINY), None, load_serve_config(None, overrides).serve)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_binding_every_interface_without_a_key_warns(monkeypatch, capsys):
    from jaxgen.inference import loading

    def load_model(*args, **kwargs):
        raise FileNotFoundError("no model here")

    monkeypatch.setattr(loading, "load_model", load_model)
    assert serve.main(["http", "--checkpoint", "c", "--host", "0.0.0.0"]) == 1
    assert "warning: http.host=0.0.0.0 answers other machines and no API key is set" in capsys.readouterr().err
    for argv in (["--host", "0.0.0.0", "--api-key", "k"], ["--host", "127.0.0.1"], []):
        assert serve.main(["http", "--checkpoint", "c", *argv]) == 1
        assert "warning" not in capsys.readouterr().err
    assert _settings(["http", "--checkpoint", "c", "--metrics-need-key"]).http.metrics_need_key


# each field drawn from a valid value, 0, -1, huge ints, inf, nan, 1e308, wrong types and strings (YAML text)
HOSTILE = ["0", "-1", "1", "2", "3", "16", "384", "385", "1024", "65536", "1000000000", "1000000000000",
           str(10**18), "1.5", "1e-9", "1e308", ".inf", "-.inf", ".nan", "true", "false", "null", "abc", "''",
           "[1]", "{a: 1}", "int8", "shared", "0.0.0.0"]  # fmt: skip
FIELDS = [f"serve.{f.name}" for f in dataclasses.fields(ServeConfig) if f.name != "draft"]
FIELDS += [f"http.{f.name}" for f in dataclasses.fields(HttpConfig)]


def test_hostile_server_settings_are_named_or_fit(monkeypatch):
    """Issue 31's fuzz of server settings, through the command line's own path (overrides, the config, the
    engine's mesh, the checks the engine runs before it allocates): a one-line ConfigError naming a field
    that was given, or settings whose buffers fit in memory."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from jaxgen.config import ModelConfig
    from jaxgen.inference.budget import HEADROOM, check_serving, memory_available, planned_bytes
    from jaxgen.model.paged import page_bytes
    from jaxgen.serving import cli

    cfg = ModelConfig(**TINY)

    @settings(derandomize=True, max_examples=100, deadline=None)
    @given(st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(HOSTILE), min_size=1, max_size=4))
    def check(drawn):
        args = serve.parse_args(["http", "--checkpoint", "c", *(f"{k}={v}" for k, v in drawn.items())])[1]
        try:
            s = serve.command_config(args)
            mesh = cli._engine_mesh(s)
            check_serving(cfg, s.serve, mesh=mesh)
        except ConfigError as e:
            message = str(e)
            assert "\n" not in message and any(key in message for key in drawn), (drawn, message)
            return
        per_page = page_bytes(cfg, s.serve.page_size, s.serve.cache_dtype)
        pages = s.serve.num_pages or int(s.serve.kv_memory_gb * 2**30 // per_page)
        assert 2 <= pages < 2**31 and s.serve.max_logprobs <= cfg.vocab_size
        assert sum(planned_bytes(cfg, s.serve, pages, per_page).values()) <= HEADROOM * memory_available(mesh)[0]

    check()


def test_sizes_the_model_cannot_serve_stop_serve_py_before_the_weights_load(tmp_path, monkeypatch, capsys):
    import shutil

    from jaxgen.inference import loading

    def load_model(*args, **kwargs):
        raise AssertionError("the weights loaded before the settings were checked against the model")

    monkeypatch.setattr(loading, "load_model", load_model)
    shutil.copy(ROOT / "configs" / "tiny.yaml", tmp_path / "config.yaml")  # a run folder's config: vocabulary 384
    for override, fragment in [
        ("serve.max_logprobs=385", "error: serve.max_logprobs=385 is not allowed: at most the model's vocabulary"),
        ("serve.num_pages=100000000", "error: serve.num_pages=100000000 is not allowed: the engine's buffers"),
    ]:
        assert serve.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", override]) == 1
        err = capsys.readouterr().err
        assert fragment in err and len(err.splitlines()) == 1, err


def test_a_grammar_table_beyond_memory_is_refused_before_allocating():
    """serve.grammar_states sizes a (states, vocab) int32 table: counted in the engine's budget, so a value the
    device cannot hold is a ConfigError naming it, before anything is allocated."""
    from jaxgen.config import ModelConfig
    from jaxgen.inference.budget import check_serving

    cfg = ModelConfig(vocab_size=128256, num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, d_ff=128,
                      max_seq_len=128)  # fmt: skip
    check_serving(cfg, ServeConfig(num_pages=8))  # the default: 128 states, 63 MB
    with pytest.raises(ConfigError, match=r"serve\.grammar_states=1048576 is not allowed"):
        check_serving(cfg, ServeConfig(num_pages=8, grammar_states=2**20))
