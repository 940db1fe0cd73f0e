"""Exceptions raised by agentspec.

Every error the C engine reports is turned into one of these classes.  Each
class also derives from the builtin exception a Python user would expect, so
``except ValueError`` keeps working::

    AgentSpecError (Exception)
    ├── InvalidTokenError (ValueError)        token id < 0 or > 2**31-1
    ├── InvalidArgumentError (ValueError)     a bad parameter
    ├── SequenceExistsError (ValueError)      the sequence id is already used
    ├── SequenceNotFoundError (KeyError)      no sequence with that id
    ├── SequenceClosedError (ValueError)      append to a closed sequence
    ├── CapacityError (OverflowError)         a size limit was hit
    ├── ShardFormatError (ValueError)         shard bytes are malformed
    │   ├── ShardVersionError                 unsupported format version
    │   ├── ShardTruncatedError               shorter than their lengths say
    │   ├── ShardChecksumError                payload checksum mismatch
    │   └── DepthMismatchError                shard max_depth != tree max_depth
    ├── NativeMemoryError (MemoryError)       the C allocator failed
    ├── ThreadStartError (RuntimeError)       a worker thread did not start
    ├── TreeClosedError (ValueError)          use of a closed tree or cursor
    ├── ShardNotFoundError (KeyError)         a ShardStore has no shard with that key
    ├── StoreLockedError (RuntimeError)       another ShardStore holds the directory
    ├── StoreReadOnlyError (RuntimeError)     a write to a ShardStore opened read-only
    ├── StoreCorruptError (ValueError)        persisted shard data is damaged
    ├── PushError                             a push to a worker failed
    ├── TraceFormatError (ValueError)         a trace record or file is off the format
    ├── ChatTemplateError (ValueError)        a chat template is missing or failed
    ├── ModelError (RuntimeError)             a model could not be fetched or loaded
    │   ├── ModelDownloadError                pip could not download the model wheel
    │   └── ModelNotFoundError (FileNotFoundError)  no usable model by that name
    ├── GenerationCancelledError (RuntimeError)  an engine request was cancelled
    ├── ListenError (OSError)                 a server cannot listen on its address
    └── DemoError (RuntimeError)              the demo cannot run

The classes are also importable from where they are used (``agentspec.PushError``,
``agentspec.traces.TraceFormatError``, ``agentspec.chat.ChatTemplateError``,
``agentspec.models.ModelError``, ``agentspec.engine.GenerationCancelledError``,
``agentspec.demo.DemoError``); each is the same class object.

For an error reported by the C engine, ``args[0]`` is the engine's own message
(``as_strerror``); a second argument, when present, says which input was at
fault (an index, a sequence id, a batch item).
"""

from __future__ import annotations

__all__ = [
    "AgentSpecError",
    "CapacityError",
    "ChatTemplateError",
    "DemoError",
    "DepthMismatchError",
    "GenerationCancelledError",
    "InvalidArgumentError",
    "InvalidTokenError",
    "ListenError",
    "ModelDownloadError",
    "ModelError",
    "ModelNotFoundError",
    "NativeMemoryError",
    "PushError",
    "SequenceClosedError",
    "SequenceExistsError",
    "SequenceNotFoundError",
    "ShardChecksumError",
    "ShardFormatError",
    "ShardNotFoundError",
    "ShardTruncatedError",
    "ShardVersionError",
    "StoreCorruptError",
    "StoreLockedError",
    "StoreReadOnlyError",
    "ThreadStartError",
    "TraceFormatError",
    "TreeClosedError",
]

#: HTTP statuses of a failed push that are worth retrying (`PushError.transient`).
TRANSIENT_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
#: 409 answers that retrying cannot fix (the push wire's ``ErrorType`` values).
_PERMANENT_409 = frozenset({"depth_mismatch", "instance_mismatch"})
#: 5xx answers that are not retried: 507, the worker's shard budget is full
#: (the key is pushed again at its next change; other keys go on meanwhile).
_PERMANENT_5XX = frozenset({507})


class AgentSpecError(Exception):
    """Base class of every agentspec error; never raised by itself.

    ``args[0]`` is the message (the C engine's message for engine errors);
    ``args[1]``, when present, names the offending input.
    """

    def __str__(self) -> str:
        """Render ``message (detail)``; no quoting, even for KeyError subclasses."""
        if not self.args:
            return ""
        if len(self.args) == 1:
            return str(self.args[0])
        details = ", ".join(str(a) for a in self.args[1:])
        return f"{self.args[0]} ({details})"


