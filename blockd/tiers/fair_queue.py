"""The remote tier's fetch queue: a queue per tenant, served in turn.

One fetcher thread reads the cluster for every tenant of the daemon. With one first-in
first-out queue of all fetches, a tenant whose every admit is a local miss (a flood of distinct
prompts) would fill it, and every other tenant's fetches would be refused or wait behind its
own. Here each tenant has a queue of its own, bounded (``per_tenant``: beyond it, that tenant's
new fetch is refused, a miss that its engine computes, counted), and the thread takes from the
tenants in turn: a fetch waits behind at most one fetch of each other tenant that has fetches
queued, however many those queued, and no tenant can make another's fetch be refused.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, per_tenant: int) -> None:
        if per_tenant <= 0:
            raise ValueError(f"per_tenant: must be positive, got {per_tenant}")
        self.per_tenant = per_tenant
        #: Tenants with something queued, in the order they are served next.
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()
        self._cv = threading.Condition()
        self._closed = False

    def put(self, tenant: str, item: T) -> bool:
        """Queue ``item`` for ``tenant``; False (nothing queued) when that tenant already has
        ``per_tenant`` items waiting, or the queue is closed. Never blocks."""
        with self._cv:
            if self._closed:
                return False
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()
            elif len(queue) >= self.per_tenant:
                return False
            queue.append(item)
            self._cv.notify()
            return True

    def get(self, timeout: float) -> T | None:
        """The next tenant's oldest item (that tenant then goes to the back of the turn);
        None after ``timeout`` seconds with nothing queued, or once closed."""
        with self._cv:
            self._cv.wait_for(lambda: bool(self._queues) or self._closed, timeout)
            if self._closed or not self._queues:
                return None
            tenant, queue = self._queues.popitem(last=False)
            item = queue.popleft()
            if queue:
                self._queues[tenant] = queue
            return item

    def waiting(self, tenant: str) -> int:
        """Items ``tenant`` has queued."""
        with self._cv:
            return len(self._queues.get(tenant, ()))

    def close(self) -> None:
        """Wake the reader: every ``get`` from now on returns None; ``put`` refuses."""
        with self._cv:
            self._closed = True
            self._queues.clear()
            self._cv.notify_all()
