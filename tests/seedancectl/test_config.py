from __future__ import annotations

from pathlib import Path

import pytest

from seedancectl._config import ConfigError, load_config
from seedancectl._timeparse import TimeParseError, parse_duration_s, parse_instant_ns


def test_defaults_listen_on_loopback_otlp_port() -> None:
    config = load_config(environ={})
    assert (config.host, config.port) == ("127.0.0.1", 4318)


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "seedance.toml"
    path.write_text('[sidecar]\njob = "llm"\nlisten = "127.0.0.1:5000"\nprometheus_port = 9400\n')
    config = load_config(path, environ={"SEEDANCE_LISTEN": "127.0.0.1:6000"},
                         overrides={"prometheus_port": 9500, "store": None})
    assert config.job == "llm"
    assert config.port == 6000
    assert config.prometheus_port == 9500


def test_metrics_source_is_the_store_or_a_prometheus_url() -> None:
    assert load_config(environ={}).prometheus_url is None
    env = {"SEEDANCE_METRICS_SOURCE": "prometheus:https://prometheus.example:9090/"}
    assert load_config(environ=env).prometheus_url == "https://prometheus.example:9090/"
    assert load_config(environ={}, overrides={
        "metrics_source": "prometheus:http://127.0.0.1:9090"}).prometheus_url == \
        "http://127.0.0.1:9090"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('listen = "nohost"', "listen"),
        ("prometheus_port = 70000", "prometheus_port"),
        ('nvml = "sometimes"', "nvml"),
        ("unknown_knob = 1", "unknown_knob"),
        ("[[sidecar.scrape]]\nkind = 'dcgm'", "scrape.0.url"),
        ('metrics_source = "prometheus"', "metrics_source"),
        ('metrics_source = "http://127.0.0.1:9090"', "metrics_source"),
        ('metrics_source = "prometheus:ftp://127.0.0.1:9090"', "metrics_source"),
        ('metrics_source = "prometheus:http://127.0.0.1:99999"', "metrics_source"),
        ('metrics_source = "prometheus:http://:9090"', "metrics_source"),
        ("[sidecar.kv_decompression]\nmax_batch_size = 0", "kv_decompression.max_batch_size"),
        ("[sidecar.kv_decompression]\nfixed_step_share = 1", "kv_decompression.fixed_step_share"),
        ("[sidecar.kv_decompression]\nbit_widths = [4]", "kv_decompression.bit_widths"),
    ],
)
def test_bad_field_is_named_in_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text if text.startswith("[[") else f"[sidecar]\n{text}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message and expected in message


@pytest.mark.parametrize(("extra", "expected"), [
    ("", "tls_cert_file"),
    ('tls_cert_file = "c.pem"\ntls_key_file = "k.pem"', "ingest_token_file"),
    ("allow_insecure_listen = true", "ingest_token_file"),
    ('tls_cert_file = "c.pem"', "set both or neither"),
])
def test_listening_beyond_loopback_needs_tls_and_an_ingest_token(
        tmp_path: Path, extra: str, expected: str) -> None:
    path = tmp_path / "exposed.toml"
    path.write_text(f'[sidecar]\nlisten = "0.0.0.0:4318"\n{extra}\n')
    with pytest.raises(ConfigError, match=expected):
        load_config(path, environ={})


@pytest.mark.parametrize("extra", [
    'tls_cert_file = "c.pem"\ntls_key_file = "k.pem"\ningest_token_file = "ingest.token"',
    "allow_insecure_listen = true\nallow_insecure_ingest = true",
])
def test_listening_beyond_loopback_when_the_operator_says_how(tmp_path: Path,
                                                              extra: str) -> None:
    path = tmp_path / "exposed.toml"
    path.write_text(f'[sidecar]\nlisten = "0.0.0.0:4318"\n{extra}\n')
    config = load_config(path, environ={})
    assert not config.loopback
    assert load_config(environ={"SEEDANCE_LISTEN": "[::1]:4318"}).loopback


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml", environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[sidecar\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken, environ={})


