"""Tracing's switches are the standard OpenTelemetry variables: which ones turn it on, and
the values this process would ignore, refused at startup naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracon_jobs import tracing
from tracon_jobs.errors import ConfigurationError
from tracon_jobs.settings.loading import load_settings


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ({"OTEL_SERVICE_NAME": "mine"}, False),  # naming a service exports nothing
    ],
)
def test_the_standard_environment_turns_tracing_on(environ: dict[str, str], on: bool) -> None:
    assert tracing.wanted(environ) is on


@pytest.mark.parametrize(
    ("variable", "value", "rule"),
    [
        ("OTEL_TRACES_EXPORTER", "zipkin", "must be one of otlp, console, none"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "only http/protobuf"),
        ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "only http/protobuf"),
        ("OTEL_TRACES_SAMPLER", "sometimes", "must be one of always_on"),
        ("OTEL_TRACES_SAMPLER_ARG", "1.5", "must be a ratio from 0 to 1"),
        ("OTEL_TRACES_SAMPLER_ARG", "half", "must be a ratio from 0 to 1"),
        ("OTEL_BSP_SCHEDULE_DELAY", "soon", "whole number above 0"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "0", "whole number above 0"),
        ("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "yes", "must be true or false"),
    ],
)
def test_a_value_the_exporter_would_ignore_stops_startup_naming_it(
    variable: str, value: str, rule: str, tmp_path: Path
) -> None:
    environ = {"OTEL_TRACES_SAMPLER": "traceidratio", variable: value}
    if variable == "OTEL_TRACES_SAMPLER":
        environ = {variable: value}
    with pytest.raises(ConfigurationError) as refused:
        tracing.check_environment(environ)
    assert refused.value.setting == variable and rule in refused.value.rule

    # and so does every command's settings: the process does not start
    config = tmp_path / "tracon.json"
    config.write_text("{}")
    with pytest.raises(ConfigurationError) as at_startup:
        load_settings(config, {**environ, "TRACON_DATABASE_URL": "sqlite://"})
    assert at_startup.value.setting == variable


def test_the_values_the_sdk_reads_pass() -> None:
    tracing.check_environment(
        {
            "OTEL_TRACES_EXPORTER": "otlp,console",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "OTEL_BSP_SCHEDULE_DELAY": "500",
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "TRUE",
        }
    )
