"""The `grpod` exit codes (README "Exit codes"); systemd restarts on EXIT_FAILURE only."""

from __future__ import annotations

EXIT_OK = 0  # finished, stopped by SIGTERM/SIGINT, or a check that passed
EXIT_FAILURE = 1  # a failure that is not the input's (or a replay/fsck that did not pass)
EXIT_BAD_INPUT = 2  # bad config, run dir, batch, blob, checkpoint or argument: one line
EXIT_HALT = 3  # the guards halted the run (after a checkpoint)
EXIT_INTERRUPTED = 130  # Ctrl-C at the command line (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # a reader command whose output pipe closed (128 + SIGPIPE)


def exit_by_signal(signum: int) -> int:
    """A second stop signal abandoned the step in flight: the shell's 128 + signal number."""
    return 128 + signum