def test_durations_and_instants() -> None:
    assert parse_duration_s("10m") == 600
    assert parse_instant_ns("1h", now_ns=7_200_000_000_000) == 3_600_000_000_000
    assert parse_instant_ns("1970-01-01T00:00:01") == 1_000_000_000
    with pytest.raises(TimeParseError):
        parse_instant_ns("yesterday")


def test_a_scrape_timeout_longer_than_its_interval_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "scrape.toml"
    path.write_text('[sidecar]\n[[sidecar.scrape]]\nurl = "http://127.0.0.1:9400/metrics"\n'
                    "interval_s = 1\n")  # the default timeout_s is 2
    with pytest.raises(ConfigError, match=r"scrape\.0.*timeout_s \(2\) must be <= interval_s"):
        load_config(path, environ={})


def test_a_key_outside_the_sidecar_table_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "stray.toml"
    path.write_text('listen = "127.0.0.1:5000"\n[sidecar]\njob = "x"\n')
    with pytest.raises(ConfigError, match="listen: outside \\[sidecar\\]"):
        load_config(path, environ={})


def _checked(tmp_path: Path, text: str) -> str:
    from seedancectl._preflight import preflight

    path = tmp_path / "pre.toml"
    path.write_text("[sidecar]\n" + text)
    with pytest.raises(ConfigError) as info:
        preflight(load_config(path, environ={}))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_preflight_names_what_the_sidecar_could_not_use(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty.token").write_text("\n")
    assert "token_file" in _checked(tmp_path, f'token_file = "{tmp_path / "nope"}"\n')
    assert "is empty" in _checked(tmp_path, f'token_file = "{tmp_path / "empty.token"}"\n')
    assert "jobs.gpt.token_file" in _checked(
        tmp_path, f'[sidecar.jobs.gpt]\ntoken_file = "{tmp_path / "nope"}"\n')
    assert "store" in _checked(tmp_path, f'store = "{tmp_path / "a-file" / "m.db"}"\n')
    assert "is a folder" in _checked(tmp_path, f'store = "{tmp_path}"\n')
    assert "state_db" in _checked(
        tmp_path, f'store = "{tmp_path / "m.db"}"\n'
                  f'state_db = "sqlite:///{tmp_path / "a-file" / "s.db"}"\n')


def test_preflight_passes_a_usable_config_without_creating_anything(tmp_path: Path) -> None:
    from seedancectl._preflight import preflight

    path = tmp_path / "ok.toml"
    path.write_text(f'[sidecar]\nstore = "{tmp_path / "new" / "m.db"}"\n'
                    f'state_db = "sqlite:///{tmp_path / "new" / "s.db"}"\n')
    preflight(load_config(path, environ={}))
    assert not (tmp_path / "new").exists()


def test_the_kv_detector_weighs_what_the_engine_section_says(tmp_path: Path) -> None:
    """The serving engine's facts reach the KV decompression-cost detector of the sidecar
    (``[sidecar.kv_decompression]``); without the section it keeps the detector's own
    defaults, which the section's mirror field for field."""
    import dataclasses

    from policies.detectors import KvDecompressionConfig, KvDecompressionCostDetector
    from seedancectl._config import KvDecompressionSection
    from seedancectl._sidecar import all_detectors

    def kv_config(config: object) -> KvDecompressionConfig:
        (found,) = [d for d in all_detectors(config)  # type: ignore[arg-type]
                    if isinstance(d, KvDecompressionCostDetector)]
        return found.config

    assert kv_config(load_config(environ={})) == KvDecompressionConfig()
    defaults = {f.name: f.default for f in dataclasses.fields(KvDecompressionConfig)}
    assert KvDecompressionSection().model_dump().items() <= defaults.items()
    path = tmp_path / "serving.toml"
    path.write_text("[sidecar.kv_decompression]\nmax_batch_size = 256\n"
                    "kv_budget_bytes = 40e9\nuncompressed_read_bytes_per_s = 20e9\n")
    configured = kv_config(load_config(path, environ={}))
    assert (configured.max_batch_size, configured.kv_budget_bytes,
            configured.uncompressed_read_bytes_per_s) == (256, 40e9, 20e9)
    assert configured.fixed_step_share == KvDecompressionConfig().fixed_step_share
