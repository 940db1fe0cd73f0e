/*
 * status.c -- names of status codes.  as_strerror never returns NULL, so a
 * binding can always turn a code into a message.
 */
#include "agentspec.h"

const char *as_strerror(int status) {
    switch (status) {
    case AS_OK: return "success";
    case AS_ERR_NOMEM: return "out of memory";
    case AS_ERR_INVALID_ARG: return "invalid argument";
    case AS_ERR_INVALID_TOKEN: return "invalid token id (must be in [0, 2147483647])";
    case AS_ERR_SEQ_EXISTS: return "sequence id already exists";
    case AS_ERR_SEQ_NOT_FOUND: return "sequence id not found";
    case AS_ERR_SEQ_CLOSED: return "sequence is closed";
    case AS_ERR_CAPACITY: return "capacity exceeded (buffer too small or size limit reached)";
    case AS_ERR_FORMAT: return "malformed shard bytes or inconsistent tree";
    case AS_ERR_VERSION: return "unsupported shard format version";
    case AS_ERR_TRUNCATED: return "shard bytes are truncated";
    case AS_ERR_CHECKSUM: return "shard checksum mismatch";
    case AS_ERR_DEPTH_MISMATCH: return "shard max_depth differs from the tree's";
    case AS_ERR_THREAD: return "could not start a worker thread";
    default: return "unknown status";
    }
}
