"""What a TLS cluster protects for dask_monarch and what it does not (docs/security.md).

Everything that travels over Dask's own connections is protected by its ``distributed.Security``: the
controller's messages and answers (Dask tasks and their results), the rendezvous store (scheduler RPCs) and
the heartbeats. The collectives are not: gloo (CPU) and NCCL (GPU) connect the workers to each other directly
and carry tensor data in clear text, whatever Dask's TLS settings. So on a TLS cluster ``attach`` warns once per
process (``UnencryptedCommsWarning``); Dask config ``monarch.warn-unencrypted-comms: false`` silences it.
"""

from __future__ import annotations

import threading
import warnings

import dask
from distributed import Security

__all__ = ["CONFIG_KEY", "UnencryptedCommsWarning", "check_security", "warn_if_unencrypted"]

#: Dask config key: set it to false to silence the warning
CONFIG_KEY = "monarch.warn-unencrypted-comms"

_lock = threading.Lock()
_warned = False


class UnencryptedCommsWarning(UserWarning):
    """The cluster uses TLS, but the collectives between its workers (gloo, NCCL) are not encrypted."""


def check_security(security) -> None:
    """``security`` must be None or a ``distributed.Security``; ``TypeError`` naming it otherwise."""
    if security is not None and not isinstance(security, Security):
        raise TypeError(
            "security must be a distributed.Security (e.g. Security(tls_ca_file=..., tls_client_cert=..., "
            f"tls_client_key=..., require_encryption=True)), got {type(security).__name__}"
        )


def warn_if_unencrypted(scheduler_address: str, workers) -> bool:
    """Warn (once per process) when the scheduler or a mesh worker is reached over ``tls://``. Returns whether it
    warned now."""
    global _warned
    addresses = [scheduler_address, *workers]
    if not any(str(a).startswith("tls://") for a in addresses) or not dask.config.get(CONFIG_KEY, True):
        return False
    with _lock:
        if _warned:
            return False
        _warned = True
    warnings.warn(
        "dask_monarch: this Dask cluster uses TLS, which protects the controller's messages, the answers and the "
        "rendezvous store, but the collectives (Reduce and process groups: gloo on CPU, NCCL on GPU) connect the "
        "workers directly and carry tensor data unencrypted. Keep the workers on a trusted network; set Dask "
        f"config {CONFIG_KEY}: false to silence this warning",
        UnencryptedCommsWarning,
        stacklevel=3,
    )
    return True
