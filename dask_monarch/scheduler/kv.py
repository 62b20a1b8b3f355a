"""The rendezvous key-value store kept in the Dask scheduler (spec/dask-notes.md §7B).

Keys are strings, values bytes. Waiters are asyncio tasks on the scheduler's event loop. The semantics of
``add`` and ``compare_set`` follow ``torch.distributed.TCPStore``.
"""

from __future__ import annotations

import asyncio

__all__ = ["KeyValueStore"]


class KeyValueStore:
    """An in-memory store with blocking ``get``/``wait`` bounded by a timeout in seconds."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.aborted: set[str] = set()  # prefixes whose waits fail at once (their session ended)
        self._changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def set(self, key: str, value: bytes) -> None:
        self.data[key] = bytes(value)
        await self._notify()

    def _aborted(self, keys) -> str | None:
        for key in keys:
            for prefix in self.aborted:
                if key.startswith(prefix):
                    return prefix
        return None

    async def wait(self, keys: list, timeout: float) -> None:
        """Return once every key exists; ``TimeoutError`` naming the missing keys after ``timeout`` seconds;
        ``RuntimeError`` at once if the keys' session ended (``abort``)."""
        keys = list(keys)

        async def present():
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self._aborted(keys) is not None or all(k in self.data for k in keys)
                )

        try:
            await asyncio.wait_for(present(), timeout)
        except asyncio.TimeoutError:
            missing = [k for k in keys if k not in self.data]
            raise TimeoutError(f"rendezvous store: keys {missing} did not appear within {timeout:g} s") from None
        prefix = self._aborted(keys)
        if prefix is not None:
            raise RuntimeError(f"rendezvous aborted: the session of {prefix!r} ended")

    async def get(self, key: str, timeout: float) -> bytes:
        await self.wait([key], timeout)
        return self.data[key]

    async def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + int(amount)
        self.data[key] = str(value).encode()
        await self._notify()
        return value

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        current = self.data.get(key)
        if current is None:
            if expected == b"":
                self.data[key] = desired
                await self._notify()
                return desired
            return expected
        if current == expected:
            self.data[key] = desired
            await self._notify()
            return desired
        return current

    def check(self, keys: list) -> bool:
        return all(k in self.data for k in keys)

    def delete(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    async def abort(self, prefix: str) -> int:
        """End everything under ``prefix``: delete its keys and fail its pending and later waits."""
        self.aborted.add(prefix)
        doomed = [k for k in self.data if k.startswith(prefix)]
        for k in doomed:
            del self.data[k]
        await self._notify()
        return len(doomed)

    def num_keys(self) -> int:
        return len(self.data)
