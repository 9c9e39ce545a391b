"""Failure classification: what counts against a circuit, and what moves to the next fallback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tracon_jobs.errors import ContentBlockedError, ProviderError, ProviderUnavailableError
from tracon_jobs.resilience.classify import (
    Classifier,
    Verdict,
    by_status,
    classify,
    register_classifier,
    status_of,
    unregister_classifier,
)

COUNTS_AND_FALLS_BACK = Verdict(counts=True, transient=True)
COUNTS_ONLY = Verdict(counts=True, transient=False)
NEITHER = Verdict(counts=False, transient=False)
FALLS_BACK_ONLY = Verdict(counts=False, transient=True)

STATUS_TABLE = [
    (500, COUNTS_AND_FALLS_BACK),
    (502, COUNTS_AND_FALLS_BACK),
    (503, COUNTS_AND_FALLS_BACK),
    (504, COUNTS_AND_FALLS_BACK),
    (599, COUNTS_AND_FALLS_BACK),
    (408, COUNTS_AND_FALLS_BACK),
    (429, COUNTS_AND_FALLS_BACK),
    (401, COUNTS_ONLY),
    (403, COUNTS_ONLY),
    (400, NEITHER),
    (404, NEITHER),
    (409, NEITHER),
    (422, NEITHER),
]


@pytest.mark.parametrize(("status", "expected"), STATUS_TABLE)
def test_by_status(status: int, expected: Verdict) -> None:
    assert by_status(status) == expected


@pytest.mark.parametrize(("status", "expected"), STATUS_TABLE)
def test_provider_error_with_status(status: int, expected: Verdict) -> None:
    exc = ProviderError("provider answered", provider="p", status=status)
    assert status_of(exc) == status
    assert classify(exc) == expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ProviderError("refused", provider="p", kind="connection"), COUNTS_AND_FALLS_BACK),
        (ProviderError("read timed out", provider="p", kind="timeout"), COUNTS_AND_FALLS_BACK),
        (ProviderError("caller went away", provider="p", kind="cancelled"), NEITHER),
        (ProviderError("filtered", provider="p", kind="content_blocked"), NEITHER),
        (ContentBlockedError("filtered", provider="p"), NEITHER),
        (ProviderError("unknown provider", provider="p", kind="configuration"), NEITHER),
        (ProviderError("open", provider="p", kind="unavailable"), FALLS_BACK_ONLY),
        (ProviderUnavailableError("p", retry_after=3.0), FALLS_BACK_ONLY),
    ],
    ids=[
        "connection",
        "timeout",
        "cancelled",
        "content_blocked-kind",
        "ContentBlockedError",
        "configuration",
        "unavailable-kind",
        "ProviderUnavailableError",
    ],
)
def test_provider_error_kinds(exc: ProviderError, expected: Verdict) -> None:
    assert classify(exc) == expected


@pytest.mark.parametrize(
    ("exc", "status", "expected"),
    [
        (RuntimeError("upstream said HTTP 503 Service Unavailable"), 503, COUNTS_AND_FALLS_BACK),
        (RuntimeError("HTTP 404 model not found"), 404, NEITHER),
        (RuntimeError("HTTP 401 bad key"), 401, COUNTS_ONLY),
        (ConnectionResetError(), None, COUNTS_AND_FALLS_BACK),
        (OSError("socket closed"), None, COUNTS_AND_FALLS_BACK),
    ],
    ids=["http-503-message", "http-404-message", "http-401-message", "reset", "unreadable"],
)
def test_exceptions_we_did_not_map(
    exc: BaseException, status: int | None, expected: Verdict
) -> None:
    assert status_of(exc) == status
    assert classify(exc) == expected


def test_a_status_wins_over_a_message() -> None:
    exc = ProviderError("proxy said HTTP 503", provider="p", status=404)
    assert status_of(exc) == 404
    assert classify(exc) == NEITHER


# -- registered classifiers ---------------------------------------------------------------


class SdkOverloaded(Exception):
    """A made-up SDK exception, the kind an application registers a classifier for."""


class SdkOverloadedSubclass(SdkOverloaded):
    pass


@pytest.fixture
def registered() -> Iterator[dict[type[BaseException], Classifier]]:
    """Register classifiers through the returned dict; every one is unregistered afterwards."""
    installed: dict[type[BaseException], Classifier] = {}
    try:
        yield installed
    finally:
        for exception_type in installed:
            unregister_classifier(exception_type)


def install(
    registry: dict[type[BaseException], Classifier],
    exception_type: type[BaseException],
    classifier: Classifier,
) -> None:
    registry[exception_type] = classifier
    register_classifier(exception_type, classifier)


def test_classifier_overrides_only_the_fallback_decision(
    registered: dict[type[BaseException], Classifier],
) -> None:
    # Given a classifier that says "fall back" for SdkOverloaded
    install(registered, SdkOverloaded, lambda _exc: True)
    # When a 400 (built-in: neither) and a 401 (built-in: counts only) come as that type
    bad_request = classify(SdkOverloaded("HTTP 400 overloaded"))
    bad_key = classify(SdkOverloaded("HTTP 401 overloaded"))
    # Then only `transient` changes; `counts` keeps the built-in rule
    assert bad_request == Verdict(counts=False, transient=True)
    assert bad_key == Verdict(counts=True, transient=True)


def test_classifier_can_forbid_a_fallback(
    registered: dict[type[BaseException], Classifier],
) -> None:
    install(registered, SdkOverloaded, lambda _exc: False)
    assert classify(SdkOverloaded("HTTP 503")) == Verdict(counts=True, transient=False)


def test_classifier_applies_to_subclasses(
    registered: dict[type[BaseException], Classifier],
) -> None:
    install(registered, SdkOverloaded, lambda _exc: True)
    assert classify(SdkOverloadedSubclass("HTTP 404")) == FALLS_BACK_ONLY


def test_classifier_sees_the_sdk_exception_behind_a_provider_error(
    registered: dict[type[BaseException], Classifier],
) -> None:
    # Given a classifier for the SDK type, and a ProviderError(404) that wraps it
    seen: list[BaseException] = []

    def classifier(exc: BaseException) -> bool:
        seen.append(exc)
        return True

    install(registered, SdkOverloaded, classifier)
    sdk = SdkOverloaded("model overloaded")
    try:
        raise ProviderError("HTTP 404 from sdk", provider="p", status=404) from sdk
    except ProviderError as exc:
        wrapped = exc
    # When it is classified
    verdict = classify(wrapped)
    # Then the classifier decided the fallback from the cause; counts is the 404's rule
    assert seen == [sdk]
    assert verdict == FALLS_BACK_ONLY


def test_classifier_returning_none_keeps_the_built_in_rule(
    registered: dict[type[BaseException], Classifier],
) -> None:
    install(registered, SdkOverloaded, lambda _exc: None)
    assert classify(SdkOverloaded("HTTP 401")) == COUNTS_ONLY
    assert classify(SdkOverloaded("HTTP 503")) == COUNTS_AND_FALLS_BACK
    wrapped = ProviderError("bad", provider="p", status=400)
    wrapped.__cause__ = SdkOverloaded("bad")
    assert classify(wrapped) == NEITHER


def test_classifier_ignores_other_exception_types(
    registered: dict[type[BaseException], Classifier],
) -> None:
    install(registered, SdkOverloaded, lambda _exc: True)
    assert classify(RuntimeError("HTTP 404")) == NEITHER
    assert classify(ProviderError("x", provider="p", status=401)) == COUNTS_ONLY


def test_unregistered_classifier_no_longer_applies() -> None:
    register_classifier(SdkOverloaded, lambda _exc: True)
    try:
        assert classify(SdkOverloaded("HTTP 404")) == FALLS_BACK_ONLY
    finally:
        unregister_classifier(SdkOverloaded)
    assert classify(SdkOverloaded("HTTP 404")) == NEITHER
