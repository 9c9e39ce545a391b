"""One exception family for tracon-jobs.

TraconError
├── ConfigurationError          invalid settings; raised at startup, names the setting
├── ToolRegistrationError       a @tool declaration that breaks a rule
├── ProviderError               a model provider call failed; carries status or kind
│   └── ProviderUnavailableError    rejected before reaching the provider (open circuit)
├── ToolError                   a tool execution failed
│   ├── RetryableToolError          the handler says a new attempt may succeed
│   ├── ToolTimeoutError            the attempt ran past its timeout (retryable)
│   └── ToolCanceledError          the run was cancelled (terminal)
├── RunCanceled                the executor observed a cancel request
├── RunTakenAway                a fenced write changed no row: another owner has the run
└── EnqueueError                the broker did not accept a run's message
"""

from __future__ import annotations


class TraconError(Exception):
    """Base class of every error tracon-jobs raises on purpose."""


class ConfigurationError(TraconError):
    """A setting is missing or breaks its validation rule."""

    def __init__(self, setting: str, rule: str) -> None:
        super().__init__(f"Invalid configuration: {setting}: {rule}")
        self.setting = setting
        self.rule = rule


class ToolRegistrationError(TraconError):
    """A tool declaration that the registry refuses."""


class ProviderError(TraconError):
    """A provider call failed.

    `status` is the HTTP status when the provider answered; `kind` is `"http"`,
    `"connection"`, `"timeout"`, `"cancelled"`, `"configuration"`, `"unavailable"` or
    `"content_blocked"`, so that policies classify a failure without knowing its SDK.
    """

    def __init__(
        self,
        message: str,
        *,
        provider: str,
        status: int | None = None,
        kind: str = "http",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.provider = provider
        self.status = status
        self.kind = kind
        self.retry_after = retry_after


class ProviderUnavailableError(ProviderError):
    """The call was refused before it reached the provider."""

    def __init__(self, provider: str, retry_after: float | None) -> None:
        super().__init__(
            f"Provider '{provider}' is unavailable (circuit open)",
            provider=provider,
            kind="unavailable",
            retry_after=retry_after,
        )

    @property
    def provider_name(self) -> str:
        return self.provider


class ContentBlockedError(ProviderError):
    """The provider's content or safety filter refused the request or the answer."""

    def __init__(self, message: str, *, provider: str) -> None:
        super().__init__(message, provider=provider, kind="content_blocked")


class MustPark(TraconError):
    """A model call would wait `seconds` for its provider (`reason`): its run is parked
    instead of holding its worker thread for that long."""

    def __init__(self, reason: str, seconds: float) -> None:
        super().__init__(f"{reason}: {seconds:.1f}s to wait")
        self.reason = reason
        self.seconds = seconds


class ToolError(TraconError):
    """A tool execution failed; `code` is what the model and the events see."""

    code = "EXECUTION_FAILED"
    retryable = False
    attempts = 1  # how many attempts the execution made before it ended with this error

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class RetryableToolError(ToolError):
    retryable = True


class ToolTimeoutError(ToolError):
    code = "TIMEOUT"
    retryable = True


class ToolCanceledError(ToolError):
    code = "CANCELLED"


class RunCanceled(TraconError):
    """The run was asked to stop; the executor ends it `Canceled`."""


class RunTakenAway(TraconError):
    """A fenced write matched no row: the run was closed or claimed by someone else."""


class ClaimedElsewhere(RunTakenAway):
    """The claim of a delivery was never made: another process claimed the run (or it was
    canceled) between the read of its row and its first write. The run did not start here."""


class EnqueueError(TraconError):
    """The broker refused or could not be reached when sending a run's message."""