class InvalidTokenError(AgentSpecError, ValueError):
    """A token id outside [0, 2**31-1]."""


class InvalidArgumentError(AgentSpecError, ValueError):
    """A parameter outside its allowed range, or otherwise unusable."""


class SequenceExistsError(AgentSpecError, ValueError):
    """The sequence id is already present (``SuffixTree.add`` needs a new id)."""


class SequenceNotFoundError(AgentSpecError, KeyError):
    """No sequence with that id in the tree."""


class SequenceClosedError(AgentSpecError, ValueError):
    """Tokens were appended to a sequence that is closed."""


class CapacityError(AgentSpecError, OverflowError):
    """A size limit was reached (output buffer, batch size, count or length)."""


class ShardFormatError(AgentSpecError, ValueError):
    """Shard bytes are malformed (bad magic or structure)."""


class ShardVersionError(ShardFormatError):
    """Shard bytes use a format version this build does not read."""


class ShardTruncatedError(ShardFormatError):
    """Shard bytes are shorter than the lengths they declare."""


class ShardChecksumError(ShardFormatError):
    """The shard payload does not match its checksum."""


class DepthMismatchError(ShardFormatError):
    """The shard's max_depth differs from the tree's."""


class NativeMemoryError(AgentSpecError, MemoryError):
    """The C engine could not allocate memory; the object is unchanged."""


class ThreadStartError(AgentSpecError, RuntimeError):
    """A worker thread of a batched call could not be started."""


class TreeClosedError(AgentSpecError, ValueError):
    """The tree, cursor or cache was used after ``close()``."""


class ShardNotFoundError(AgentSpecError, KeyError):
    """The store has no shard with that key."""


class StoreLockedError(AgentSpecError, RuntimeError):
    """Another `ShardStore` (in this or another process) holds the directory's lock."""


class StoreReadOnlyError(AgentSpecError, RuntimeError):
    """A change was asked of a `ShardStore` opened with ``readonly=True``."""


class StoreCorruptError(AgentSpecError, ValueError):
    """Persisted shard data is damaged (not merely an unacknowledged torn tail)."""


class PushError(AgentSpecError):
    """A push failed: a transport error, or an HTTP error answer.

    Attributes:
        status: the HTTP status, or None for a transport error (connection
            refused or dropped, timeout).
        error_type: the ``type`` of a JSON error body, when there is one.
        retry_after: seconds the worker asked to wait, when it did.
        transient: whether retrying may help (see `agentspec.is_transient`).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        error_type: str | None = None,
        retry_after: float | None = None,
        instance: str | None = None,
    ) -> None:
        """Record a failure (``instance``: the worker's id from the answer, if any)."""
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.retry_after = retry_after
        self.instance = instance

    @property
    def transient(self) -> bool:
        """Transport errors, 408, 429, 5xx but 507 (insufficient storage), and 409
        unless it is a depth/instance mismatch."""
        if self.status is None:
            return True
        if self.status == 409:
            return self.error_type not in _PERMANENT_409
        if self.status in _PERMANENT_5XX:
            return False
        return self.status in TRANSIENT_STATUSES or self.status >= 500


class TraceFormatError(AgentSpecError, ValueError):
    """A trace record or file is off the format.

    For errors found while reading a file, the message starts with
    ``file:line:`` and `path` / `line` are set; otherwise both are None.
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None) -> None:
        """Build the error; ``path`` and ``line`` (1-based) locate it in a file."""
        if path is not None:
            where = f"{path}:{line}" if line is not None else path
            message = f"{where}: {message}"
        super().__init__(message)
        self.path = path
        self.line = line


class ChatTemplateError(AgentSpecError, ValueError):
    """The chat template is missing, does not compile, or failed while rendering."""


class ModelError(AgentSpecError, RuntimeError):
    """A model could not be fetched, converted or loaded."""


class ModelDownloadError(ModelError):
    """pip could not download the model wheel (no pip, no network, unknown version)."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """A model name or path that names no usable model."""


class GenerationCancelledError(AgentSpecError, RuntimeError):
    """The request was cancelled (its client went away) before it finished."""


class ListenError(AgentSpecError, OSError):
    """The server cannot listen on the address it was given."""


class DemoError(AgentSpecError, RuntimeError):
    """The demo cannot run: no pipeline, no model, no questions, an unusable server."""
