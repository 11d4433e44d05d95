"""Errors whose messages are for users: each says what was wrong and how to fix it.

The CLI prints `str(error)` without a traceback and exits with `exit_code`.
"""


class DeskEyeError(Exception):
    exit_code = 1


class SettingsError(DeskEyeError):
    exit_code = 2


class UsageError(DeskEyeError):
    exit_code = 2


class WorkerUnavailable(DeskEyeError):
    """The worker (ours or an external server) cannot be reached or keeps failing."""


class CaptureError(DeskEyeError):
    """No display, or the region lies outside the monitor."""


class HookRuleError(DeskEyeError):
    """A hooks file that cannot be used; the message names the file and the rule."""
    exit_code = 2


class RouterDataError(DeskEyeError):
    """The router's labelled queries file is missing or malformed; the message names the file and line."""
    exit_code = 2


class ProviderError(DeskEyeError):
    """A quick provider (calendar, mail, ...) cannot answer: not configured, unreachable, or refused.

    The message is shown to the user as the answer; it never contains a password."""


class AnswerError(DeskEyeError):
    """The worker or external server answered, but not with a usable DeskEye description (added by D2)."""
