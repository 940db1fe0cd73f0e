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
    └── StoreCorruptError (ValueError)        persisted shard data is damaged

`agentspec.PushError` (an AgentSpecError) reports a failed push to a worker.

For an error reported by the C engine, ``args[0]`` is the engine's own message
(``as_strerror``); a second argument, when present, says which input was at
fault (an index, a sequence id, a batch item).
"""

from __future__ import annotations

__all__ = [
    "AgentSpecError",
    "CapacityError",
    "DepthMismatchError",
    "InvalidArgumentError",
    "InvalidTokenError",
    "NativeMemoryError",
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
    "ThreadStartError",
    "TreeClosedError",
]


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


class StoreCorruptError(AgentSpecError, ValueError):
    """Persisted shard data is damaged (not merely an unacknowledged torn tail)."""
