"""UCX status codes (``ucs_status_t``, UCX ABI) as a Python enum, importable without loading
UCX."""

from __future__ import annotations

import enum

__all__ = ["UcsStatus", "status_name"]


class UcsStatus(enum.IntEnum):
    """``ucs_status_t`` values (``UCS_`` prefix dropped)."""

    OK = 0
    INPROGRESS = 1
    ERR_NO_MESSAGE = -1
    ERR_NO_RESOURCE = -2
    ERR_IO_ERROR = -3
    ERR_NO_MEMORY = -4
    ERR_INVALID_PARAM = -5
    ERR_UNREACHABLE = -6
    ERR_INVALID_ADDR = -7
    ERR_NOT_IMPLEMENTED = -8
    ERR_MESSAGE_TRUNCATED = -9
    ERR_NO_PROGRESS = -10
    ERR_BUFFER_TOO_SMALL = -11
    ERR_NO_ELEM = -12
    ERR_SOME_CONNECTS_FAILED = -13
    ERR_NO_DEVICE = -14
    ERR_BUSY = -15
    ERR_CANCELED = -16
    ERR_SHMEM_SEGMENT = -17
    ERR_ALREADY_EXISTS = -18
    ERR_OUT_OF_RANGE = -19
    ERR_TIMED_OUT = -20
    ERR_EXCEEDS_LIMIT = -21
    ERR_UNSUPPORTED = -22
    ERR_REJECTED = -23
    ERR_NOT_CONNECTED = -24
    ERR_CONNECTION_RESET = -25
    ERR_ENDPOINT_TIMEOUT = -80
    ERR_LAST = -100


def status_name(status: int) -> str:
    """``UCS_ERR_IO_ERROR``-style name of a status; link/endpoint failure ranges named too."""
    try:
        return f"UCS_{UcsStatus(status).name}"
    except ValueError:
        if -59 <= status <= -40:
            return f"UCS_ERR_LINK_FAILURE({status})"
        if -89 <= status <= -60:
            return f"UCS_ERR_ENDPOINT_FAILURE({status})"
        return f"UCS_STATUS({status})"
