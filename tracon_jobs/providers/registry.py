"""Build configured providers by name, once per process.

Settings are described here as Protocols, not imported, so that this module depends only on
the shape of `Providers.<name>` and the settings module stays free to evolve.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

from tracon_jobs.errors import ConfigurationError, ProviderError
from tracon_jobs.providers.base import Provider
from tracon_jobs.providers.scripted import ScriptedProvider, ScriptStepLike

logger = logging.getLogger(__name__)


class ProviderSettingsLike(Protocol):
    """The part of `Providers.<name>` that building a provider needs."""

    @property
    def kind(self) -> str: ...

    @property
    def base_url(self) -> str | None: ...

    @property
    def timeout_seconds(self) -> float: ...

    @property
    def script(self) -> Sequence[ScriptStepLike] | None: ...

    def resolved_api_key(self, environ: Mapping[str, str]) -> str | None: ...


def build_provider(
    name: str, settings: ProviderSettingsLike, environ: Mapping[str, str] = os.environ
) -> Provider:
    """A new provider for `Providers.<name>`; `ConfigurationError` names what is wrong.

    Each SDK is imported here, by the first provider of its kind: `anthropic` alone costs a
    process about a second of CPU to import, and most processes never build one."""
    kind = str(getattr(settings.kind, "value", settings.kind)).lower()
    if kind == "openai":
        from tracon_jobs.providers.openai import OpenAIProvider

        return OpenAIProvider(
            name,
            base_url=settings.base_url,
            api_key=settings.resolved_api_key(environ),
            timeout_seconds=settings.timeout_seconds,
            stream=_streams(settings),
            idle_timeout_seconds=getattr(settings, "idle_timeout_seconds", None),
        )
    if kind == "scripted":
        return ScriptedProvider.from_settings(name, settings.script or [])
    if kind == "anthropic":
        from tracon_jobs.providers.anthropic import AnthropicProvider

        return AnthropicProvider(
            name,
            base_url=settings.base_url,
            api_key=settings.resolved_api_key(environ),
            timeout_seconds=settings.timeout_seconds,
            stream=_streams(settings),
            idle_timeout_seconds=getattr(settings, "idle_timeout_seconds", None),
        )
    raise ConfigurationError(
        f"Providers.{name}.Kind", f"must be openai, anthropic or scripted, not '{kind}'"
    )


def _streams(settings: ProviderSettingsLike) -> bool:
    """`Providers.<name>.Stream`; a provider streams unless its settings say it must not."""
    return getattr(settings, "stream", None) is not False


class ProviderRegistry:
    """The process's providers, built on first use and shared by all threads.

    Building lazily keeps a worker that never calls a provider from opening clients, and
    sharing keeps one connection pool per provider instead of one per run.
    """

    def __init__(
        self,
        providers_settings: Mapping[str, ProviderSettingsLike],
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self._settings = dict(providers_settings)
        self._environ = environ
        self._lock = threading.Lock()
        self._providers: dict[str, Provider] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._settings)

    def get(self, name: str) -> Provider:
        with self._lock:
            provider = self._providers.get(name)
            if provider is None:
                provider = build_provider(name, self._settings_of(name), self._environ)
                self._providers[name] = provider
            return provider

    def close_all(self) -> None:
        """Close every built provider; one failing to close does not keep the others open."""
        with self._lock:
            providers, self._providers = self._providers, {}
        for name, provider in providers.items():
            try:
                provider.close()
            except Exception:
                logger.exception("Closing provider '%s' failed", name)

    def _settings_of(self, name: str) -> ProviderSettingsLike:
        settings = self._settings.get(name)
        if settings is None:
            configured = ", ".join(self.names) or "none"
            raise ProviderError(
                f"Unknown provider '{name}' (configured: {configured})",
                provider=name,
                status=None,
                kind="configuration",
            )
        return settings
